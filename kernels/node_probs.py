"""Draft-tree nodes and their estimated acceptance, one program per request.

A request's ``C`` candidate windows (the ``K`` tokens after each occurrence of its longest
match, -1 past a separator or the corpus end) form a trie: candidates ``c`` and ``c2`` share
the node at depth ``d`` when they agree on tokens ``0..d``. Per (candidate, depth):

* ``rep``: the lowest-index candidate sharing the node (the node's representative; ``C``
  where the window has no token);
* ``mass``: the summed weight of the candidates through the node; ``share`` = mass / total;
* ``calib_row [C]``: the calibration row of each candidate, ``(mode * T + tier) * (L + 1) +
  min(best, L)`` (the request's copy mode, the candidate's tier from its source tag, the
  match length);
* the node's estimated acceptance: ``share`` times, when calibrated, the product over the
  path's nodes (depths ``0..d``) of ``hits / seen`` at each node's representative's
  calibration row: a child's estimate never exceeds its parent's (``hits <= seen`` and a
  child's mass is part of its parent's), so best-first order is topological;
* ``key``: that estimate where ``(c, d)`` is a node (its own representative) within the depth
  cap ``k`` and at least ``min_prob``, ``-2`` elsewhere; flat index ``c * K + d``.

As batched torch ops this is about forty-five kernels over a ``[B, C, C, K]`` compare; the
kernel keeps a request's ``[C, K]`` windows in registers and walks the other candidates one
by one. The product runs in the torch path's order and precision (depths ascending,
accumulated in float64); the sums do not: the kernel adds a node's candidates one by one
in float32, torch's reduction in its own order. With weights whose sums are exact (small
dyadic ones: the tests' golden cases) both paths agree to the bit; with arbitrary weights
a key may differ in its last bits (an audit saw up to 3.6e-7 at 64 candidates, and a root
key of 1.0000001), so nodes tied to within that may rank differently on a CPU and a GPU:
another draft, never another output (verification decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_ints, check_tensors
from agspec_gpu.kernels._launch import next_pow2


# the kernel holds a request's [C, K] windows (padded to powers of two) in registers:
# spill-free at 16 x 128 and 32 x 32, 20 bytes spilled at 32 x 64 on sm_90, 1.7 KB at
# 64 x 64 (the defaults' 16 x 32 is 512); wider: torch
MAX_BLOCK_WINDOWS = 2048


# C (candidates) follows the batch's corpora: not specialized
@triton.jit(do_not_specialize=["C"])
def _node_probs_kernel(
    w_ptr,  # *int32 [B, C, K]  candidate windows, -1: no token
    s_ptr,  # *int32 [B, C, K]  source tags (only depth 0 is read), -1: none
    wt_ptr,  # *float32 [B, C]  candidate weights
    best_ptr,  # *int32 [B]  the request's match length
    mode_ptr,  # *int64 [B]  copy mode (1: the previous draft was fully accepted)
    k_ptr,  # *int32 [B]  depth cap
    hits_ptr,  # *float64 [R, KC]  calibration: accepted
    seen_ptr,  # *float64 [R, KC]  calibration: reached
    key_ptr,  # *float32 [B, C * K]  out
    rep_ptr,  # *int64 [B, C, K]  out
    row_ptr,  # *int64 [B, C]  out
    mass_ptr,  # *float32 [B, C, K]  out
    C,
    K,
    KC,  # columns of the calibration tables
    MAX_MATCH,  # L: rows per (mode, tier) are L + 1
    MIN_PROB,
    NUM_TIERS: tl.constexpr,
    CALIBRATE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(B,)``: one request's trie."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_K)
    in_c = c < C
    in_ck = in_c[:, None] & (d < K)[None, :]
    w = tl.load(w_ptr + (b * C + c[:, None]) * K + d[None, :], mask=in_ck, other=-1)
    valid = w >= 0
    # calibration row of each candidate: (mode, its tier, the match length)
    base = tl.load(mode_ptr + b) * NUM_TIERS
    best = tl.minimum(tl.load(best_ptr + b), MAX_MATCH).to(tl.int64)
    s0 = tl.load(s_ptr + (b * C + c) * K, mask=in_c, other=-1)
    row = (base + tl.where(s0 >= 0, s0 // 8, 0).to(tl.int64)) * (MAX_MATCH + 1) + best
    rep = tl.zeros((BLOCK_C, BLOCK_K), tl.int64) + C
    rep_row = tl.zeros((BLOCK_C, BLOCK_K), tl.int64)  # the representative's row
    mass = tl.zeros((BLOCK_C, BLOCK_K), tl.float32)
    c2 = 0
    while c2 < C:  # candidates ascending: the first that shares a node is its representative
        w2 = tl.load(w_ptr + (b * C + c2) * K + d, mask=d < K, other=-1)
        eq = (w == w2[None, :]) & valid
        first = tl.min(tl.where(eq, BLOCK_K, d[None, :]), axis=1)  # first mismatch depth
        same = d[None, :] < first[:, None]
        s2 = tl.load(s_ptr + (b * C + c2) * K)
        row2 = (base + tl.where(s2 >= 0, s2 // 8, 0).to(tl.int64)) * (MAX_MATCH + 1) + best
        rep_row = tl.where(same & (rep == C), row2, rep_row)
        rep = tl.where(same & (rep == C), c2, rep)
        mass += tl.where(same, tl.load(wt_ptr + b * C + c2), 0.0)
        c2 += 1
    total = tl.maximum(tl.sum(tl.load(wt_ptr + b * C + c, mask=in_c, other=0.0), axis=0), 1e-9)
    share = tl.math.div_rn(mass, total)  # IEEE-rounded, as torch's (`/` is div.full.f32)
    if CALIBRATE:
        # each node's chance hits / seen (rounded to float32) at its representative's row,
        # multiplied along the path in float64 as torch's CPU cumprod does
        h = tl.load(hits_ptr + rep_row * KC + d[None, :], mask=in_ck, other=1.0)
        s = tl.load(seen_ptr + rep_row * KC + d[None, :], mask=in_ck, other=1.0)
        step = (h / s).to(tl.float32)
        reach = tl.zeros((BLOCK_C, BLOCK_K), tl.float32)
        run = tl.zeros((BLOCK_C,), tl.float64) + 1.0
        dd = 0
        while dd < K:
            col = tl.sum(tl.where(d[None, :] == dd, step, 0.0), axis=1)  # exact: one term
            run = run * col.to(tl.float64)
            reach = tl.where(d[None, :] == dd, run.to(tl.float32)[:, None], reach)
            dd += 1
        prob = share * reach
    else:
        prob = share
    k = tl.load(k_ptr + b)
    node = valid & (rep == c[:, None]) & (d[None, :] < k) & (prob >= MIN_PROB)
    key = tl.where(node, prob, -2.0)
    tl.store(key_ptr + (b * C + c[:, None]) * K + d[None, :], key, mask=in_ck)
    tl.store(rep_ptr + (b * C + c[:, None]) * K + d[None, :], rep, mask=in_ck)
    tl.store(mass_ptr + (b * C + c[:, None]) * K + d[None, :], mass, mask=in_ck)
    tl.store(row_ptr + b * C + c, row, mask=in_c)


def node_probs(W: torch.Tensor, S: torch.Tensor, Wt: torch.Tensor, best: torch.Tensor,
               mode: torch.Tensor, k: torch.Tensor, calib_hits: torch.Tensor,
               calib_seen: torch.Tensor, *, num_tiers: int, max_match: int, min_prob: float,
               calibrate: bool, use_triton: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher: validates, then runs the Triton kernel on CUDA (or when ``use_triton``)
    for windows of up to ``MAX_BLOCK_WINDOWS`` padded tokens a request, the torch path
    otherwise.

    Args:
        W, S: ``int32 [B, C, K]`` candidate windows and their source tags (-1: none).
        Wt: ``float32 [B, C]`` candidate weights. best: ``int32 [B]`` match lengths.
        mode: ``int64 [B]`` copy mode. k: ``int32 [B]`` depth caps.
        calib_hits, calib_seen: ``float64 [R, KC]``, ``KC >= K``, rows as in the module
        docstring (``R >= 2 * num_tiers * (max_match + 1)``).

    Returns:
        ``(key float32 [B, C * K], rep int64 [B, C, K], calib_row int64 [B, C], mass
        float32 [B, C, K])``.
    """
    check_ints(("num_tiers", num_tiers, 1, 2 ** 15), ("max_match", max_match, 0, 2 ** 15))
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)):
        raise ValueError(f"min_prob: expected a float, got {min_prob!r}")
    if not isinstance(calibrate, bool):
        raise ValueError(f"calibrate: expected a bool, got {calibrate!r}")
    if W.dim() != 3:
        raise ValueError(f"W: expected int32 [B, C, K], got shape {tuple(W.shape)}")
    B, C, K = W.shape
    check_tensors(("W", W, torch.int32, (B, C, K)), ("S", S, torch.int32, (B, C, K)),
                  ("Wt", Wt, torch.float32, (B, C)), ("best", best, torch.int32, (B,)),
                  ("mode", mode, torch.int64, (B,)), ("k", k, torch.int32, (B,)),
                  ("calib_hits", calib_hits, torch.float64, calib_seen.shape),
                  ("calib_seen", calib_seen, torch.float64, calib_hits.shape))
    if calib_seen.dim() != 2 or calib_seen.shape[1] < K or \
            calib_seen.shape[0] < 2 * num_tiers * (max_match + 1):
        raise ValueError(f"calib_seen: expected [>= {2 * num_tiers * (max_match + 1)}, >= {K}]"
                         f", got {list(calib_seen.shape)}")
    check_devices(("W", W), ("S", S), ("Wt", Wt), ("best", best), ("mode", mode), ("k", k),
                  ("calib_hits", calib_hits), ("calib_seen", calib_seen))
    dev = W.device
    if not (B and C and K):  # no candidate or no column: no node (both paths)
        return (torch.full((B, C * K), -2.0, device=dev),
                torch.full((B, C, K), C, dtype=torch.int64, device=dev),
                torch.zeros(B, C, dtype=torch.int64, device=dev),
                torch.zeros(B, C, K, device=dev))
    if use_triton is None:
        use_triton = W.is_cuda
    use_triton = use_triton and next_pow2(C) * next_pow2(K) <= MAX_BLOCK_WINDOWS
    if not use_triton:
        return node_probs_torch(W, S, Wt, best, mode, k, calib_hits, calib_seen,
                                num_tiers=num_tiers, max_match=max_match, min_prob=min_prob,
                                calibrate=calibrate)
    W, S, Wt, best, mode, k = (t.contiguous() for t in (W, S, Wt, best, mode, k))
    calib_hits, calib_seen = calib_hits.contiguous(), calib_seen.contiguous()
    key = torch.empty(B, C * K, dtype=torch.float32, device=dev)
    rep = torch.empty(B, C, K, dtype=torch.int64, device=dev)
    row = torch.empty(B, C, dtype=torch.int64, device=dev)
    mass = torch.empty(B, C, K, dtype=torch.float32, device=dev)
    _node_probs_kernel[(B,)](
        W, S, Wt, best, mode, k, calib_hits, calib_seen, key, rep, row, mass, C, K,
        calib_seen.shape[1], max_match, float(min_prob), NUM_TIERS=num_tiers,
        CALIBRATE=calibrate, BLOCK_C=next_pow2(C),
        BLOCK_K=next_pow2(K))
    return key, rep, row, mass


