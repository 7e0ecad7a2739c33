"""A draft tree's nodes in best-first order, then as the draft's arrays: one program per request.

After :mod:`~agspec_gpu.kernels.node_probs` every (candidate ``c``, depth ``d``) of a
request's trie has a key (its estimated acceptance if it is a node, -2 if not; flat index
``c * K + d``; a node's key below 0, a -0.0, ranks and reads as 0.0). Two steps, with the
batch's budget between them (it ranks every request's best nodes at once):

* :func:`best_first`: the ``N`` best entries of each request, ordered by key descending,
  then the shallower depth, then the lower candidate (``order int64 [B, N]`` flat indices,
  ``ranked float32 [B, N]`` their keys), and ``keep int64 [B]``: the nodes, at most
  ``max_nodes``. The kernel sorts one integer per entry that packs the key's bits (non-
  negative floats order as their bit patterns) above the tie-break, so one descending sort is
  the torch path's two stable sorts;
* :func:`emit_nodes`: the first ``num[b]`` of ``order`` as draft nodes: token, source tag,
  parent (the node of the representative one level up), depth and calibration row. Entries
  past ``num`` carry ``PAD_ID`` tokens and parents, -1 sources; their depth and row are
  those of the ranked entry (unused).

As batched torch ops the two are about seventy kernels (argsorts, gathers, a scatter for the
parents' inverse map); each kernel keeps a request in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_ints, check_ndims, check_tensors
from agspec_gpu.kernels._launch import next_pow2

PAD_ID = -1
_PAD = tl.constexpr(PAD_ID)  # what a kernel may read of it
_TIE_BITS = 20  # the tie-break (depth * C + candidate) fits below the key's bits
# emit_nodes keeps a [BLOCK_N, BLOCK_N] parent compare in registers: spill-free up to 128
# nodes on sm_90, and over 1024 it exceeds Triton's 2**20 elements a block; wider: torch
MAX_BLOCK_N = 128
# best_first sorts a request's C * K keys in registers: 16 bytes spilled at 2048 on sm_90,
# 220 at 4096 (the defaults' 16 x 32 is 512); wider: torch
MAX_BLOCK_KEYS = 2048


# C (candidates) and N (kept nodes) follow the batch's corpora: not specialized
@triton.jit(do_not_specialize=["C", "N"])
def _best_first_kernel(
    key_ptr,  # *float32 [B, CK]  node keys, -2: no node
    order_ptr,  # *int64 [B, N]  out: flat indices c * K + d, best first
    ranked_ptr,  # *float32 [B, N]  out: their keys
    keep_ptr,  # *int64 [B]  out: nodes, at most MAX_NODES
    C,
    K,
    N,
    MAX_NODES,
    BLOCK: tl.constexpr,
):
    """Grid ``(B,)``: one request's ranking."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    CK = C * K
    inb = j < CK
    key = tl.load(key_ptr + b * CK + j, mask=inb, other=-2.0)
    node = inb & (key > -1.5)
    tie = (j % K) * C + j // K  # depth-major: the shallower node, then the lower candidate
    # a node's key as its float bits (order-preserving for keys >= 0); a negative one
    # (-0.0, a rounding below 0) has the sign bit: it ranks as 0.0, as in the torch path
    kbits = tl.where(node, tl.maximum(key.to(tl.int32, bitcast=True), 0), -1).to(tl.int64)
    packed = (kbits << 32) | ((1 << 20) - 1 - tie).to(tl.int64)
    packed = tl.where(inb, packed, -(1 << 62))  # entries past C * K sort last
    s = tl.sort(packed, descending=True)
    t = (1 << 20) - 1 - (s & 0xFFFFFFFF)
    flat = (t % C) * K + t // C
    kb = (s >> 32).to(tl.int32)
    val = tl.where(kb >= 0, kb.to(tl.float32, bitcast=True), -2.0)
    tl.store(order_ptr + b * N + j, flat, mask=j < N)
    tl.store(ranked_ptr + b * N + j, val, mask=j < N)
    tl.store(keep_ptr + b, tl.minimum(tl.sum(node.to(tl.int64), axis=0), MAX_NODES))


