"""The batch-level draft budget: which of a step's draft nodes are worth verifying.

Verifying ``B`` roots plus ``n`` draft nodes costs ``cost(B + n)`` (measured per model and
GPU) and returns ``B`` tokens plus the nodes' expected acceptances. Over the batch's node
scores sorted descending, the budget finds the ``n*`` that maximises ``(B + sum of the top
n scores) / cost(B + n)`` (ties: the smaller ``n``) and keeps exactly ``n*`` nodes: every
node scoring above the ``n*``-th score, and of the nodes scoring just that, the ones of
shallower best-first rank first, then of the lower request index (each request keeps a
prefix of its best-first order, so a tree). Exactly: a cost measured per CUDA-graph bucket
is a staircase whose best ``n*`` sits on an edge, and nodes tied at the cut kept past it
would pay a whole next bucket (41 of 102 full steps at B = 64 in a replay under the H100's
staircase, before this rule). With a ``table_base`` the cost is read at ``table_base + n``
instead: a staircase measured at ``table_base`` requests whose edges are draft counts, the
same at any batch (``CostModel.steps``: a CUDA-graph bucket's edges). The table must not
fall (``controller.cost_table`` builds it so): where it does, ``n*`` may count nodes that
score nothing, and fewer are kept.

The sums are exact: scores are summed as integers in units of ``2**-32`` (a probability to
~2e-10), so the kernel's parallel prefix sum and torch's sequential one agree bit for bit
and so do the steps they choose. In torch the cut is ~40 small ops in the drafter's propose
graph (a mask, a sort, the prefix sum, the objective, a gather, the ties' ordinals,
per-request counts); the
kernel is one program that holds the batch's scores (up to ``MAX_SCORES``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors, is_py_int
from agspec_gpu.kernels._launch import next_pow2

UNIT = 2.0 ** 32  # scores are summed in units of 1 / UNIT
MAX_SCORES = 16384  # the most scores one program sorts (padded to a power of two)


def num_warps(block: int) -> int:
    """Warps of the one program that sorts ``block`` (a power of two) scores: no register
    spills up to 4,096 scores (64 requests x 64 nodes; ``ptxas -v`` for sm_90,
    ``tests/test_batch_budget.py``). Past that the most threads a program has: 8,192
    scores (128 requests) spill 64 bytes per thread at 32 warps (216 at 16), 16,384 (256
    requests) 784 (1,348 at 16): a larger batch would need a sort across programs."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 32