def node_probs_torch(W, S, Wt, best, mode, k, calib_hits, calib_seen, *, num_tiers: int,
                     max_match: int, min_prob: float, calibrate: bool):
    """Pure-torch implementation of :func:`node_probs` (same results as the kernel)."""
    B, C, K = W.shape
    dev = W.device
    valid = W >= 0
    # same[b, c, c2, d]: candidates c and c2 agree on tokens 0..d
    eq = (W[:, :, None, :] == W[:, None, :, :]) & valid[:, :, None, :]
    same = torch.cumprod(eq.to(torch.int8), dim=3).bool()
    # representative: lowest-index candidate with the same prefix (the most recent one)
    cidx = torch.arange(C, device=dev)
    # small [B, C, C, K] temporaries (they dominate on the CPU): int16 indices
    cnar = cidx.to(torch.int16 if C < (1 << 15) else torch.int64)
    rep = torch.where(same, cnar[None, None, :, None], C).min(dim=2).values.long()  # [B, C, K]
    mass = torch.where(same, Wt[:, None, :, None], 0.0).sum(dim=2)  # [B, C, K]
    total = Wt.sum(dim=1).clamp(min=1e-9)
    share = mass / total[:, None, None]
    D1 = max_match + 1
    # calibration row of every candidate: (mode, its tier, the request's match length)
    cand_tier = torch.where(S[:, :, 0] >= 0, S[:, :, 0] // 8, 0).long()
    calib_row = (mode[:, None] * num_tiers + cand_tier) * D1 + \
        best.long().clamp(max=D1 - 1)[:, None]  # [B, C]
    # estimated acceptance: path share among candidates x calibrated chance that the path
    # survives to this depth (a node uses its representative candidate's row)
    if calibrate:
        # each node's chance at its representative's row (rep = C: no node), multiplied
        # along the path: a child's estimate never exceeds its parent's
        q = (calib_hits / calib_seen).to(torch.float32)
        step = q[calib_row, :K].gather(1, rep.clamp(max=C - 1))  # [B, C, K]
        prob = share * torch.cumprod(step, dim=2)
    else:
        prob = share
    depth = torch.arange(K, device=dev)
    is_node = valid & (rep == cidx[None, :, None]) & (depth[None, None, :] < k[:, None, None])
    is_node &= prob >= min_prob
    return torch.where(is_node, prob, -2.0).view(B, C * K), rep, calib_row, mass
