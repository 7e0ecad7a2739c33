"""Which corpora supply a request's draft candidates, and their windows regrouped per request.

A request's match has one row per corpus it may draft from (session, workspace, history,
global tier). The rows whose match, plus their tier's bonus, is within ``slack`` of the
request's best (and at least ``min_match`` long) supply candidates; the best ``num_slots``
of them by that score (ties: the earlier row) fill the request's candidate slots in that
order. Each slot holds its row's ``P`` windows of ``K`` tokens, cut at the first separator
(a negative id), their sources, and a weight per window: the tier's learned acceptance
share, 0 for a window that is empty after the cut.

In torch this is ~45 small ops inside the drafter's propose graph (a replayed kernel each on
a GPU); the kernel does it in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors, is_py_int
from agspec_gpu.kernels._launch import next_pow2

PAD_ID = -1


# tier: a view of the drafter's staging ring when its step runs without a graph (any
# alignment; read a scalar at a time)
@triton.jit(do_not_specialize_on_alignment=["tier_ptr"])
def _candidate_rows_kernel(
    tier_ptr,  # *int64 [B, R]  each row's tier, -1: no corpus (its length is 0)
    length_ptr,  # *int32 [B, R]  match length per row
    win_ptr,  # *int32 [B, R, P, K]  candidate windows
    src_ptr,  # *int8 [B, R, P, K]  their sources
    bonus_ptr,  # *int32 [T]  match-length bonus per tier
    hits_ptr,  # *float64 [T]  accepted draft tokens per tier (decayed)
    drafts_ptr,  # *float64 [T]  drafted tokens per tier (decayed)
    w_out_ptr,  # *int32 [B, NSLOT, P, K]  out: windows cut at separators, PAD_ID padded
    s_out_ptr,  # *int32 [B, NSLOT, P, K]  out: sources, -1 padded
    wt_out_ptr,  # *float32 [B, NSLOT, P]  out: window weights
    best_ptr,  # *int32 [B]  out: longest match among the rows that supply candidates
    longest_ptr,  # *int32 [B]  out: longest match of any row
    R,
    P,
    K,
    MIN_MATCH,
    SLACK,
    NSLOT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(B,)``: one request's rows, then its ``NSLOT`` slots one after another."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    length = tl.load(length_ptr + b * R + r, mask=rm, other=0)
    tier = tl.maximum(tl.load(tier_ptr + b * R + r, mask=rm, other=0), 0)
    bonus = tl.load(bonus_ptr + tier, mask=rm, other=0)
    score = tl.where(length > 0, length + bonus, 0)
    best_score = tl.max(score, axis=0)
    use = rm & (score >= best_score - SLACK) & (length >= MIN_MATCH)
    tl.store(best_ptr + b, tl.max(tl.where(use, length, 0), axis=0))
    tl.store(longest_ptr + b, tl.max(length, axis=0))
    # rank among the used rows: higher score first, then the earlier row
    key = tl.where(use, score.to(tl.int64) * R + (R - 1 - r), -1)
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), axis=1)
    rslot = tl.where(use & (rank < NSLOT), rank, NSLOT)

    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, BLOCK_K)
    live = (p[:, None] < P) & (k[None, :] < K)
    for j in range(NSLOT):
        sel = rslot == j  # at most one row
        has = tl.sum(sel.to(tl.int32), axis=0) > 0
        row = tl.sum(tl.where(sel, r, 0), axis=0).to(tl.int64)
        t = tl.sum(tl.where(sel, tier, 0), axis=0)
        at = ((b * R + row) * P + p[:, None]) * K + k[None, :]
        w = tl.load(win_ptr + at, mask=live & has, other=-1)
        s = tl.load(src_ptr + at, mask=live & has, other=-1).to(tl.int32)
        # the window up to its first separator (or end): cumprod(w >= 0) along K
        first_bad = tl.min(tl.where((w < 0) | (k[None, :] >= K), k[None, :], BLOCK_K),
                           axis=1)
        ok = k[None, :] < first_bad[:, None]
        tw = (tl.load(hits_ptr + t) / tl.load(drafts_ptr + t)).to(tl.float32)
        wt = tl.where(has & (first_bad > 0), tw, 0.0)
        out = ((b * NSLOT + j) * P + p[:, None]) * K + k[None, :]
        tl.store(w_out_ptr + out, tl.where(ok, w, -1), mask=live)  # -1: PAD_ID
        tl.store(s_out_ptr + out, s, mask=live)
        tl.store(wt_out_ptr + (b * NSLOT + j) * P + p, wt, mask=p < P)


def candidate_rows_torch(tier, length, win, src, tier_bonus, tier_hits, tier_drafts, *,
                         num_slots: int, min_match: int, slack: int):
    """Pure-torch implementation of :func:`candidate_rows`."""
    B, R, P, K = win.shape
    dev = win.device
    longest = length.max(dim=1).values
    score = torch.where(length > 0, length + tier_bonus[tier.clamp(min=0)], 0)
    best_score = score.max(dim=1).values
    # in int64: a slack or min_match past int32 (the config bounds neither) must not wrap
    use = (score.long() >= best_score[:, None].long() - slack) & (length.long() >= min_match)
    best = torch.where(use, length, 0).max(dim=1).values
    win = torch.where(use[:, :, None, None], win, PAD_ID)
    ok = torch.cumprod((win >= 0).to(torch.int32), dim=3).bool()  # stop at separators
    win = torch.where(ok, win, PAD_ID)
    src = torch.where(use[:, :, None, None], src.to(torch.int32), -1)
    tw = (tier_hits / tier_drafts).to(torch.float32)[tier.clamp(min=0)]
    w = torch.where(ok[:, :, :, 0], tw[:, :, None], 0.0)  # [B, R, P]
    r = torch.arange(R, device=dev)
    key = torch.where(use, score.to(torch.int64) * R + (R - 1 - r), -1)
    rank = (key[:, None, :] > key[:, :, None]).sum(dim=2)  # rows of the request above
    rslot = torch.where(use & (rank < num_slots), rank, num_slots)  # slot num_slots: dropped
    b = torch.arange(B, device=dev)[:, None].expand(B, R)
    W = torch.full((B, num_slots + 1, P, K), PAD_ID, dtype=torch.int32, device=dev)
    S = torch.full((B, num_slots + 1, P, K), -1, dtype=torch.int32, device=dev)
    Wt = torch.zeros(B, num_slots + 1, P, device=dev)
    W[b, rslot] = win
    S[b, rslot] = src
    Wt[b, rslot] = w
    C = num_slots * P
    return (W[:, :num_slots].reshape(B, C, K), S[:, :num_slots].reshape(B, C, K),
            Wt[:, :num_slots].reshape(B, C), best, longest)


def candidate_rows(tier: torch.Tensor, length: torch.Tensor, win: torch.Tensor,
                   src: torch.Tensor, tier_bonus: torch.Tensor, tier_hits: torch.Tensor,
                   tier_drafts: torch.Tensor, *, num_slots: int, min_match: int, slack: int,
                   use_triton: bool | None = None):
    """A request's candidate windows from the rows (corpora) of its match.

    Parameters
    ----------
    tier : ``int64 [B, R]`` each row's tier (``-1``: no corpus, length 0);
        ``length`` : ``int32 [B, R]`` its match length.
    win : ``int32 [B, R, P, K]`` the windows after each row's continuation positions;
        ``src`` : ``int8 [B, R, P, K]`` their sources (``MatchResult.windows``,
        ``window_sources``).
    tier_bonus : ``int32 [T]``, ``>= 0`` (unchecked: on the device), tokens added to a
        tier's match length when rows compete;
        ``tier_hits``, ``tier_drafts`` : ``float64 [T]`` a tier's weight is their ratio.
    num_slots : rows kept per request (``>= 1``); ``min_match`` (``>= 1``): shortest match
        that supplies candidates; ``slack`` (``>= 0``): how far below the best score a row
        may be.
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors.

    Returns
    -------
    ``(W int32 [B, C, K], S int32 [B, C, K], Wt float32 [B, C], best int32 [B],
    longest int32 [B])`` with ``C = num_slots * P``: slot ``j`` (candidates ``j * P`` to
    ``(j + 1) * P - 1``) holds the ``j``-th used row by score (ties: the earlier row), its
    windows cut before their first negative id and ``PAD_ID`` padded, its sources (-1 for
    an empty slot), and per window the tier weight (0 if the window is empty). ``best``:
    the longest match of a used row (0: none); ``longest``: of any row.
    """
    if win.dim() != 4 or min(win.shape[1:]) < 1:
        raise ValueError(f"win: expected int32 [B, R, P, K] with R, P, K >= 1, got shape "
                         f"{tuple(win.shape)}")
    B, R, P, K = win.shape
    T = tier_bonus.shape[0] if tier_bonus.dim() == 1 else -1
    check_tensors(("tier", tier, torch.int64, (B, R)), ("length", length, torch.int32, (B, R)),
                  ("win", win, torch.int32, (B, R, P, K)),
                  ("src", src, torch.int8, (B, R, P, K)),
                  ("tier_bonus", tier_bonus, torch.int32, (T,)),
                  ("tier_hits", tier_hits, torch.float64, (T,)),
                  ("tier_drafts", tier_drafts, torch.float64, (T,)))
    for name, v, lo in (("num_slots", num_slots, 1), ("min_match", min_match, 1),
                        ("slack", slack, 0)):
        if not is_py_int(v) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    check_devices(("win", win), ("tier", tier), ("length", length), ("src", src),
                  ("tier_bonus", tier_bonus), ("tier_hits", tier_hits),
                  ("tier_drafts", tier_drafts))
    if use_triton is None:
        use_triton = win.device.type == "cuda"
    if not use_triton:
        return candidate_rows_torch(tier, length, win, src, tier_bonus, tier_hits, tier_drafts,
                                    num_slots=num_slots, min_match=min_match, slack=slack)
    dev = win.device
    C = num_slots * P
    W = torch.empty(B, C, K, dtype=torch.int32, device=dev)
    S = torch.empty(B, C, K, dtype=torch.int32, device=dev)
    Wt = torch.empty(B, C, dtype=torch.float32, device=dev)
    best = torch.empty(B, dtype=torch.int32, device=dev)
    longest = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _candidate_rows_kernel[(B,)](
            tier.contiguous(), length.contiguous(), win.contiguous(), src.contiguous(),
            tier_bonus.contiguous(), tier_hits.contiguous(), tier_drafts.contiguous(),
            W, S, Wt, best, longest, R, P, K, min_match, slack, NSLOT=num_slots,
            BLOCK_R=next_pow2(R), BLOCK_P=next_pow2(P),
            BLOCK_K=next_pow2(K))
    return W, S, Wt, best, longest