# the batch size and request count are not specialized (one compile per block shape)
@triton.jit(do_not_specialize=["nreq_val", "table_base", "B"])
def _budget_keep_kernel(
    ranked_ptr,  # *float32 [B, N]  each request's node scores, best first; < -1.5: no node
    keep_ptr,  # *int64 [B]  nodes each request may keep (before the budget)
    out_ptr,  # *int64 [B]  out: nodes each request keeps
    nreq_ptr,  # *int64 []  roots verified anyway (read when NREQ_FROM_PTR)
    table_ptr,  # *float64 [T]  cost(m), m = 0 .. T - 1
    nreq_val,
    table_base,  # HAS_BASE: n draft nodes cost table[table_base + n] (else table[roots + n])
    B,
    N,
    T,
    NREQ_FROM_PTR: tl.constexpr,
    HAS_BASE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(1,)``: the whole batch in one program."""
    b = tl.arange(0, BLOCK_B)[:, None]
    j = tl.arange(0, BLOCK_N)[None, :]
    inb = (b < B) & (j < N)
    ranked = tl.load(ranked_ptr + b * N + j, mask=inb, other=-2.0)
    keep = tl.load(keep_ptr + b, mask=b < B, other=0)  # [BLOCK_B, 1]
    flat = tl.where((ranked > -1.5) & (j < keep) & inb, ranked, -1.0)
    s = tl.sort(tl.reshape(flat, [BLOCK_B * BLOCK_N]), descending=True)
    q = (tl.maximum(s, 0.0).to(tl.float64) * 4294967296.0).to(tl.int64)  # UNIT
    if NREQ_FROM_PTR:
        nreq = tl.maximum(tl.load(nreq_ptr), 0)  # (as torch reads a negative count)
    else:
        nreq = nreq_val + tl.zeros([], dtype=tl.int64)
    base = nreq * 4294967296
    if HAS_BASE:
        first = table_base + tl.zeros([], dtype=tl.int64)  # where n = 0 is priced
    else:
        first = nreq
    i = tl.arange(0, BLOCK_B * BLOCK_N)
    n = i + 1  # nodes taken with the i-th score
    t = tl.load(table_ptr + tl.minimum(first + n, T - 1))
    gain = (base + tl.cumsum(q, axis=0)).to(tl.float64)
    ratio = tl.where(n <= B * N, gain / tl.maximum(t, 1e-9), -1.0)  # ratios are >= 0
    best, at = tl.max(ratio, axis=0, return_indices=True, return_indices_tie_break_left=True)
    t0 = tl.load(table_ptr + tl.minimum(first, T - 1))
    ratio0 = base.to(tl.float64) / tl.maximum(t0, 1e-9)
    nstar = tl.where(ratio0 >= best, 0, at + 1)
    nth = tl.sum(tl.where(i == nstar - 1, s, 0.0), axis=0)
    thresh = tl.where(nstar > 0, tl.maximum(nth, 1e-12), 2.0)
    above = flat > thresh
    tie = (flat == thresh).to(tl.int64)  # [BLOCK_B, BLOCK_N]
    # each tie's ordinal in (rank, request) order; the first nstar - (nodes above) are kept
    col = tl.sum(tie, axis=0)  # [BLOCK_N]
    ordinal = tl.cumsum(tie, axis=0) - tie + (tl.cumsum(col, axis=0) - col)[None, :]
    ties_left = nstar - tl.sum(tl.sum(above.to(tl.int64), axis=1), axis=0)
    kept = above | ((tie > 0) & (ordinal < ties_left))
    count = tl.sum(kept.to(tl.int64), axis=1)  # [BLOCK_B]
    rows = tl.arange(0, BLOCK_B)
    tl.store(out_ptr + rows, tl.minimum(tl.reshape(keep, [BLOCK_B]), count), mask=rows < B)


def budget_count_torch(scores: torch.Tensor, num_requests: int | torch.Tensor,
                       table: torch.Tensor, table_base: int | None = None) -> torch.Tensor:
    """``int64 []`` the ``n*`` of descending ``scores`` (``float [M]``, ``>= 0``) for
    ``num_requests`` roots (an int or an ``int64 []`` device tensor) under ``table``
    (``float64``, ``cost(m)`` at index ``m``; indices past its end read its last entry),
    ``n`` nodes priced at ``table[num_requests + n]``, or ``table[table_base + n]``."""
    M = scores.numel()
    if isinstance(num_requests, torch.Tensor):
        num_requests = num_requests.clamp(min=0)  # a negative count is none
    q = (scores.double() * UNIT).long()
    gain = (torch.cat([q.new_zeros(1), torch.cumsum(q, 0)]) + num_requests * (1 << 32))
    at = torch.arange(M + 1, device=scores.device) + (
        num_requests if table_base is None else table_base)
    t = table.gather(0, at.clamp(max=table.numel() - 1))
    return torch.argmax(gain.double() / t.clamp(min=1e-9))


def budget_keep_torch(ranked: torch.Tensor, keep_n: torch.Tensor,
                      num_requests: int | torch.Tensor, table: torch.Tensor,
                      table_base: int | None = None) -> torch.Tensor:
    """Pure-torch implementation of :func:`budget_keep`."""
    N = ranked.shape[1]
    rank = torch.arange(N, device=ranked.device)[None, :]
    flat = torch.where((ranked > -1.5) & (rank < keep_n[:, None]), ranked, -1.0)
    allv, _ = torch.sort(flat.reshape(-1), descending=True)
    nstar = budget_count_torch(allv.clamp(min=0), num_requests, table, table_base)
    # gather with a [1] index: indexing by the 0-d nstar would read it to the host
    nth = allv.gather(0, (nstar - 1).clamp(min=0).reshape(1))
    thresh = torch.where(nstar > 0, nth.clamp(min=1e-12), 2.0)  # [1]
    above = flat > thresh
    tie = (flat == thresh).long()
    # each tie's ordinal in (rank, request) order; the first nstar - (nodes above) are kept
    ordinal = (tie.t().reshape(-1).cumsum(0) - tie.t().reshape(-1)).view(N, -1).t()
    kept = above | ((tie > 0) & (ordinal < nstar - above.sum()))
    return torch.minimum(keep_n, kept.sum(dim=1))


def budget_keep(ranked: torch.Tensor, keep_n: torch.Tensor, num_requests: int | torch.Tensor,
                table: torch.Tensor, *, table_base: int | None = None,
                use_triton: bool | None = None) -> torch.Tensor:
    """Each request's nodes after the batch budget.

    Parameters
    ----------
    ranked : ``float32 [B, N]`` each request's node scores in best-first order (values
        ``< -1.5``: no node); ``keep_n`` : ``int64 [B]`` how many of them it may keep.
    num_requests : the roots verified anyway (an int in ``[0, 2**31)``, or an ``int64 []``
        device tensor: the real batch of a padded step; a negative one counts as 0).
    table : ``float64 [T]``, ``cost(m)`` at index ``m`` (``T > (table_base if not None
        else num_requests) + B * N`` for exact costs; past its end the last entry is read).
    table_base : ``n`` nodes cost ``table[table_base + n]`` (a staircase measured at
        ``table_base`` requests, ``CostModel.table_base``); None: ``table[num_requests +
        n]``.
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors whose batch fits one program (``MAX_SCORES``).

    Returns
    -------
    ``int64 [B]`` summing to ``n*`` (for a table that does not fall, and scores in ``[0,
    1]``): the nodes scoring above the ``n*``-th best score of the batch, and the ones
    tied with it in (best-first rank, request) order up to ``n*``; 0 everywhere when ``n*
    = 0``.
    """
    if ranked.dim() != 2:
        raise ValueError(f"ranked: expected float32 [B, N], got shape {tuple(ranked.shape)}")
    B, N = ranked.shape
    check_tensors(("ranked", ranked, torch.float32, (B, N)),
                  ("keep_n", keep_n, torch.int64, (B,)),
                  ("table", table, torch.float64, (max(table.numel(), 1),)))
    tensor_n = isinstance(num_requests, torch.Tensor)
    if tensor_n:
        check_tensors(("num_requests", num_requests, torch.int64, ()))
    elif not is_py_int(num_requests) or not 0 <= num_requests < 2 ** 31:
        raise ValueError(f"num_requests: expected an int in [0, 2**31) or an int64 [] tensor, "
                         f"got {num_requests!r}")
    if table_base is not None and not (is_py_int(table_base) and 0 <= table_base < 2 ** 31):
        raise ValueError(f"table_base: expected an int in [0, 2**31) or None, got "
                         f"{table_base!r}")
    check_devices(("ranked", ranked), ("keep_n", keep_n), ("table", table),
                  *((("num_requests", num_requests),) if tensor_n else ()))
    # at least 16 rows: the small batch buckets share one compiled kernel
    block_b, block_n = max(next_pow2(B), 16), next_pow2(max(N, 1))
    if use_triton is None:
        use_triton = ranked.device.type == "cuda" and block_b * block_n <= MAX_SCORES
    if B == 0 or N == 0:  # no nodes to keep
        return torch.zeros_like(keep_n)
    if not use_triton:
        return budget_keep_torch(ranked, keep_n, num_requests, table, table_base)
    out = torch.empty(B, dtype=torch.int64, device=ranked.device)
    _budget_keep_kernel[(1,)](ranked.contiguous(), keep_n.contiguous(), out,
                              num_requests if tensor_n else keep_n, table.contiguous(),
                              0 if tensor_n else num_requests,
                              0 if table_base is None else table_base, B, N, table.numel(),
                              NREQ_FROM_PTR=tensor_n, HAS_BASE=table_base is not None,
                              BLOCK_B=block_b, BLOCK_N=block_n,
                              num_warps=num_warps(block_b * block_n))
    return out