@triton.jit(do_not_specialize=["C", "N"])  # as _best_first_kernel's
def _emit_nodes_kernel(
    order_ptr,  # *int64 [B, N]  flat indices c * K + d, best first
    num_ptr,  # *int64 [B]  nodes kept
    w_ptr,  # *int32 [B, C, K]  candidate windows
    s_ptr,  # *int32 [B, C, K]  their source tags
    rep_ptr,  # *int64 [B, C, K]  node representatives
    row_ptr,  # *int64 [B, C]  calibration rows
    tok_ptr,  # *int32 [B, N]  out: tokens, PAD_ID padded
    par_ptr,  # *int32 [B, N]  out: parents (-1: a child of the root), PAD_ID padded
    src_ptr,  # *int8 [B, N]  out: source tags, -1 padded
    nd_ptr,  # *int64 [B, N]  out: depths
    nrow_ptr,  # *int64 [B, N]  out: calibration rows
    C,
    K,
    N,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(B,)``: one request's nodes."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    inb = i < N
    num = tl.load(num_ptr + b)
    valid = inb & (i < num)
    f = tl.load(order_ptr + b * N + i, mask=inb, other=0)
    c = f // K
    d = f % K
    at = (b * C + c) * K + d
    tok = tl.load(w_ptr + at, mask=valid, other=-1)
    src = tl.load(s_ptr + at, mask=valid, other=-1)
    # the parent is the node (rep[c, d - 1], d - 1), looked up among the kept nodes
    up = tl.load(rep_ptr + at - 1, mask=valid & (d > 0), other=0)
    want = up * K + d - 1
    hit = (f[None, :] == want[:, None]) & valid[None, :]  # (lanes past N: not nodes)
    parent = tl.max(tl.where(hit, i[None, :], -1), axis=1)
    parent = tl.where(d > 0, parent, -1)
    tl.store(tok_ptr + b * N + i, tl.where(valid, tok, _PAD), mask=inb)
    tl.store(par_ptr + b * N + i, tl.where(valid, parent, _PAD), mask=inb)
    tl.store(src_ptr + b * N + i, tl.where(valid, src, -1).to(tl.int8), mask=inb)
    tl.store(nd_ptr + b * N + i, d, mask=inb)
    tl.store(nrow_ptr + b * N + i, tl.load(row_ptr + b * C + c, mask=inb, other=0), mask=inb)


def best_first(key: torch.Tensor, C: int, K: int, N: int, max_nodes: int, *,
               use_triton: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order int64 [B, N], ranked float32 [B, N], keep int64 [B])`` of ``key float32 [B,
    C * K]`` (see the module docstring); ``N <= C * K``. Triton on CUDA (or when
    ``use_triton``) up to ``MAX_BLOCK_KEYS`` keys a request, the torch path otherwise."""
    check_ints(("C", C, 0, None), ("K", K, 0, None), ("N", N, 0, None),
               ("max_nodes", max_nodes, 0, None))
    check_ndims(("key", key, 2))
    B = key.shape[0]
    check_tensors(("key", key, torch.float32, (B, C * K)))
    if N > C * K or C * K >= 1 << _TIE_BITS:
        raise ValueError(f"N must be in [0, C * K] and C * K < {1 << _TIE_BITS}, got N={N}, "
                         f"C={C}, K={K}")
    if use_triton is None:
        use_triton = key.is_cuda
    if not use_triton or C * K > MAX_BLOCK_KEYS:
        return best_first_torch(key, C, K, N, max_nodes)
    order = torch.empty(B, N, dtype=torch.int64, device=key.device)
    ranked = torch.empty(B, N, dtype=torch.float32, device=key.device)
    keep = torch.zeros(B, dtype=torch.int64, device=key.device)
    if B and C * K:
        _best_first_kernel[(B,)](key.contiguous(), order, ranked, keep, C, K, N, max_nodes,
                                 BLOCK=next_pow2(C * K))
    return order, ranked, keep


def emit_nodes(order: torch.Tensor, num: torch.Tensor, W: torch.Tensor, S: torch.Tensor,
               rep: torch.Tensor, calib_row: torch.Tensor, *, use_triton: bool | None = None
               ) -> tuple[torch.Tensor, ...]:
    """``(token_ids int32, parents int32, sources int8, depth int64, calib_row int64)``, each
    ``[B, N]``, of the first ``num int64 [B]`` entries of ``order int64 [B, N]`` over windows
    ``W``, sources ``S int32 [B, C, K]``, representatives ``rep int64 [B, C, K]`` and rows
    ``calib_row int64 [B, C]``. Triton on CUDA (or when ``use_triton``) up to
    ``MAX_BLOCK_N`` nodes, torch otherwise."""
    check_ndims(("order", order, 2), ("W", W, 3))
    B, N = order.shape
    _, C, K = W.shape
    check_tensors(("order", order, torch.int64, (B, N)), ("num", num, torch.int64, (B,)),
                  ("W", W, torch.int32, (B, C, K)), ("S", S, torch.int32, (B, C, K)),
                  ("rep", rep, torch.int64, (B, C, K)),
                  ("calib_row", calib_row, torch.int64, (B, C)))
    check_devices(("order", order), ("num", num), ("W", W), ("S", S), ("rep", rep),
                  ("calib_row", calib_row))
    if use_triton is None:
        use_triton = order.is_cuda
    if not use_triton or N > MAX_BLOCK_N:
        return emit_nodes_torch(order, num, W, S, rep, calib_row)
    dev = order.device
    tok = torch.empty(B, N, dtype=torch.int32, device=dev)
    par = torch.empty(B, N, dtype=torch.int32, device=dev)
    src = torch.empty(B, N, dtype=torch.int8, device=dev)
    nd = torch.empty(B, N, dtype=torch.int64, device=dev)
    nrow = torch.empty(B, N, dtype=torch.int64, device=dev)
    if B and N:
        _emit_nodes_kernel[(B,)](order.contiguous(), num.contiguous(), W.contiguous(),
                                 S.contiguous(), rep.contiguous(), calib_row.contiguous(),
                                 tok, par, src, nd, nrow, C, K, N,
                                 BLOCK_N=next_pow2(N))
    return tok, par, src, nd, nrow


# ------------------------------------------------------------------------ torch path
def best_first_torch(key: torch.Tensor, C: int, K: int, N: int, max_nodes: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch implementation of :func:`best_first`: two stable sorts (a float epsilon
    on the key would lose the tie-break: at p >= 1/4 a float32 ulp is as large as it)."""
    B, dev = key.shape[0], key.device
    # nodes' keys >= +0.0; any other key (-2, or one the kernel reads as no node: NaN,
    # below -1.5) is -2, so non-nodes tie and rank by depth, then candidate, as there
    key = torch.where(key > -1.5, key.clamp(min=0.0) + 0.0, -2.0)
    tie_rank = (torch.arange(K, device=dev)[None, :] * C +
                torch.arange(C, device=dev)[:, None]).reshape(1, C * K)
    by_tie = torch.argsort(tie_rank, dim=1).expand(B, -1)  # depth-major, then candidate
    order = by_tie.gather(1, torch.argsort(key.gather(1, by_tie), dim=1, descending=True,
                                           stable=True))[:, :N]
    ranked = key.gather(1, order)
    keep = torch.clamp((key > -1.5).sum(dim=1), max=max_nodes)
    return order, ranked, keep


def emit_nodes_torch(order, num, W, S, rep, calib_row) -> tuple[torch.Tensor, ...]:
    """Pure-torch implementation of :func:`emit_nodes`."""
    B, N = order.shape
    _, C, K = W.shape
    dev = order.device
    node_order = (order % K) * C + order // K  # depth-major flat index d * C + c
    nd = node_order // C  # depth
    nc = node_order % C  # candidate
    valid = torch.arange(N, device=dev)[None, :] < num[:, None]
    tok = torch.where(valid, W.permute(0, 2, 1).reshape(B, K * C).gather(1, node_order),
                      PAD_ID)
    srcs = torch.where(valid, S.permute(0, 2, 1).reshape(B, K * C).gather(1, node_order), -1)
    # parent: the node (rep[c, d - 1], d - 1); the node index of each kept (depth,
    # candidate), padding scattered to a spare column
    idx_of = torch.full((B, K * C + 1), -1, dtype=torch.int64, device=dev)
    idx_of.scatter_(1, torch.where(valid, node_order, K * C),
                    torch.where(valid, torch.arange(N, device=dev)[None, :], -1))
    prev_rep = rep.permute(0, 2, 1).reshape(B, K * C)  # rep at (d, c)
    pd = (nd - 1).clamp(min=0)
    # a representative outside [0, C) (an entry past the kept nodes) is no node: no parent,
    # as the kernel's lookup finds none
    up = prev_rep.gather(1, pd * C + nc)
    parent = torch.where((nd > 0) & (up >= 0) & (up < C),
                         idx_of.gather(1, pd * C + up.clamp(0, C - 1)), -1)
    parent = torch.where(valid, parent, PAD_ID)
    return (tok.to(torch.int32), parent.to(torch.int32), srcs.to(torch.int8), nd,
            calib_row.gather(1, nc))
