"""The drafter's per-step commit bookkeeping in one launch: ring push, tier and calibration counts.

After verification the drafter updates, for every request of the step: its recent-token ring
(the accepted tokens and the bonus appended, the oldest dropped), the ring's fill and the
cap on the next match length; the tokens drafted and accepted per tier (the tier weights);
and, per calibration cell (a node's calibration row and depth), the nodes whose parent was
accepted (reached) and those accepted too. As batched torch ops that is about sixty small
kernels; the kernel does it in one program per request, the draft's nodes and accepted path
in registers. Counts are added to zeroed ``float64`` accumulators (whole numbers: exact in
any order), which the caller folds into its decayed tables.

Layout (``B`` requests, ``N`` draft nodes, ``M`` output columns, ring width ``D``):

* ``out int32 [B, M]``: accepted tokens then the bonus, ``nout int32 [B]`` of them valid
  (at most ``M``); ``nacc int32 [B]`` draft tokens accepted;
* the draft: ``src int8 [B, N]`` source tag (``tier * 8 + form``, -1: none), ``parents
  int32 [B, N]`` (-1: a child of the root), ``num int32 [B]`` valid nodes, ``depth int64
  [B, N]`` (0-based), ``calib_row int64 [B, N]``; ``path int64 [B, N]`` the accepted nodes in
  path order (entries from ``nacc`` on are ignored); a tag of a tier ``>= T`` counts nowhere;
* state, updated in place at ``slots int64 [B]`` (in ``[0, S)``: both paths leave a row
  whose slot is outside alone, and save its ``before`` as zeros): ``recent int32 [S, D]``,
  ``recent_len`` and ``match_cap int32 [S]``;
* accumulators: ``drafted``, ``hits float64 [T]`` per tier, ``seen``, ``accepted float64
  [R * K]`` per calibration cell (``row * K + min(depth, K - 1)``);
* optionally ``before int32 [B, D + 2]``, written: row ``b``'s ring, fill and match cap as
  they were before this commit (a deferred commit gives them back to a request that kept
  fewer tokens than it queued; a padding row's copy of the spare slot is raced).

Returns ``acc_src int64 [B, M]``: the source tag of each accepted token (-1 for the bonus and
padding). Rows sharing a slot (padding rows of a graphed step) race on it: only padding may.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_ndims, check_tensors, is_py_int
from agspec_gpu.kernels._launch import next_pow2, slot_or_spare

# the path lookups are [BLOCK_N, BLOCK_N] compares in registers: spill-free up to 128 draft
# nodes on sm_90, and over 1024 they exceed Triton's 2**20 elements a block; wider: torch
MAX_BLOCK_N = 128


# the output and draft widths follow the batch: not specialized
# slots: a view of the drafter's staging ring without a graph (any alignment)
@triton.jit(do_not_specialize=["M", "N", "S"], do_not_specialize_on_alignment=["slot_ptr"])
def _drafter_commit_kernel(
    slot_ptr,  # *int64 [B]  state slot of each request
    out_ptr,  # *int32 [B, M]  accepted tokens then the bonus
    nout_ptr,  # *int32 [B]  valid columns of out
    nacc_ptr,  # *int32 [B]  draft tokens accepted
    src_ptr,  # *int8 [B, N]  node source tags, -1: none
    par_ptr,  # *int32 [B, N]  node parents, -1: a child of the root
    num_ptr,  # *int32 [B]  valid nodes
    depth_ptr,  # *int64 [B, N]  node depth, 0-based
    row_ptr,  # *int64 [B, N]  node calibration row
    path_ptr,  # *int64 [B, N]  accepted nodes in path order
    recent_ptr,  # *int32 [S, D]  recent-token ring (in place)
    rlen_ptr,  # *int32 [S]  ring fill (in place)
    cap_ptr,  # *int32 [S]  next match-length cap (in place)
    acc_src_ptr,  # *int64 [B, M]  out: accepted tokens' source tags (pre-filled -1)
    drafted_ptr,  # *float64 [T]  accumulated: drafted nodes per tier
    hits_ptr,  # *float64 [T]  accumulated: accepted nodes per tier
    seen_ptr,  # *float64 [R * K]  accumulated: calibration cells reached
    cacc_ptr,  # *float64 [R * K]  accumulated: calibration cells reached and accepted
    before_ptr,  # *int32 [B, D + 2]  out (SAVE_BEFORE): ring, fill, cap before the commit
    M,
    N,
    S,
    D,
    K,
    NUM_TIERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SAVE_BEFORE: tl.constexpr,
):
    """Grid ``(B,)``: one request's commit."""
    b = tl.program_id(0).to(tl.int64)
    nacc = tl.load(nacc_ptr + b)
    nout = tl.minimum(tl.maximum(tl.load(nout_ptr + b), 0), M)  # as the torch path clamps
    num = tl.load(num_ptr + b)
    i = tl.arange(0, BLOCK_N)
    in_n = i < N
    # tiers of the drafted nodes
    src = tl.load(src_ptr + b * N + i, mask=in_n, other=-1).to(tl.int32)
    tl.atomic_add(drafted_ptr + src // 8, 1.0, mask=in_n & (src >= 0) & (src // 8 < NUM_TIERS))
    # the accepted path (first nacc entries) and its nodes' sources
    p = tl.load(path_ptr + b * N + i, mask=in_n & (i < nacc), other=-1)
    on = p >= 0
    ps = tl.load(src_ptr + b * N + p, mask=on, other=-1).to(tl.int64)
    w = tl.minimum(M, N)
    tl.store(acc_src_ptr + b * M + i, ps, mask=i < w)
    tl.atomic_add(hits_ptr + ps // 8, 1.0, mask=(i < w) & (ps >= 0) & (ps // 8 < NUM_TIERS))
    # calibration: a node is reached when its parent is the root or on the path
    on_path = tl.max(((p[None, :] == i[:, None]) & on[None, :]).to(tl.int32), axis=1) > 0
    par = tl.load(par_ptr + b * N + i, mask=in_n, other=-1).to(tl.int64)
    par_on = tl.max(((p[None, :] == par[:, None]) & on[None, :]).to(tl.int32), axis=1) > 0
    reached = in_n & (i < num) & ((par < 0) | par_on)
    depth = tl.load(depth_ptr + b * N + i, mask=in_n, other=0)
    cell = tl.load(row_ptr + b * N + i, mask=in_n, other=0) * K + tl.minimum(depth, K - 1)
    tl.atomic_add(seen_ptr + cell, 1.0, mask=reached)
    tl.atomic_add(cacc_ptr + cell, 1.0, mask=reached & on_path)
    # the ring: drop the nout oldest, append out[:nout] (tokens clamped to >= 0)
    slot = tl.load(slot_ptr + b)
    ok = (slot >= 0) & (slot < S)  # a slot outside the state: its ring is not touched
    d = tl.arange(0, BLOCK_D)
    at = d + nout
    old = tl.load(recent_ptr + slot * D + at, mask=ok & (d < D) & (at < D), other=0)
    new = tl.load(out_ptr + b * M + at - D, mask=(d < D) & (at >= D), other=0)
    ring = tl.where(at < D, old, tl.maximum(new, 0))
    if SAVE_BEFORE:
        row = before_ptr + b * (D + 2)
        tl.store(row + d, tl.load(recent_ptr + slot * D + d, mask=ok & (d < D), other=0),
                 mask=d < D)
        tl.store(row + D, tl.load(rlen_ptr + slot, mask=ok, other=0))
        tl.store(row + D + 1, tl.load(cap_ptr + slot, mask=ok, other=0))
    tl.debug_barrier()  # every element read before any is written
    tl.store(recent_ptr + slot * D + d, ring, mask=ok & (d < D))
    tl.store(rlen_ptr + slot, tl.minimum(tl.load(rlen_ptr + slot, mask=ok, other=0) + nout, D),
             mask=ok)
    tl.store(cap_ptr + slot, tl.minimum(tl.load(cap_ptr + slot, mask=ok, other=0) + nout, D),
             mask=ok)


def drafter_commit(slots: torch.Tensor, out: torch.Tensor, nout: torch.Tensor,
                   nacc: torch.Tensor, src: torch.Tensor, parents: torch.Tensor,
                   num: torch.Tensor, depth: torch.Tensor, calib_row: torch.Tensor,
                   path: torch.Tensor, recent: torch.Tensor, recent_len: torch.Tensor,
                   match_cap: torch.Tensor, drafted: torch.Tensor, hits: torch.Tensor,
                   seen: torch.Tensor, accepted: torch.Tensor, *, calib_depth: int,
                   before: torch.Tensor | None = None,
                   use_triton: bool | None = None) -> torch.Tensor:
    """Launcher (see the module docstring for every argument): validates, then runs the
    Triton kernel on CUDA (or when ``use_triton``) up to ``MAX_BLOCK_N`` draft nodes, the
    torch path otherwise. Returns
    ``acc_src int64 [B, M]``; updates the state and adds to the accumulators."""
    check_ndims(("out", out, 2), ("src", src, 2), ("recent", recent, 2))
    B, M = out.shape
    N = src.shape[1]
    S, D = recent.shape
    check_tensors(
        ("slots", slots, torch.int64, (B,)), ("out", out, torch.int32, (B, M)),
        ("nout", nout, torch.int32, (B,)), ("nacc", nacc, torch.int32, (B,)),
        ("src", src, torch.int8, (B, N)), ("parents", parents, torch.int32, (B, N)),
        ("num", num, torch.int32, (B,)), ("depth", depth, torch.int64, (B, N)),
        ("calib_row", calib_row, torch.int64, (B, N)), ("path", path, torch.int64, (B, N)),
        ("recent", recent, torch.int32, (S, D)), ("recent_len", recent_len, torch.int32, (S,)),
        ("match_cap", match_cap, torch.int32, (S,)),
        ("drafted", drafted, torch.float64, drafted.shape[:1]),
        ("hits", hits, torch.float64, drafted.shape[:1]),
        ("seen", seen, torch.float64, seen.shape[:1]),
        ("accepted", accepted, torch.float64, seen.shape[:1]), contiguous=True)
    check_devices(("out", out), ("slots", slots), ("nout", nout), ("nacc", nacc), ("src", src),
                  ("parents", parents), ("num", num), ("depth", depth),
                  ("calib_row", calib_row), ("path", path), ("recent", recent),
                  ("recent_len", recent_len), ("match_cap", match_cap),
                  ("drafted", drafted), ("hits", hits), ("seen", seen),
                  ("accepted", accepted))
    if before is not None:
        check_tensors(("before", before, torch.int32, (B, D + 2)), contiguous=True)
        check_devices(("out", out), ("before", before))
    if not is_py_int(calib_depth) or \
            calib_depth < 1 or seen.shape[0] % calib_depth:
        raise ValueError(f"calib_depth: expected an int >= 1 dividing seen's "
                         f"{seen.shape[0]} cells, got {calib_depth!r}")
    if use_triton is None:
        use_triton = out.is_cuda
    if not use_triton or N > MAX_BLOCK_N:
        return drafter_commit_torch(slots, out, nout, nacc, src, parents, num, depth,
                                    calib_row, path, recent, recent_len, match_cap, drafted,
                                    hits, seen, accepted, calib_depth=calib_depth,
                                    before=before)
    acc_src = torch.full((B, M), -1, dtype=torch.int64, device=out.device)
    if B:
        _drafter_commit_kernel[(B,)](
            slots, out, nout, nacc, src, parents, num, depth, calib_row, path, recent,
            recent_len, match_cap, acc_src, drafted, hits, seen, accepted,
            recent_len if before is None else before, M, N, S, D,
            calib_depth, NUM_TIERS=drafted.shape[0],
            BLOCK_N=next_pow2(max(N, 1)),
            BLOCK_D=next_pow2(max(D, 1)), SAVE_BEFORE=before is not None)
    return acc_src


# ------------------------------------------------------------------------ torch path
def ring_push_torch(recent: torch.Tensor, recent_len: torch.Tensor, match_cap: torch.Tensor,
                    slots: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor, *,
                    guard: bool = True) -> None:
    """Appends ``tokens [b, M]`` (the first ``num [b]`` of each row) to the rings of
    ``slots``: the oldest drop out; fill and match cap grow by ``num``, at most ``D``. A
    row whose slot is outside ``[0, S)`` is skipped, as the kernel skips it; ``guard=False``
    (a caller whose slots are its own: ``SlotState``) indexes directly, without the copies
    the guard takes."""
    S, D = recent.shape
    num = num.to(torch.int64)
    ring, fill, cap, at = recent, recent_len, match_cap, slots
    if guard:  # a skipped row pushes to a spare ring past the state's, then dropped
        at = slot_or_spare(slots, S)
        ring, fill, cap = (torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
                           for t in (recent, recent_len, match_cap))
    cat = torch.cat([ring[at], tokens.to(torch.int32)], 1)
    ring[at] = cat.gather(1, torch.arange(D, device=cat.device)[None, :] + num[:, None])
    fill[at] = (fill[at] + num.to(torch.int32)).clamp(max=D)
    cap[at] = (cap[at] + num.to(torch.int32)).clamp(max=D)
    if guard:
        recent.copy_(ring[:S])
        recent_len.copy_(fill[:S])
        match_cap.copy_(cap[:S])


def drafter_commit_torch(slots, out, nout, nacc, src, parents, num, depth, calib_row, path,
                         recent, recent_len, match_cap, drafted, hits, seen, accepted, *,
                         calib_depth: int, before: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Pure-torch implementation of :func:`drafter_commit` (same results as the kernel)."""
    B, M = out.shape
    N = src.shape[1]
    T = drafted.shape[0]
    dev = out.device
    srcs = src.to(torch.int64)
    # a tag of no tier (-1) or of a tier past T counts nowhere
    drafted += _counts(_tier_or(srcs, T).view(-1), T + 1)[:T]
    cols = torch.arange(N, device=dev)[None, :]
    p = torch.where(cols < nacc.to(torch.int64)[:, None], path, -1)
    on_path = torch.zeros(B, N + 1, dtype=torch.bool, device=dev)
    on_path.scatter_(1, torch.where(p >= 0, p, N), True)
    on_path = on_path[:, :N]
    ps = torch.where(p >= 0, srcs.gather(1, p.clamp(min=0)), -1)
    acc_src = torch.full((B, M), -1, dtype=torch.int64, device=dev)
    w = min(M, N)
    acc_src[:, :w] = ps[:, :w]
    hits += _counts(_tier_or(acc_src, T).view(-1), T + 1)[:T]
    par = parents.to(torch.int64)
    parent_ok = torch.where(par >= 0, on_path.gather(1, par.clamp(min=0)), True)
    reached = (cols < num.to(torch.int64)[:, None]) & parent_ok
    cell = (calib_row * calib_depth + depth.clamp(max=calib_depth - 1)).view(-1)
    seen.scatter_add_(0, cell, reached.view(-1).to(seen.dtype))
    accepted.scatter_add_(0, cell, (reached & on_path).view(-1).to(accepted.dtype))
    if before is not None:  # a slot outside the state reads as zeros, as in the kernel
        S = recent.shape[0]
        rows = torch.cat([recent, recent_len[:, None], match_cap[:, None]], 1)
        before.copy_(torch.cat([rows, rows.new_zeros(1, rows.shape[1])])[
            slot_or_spare(slots, S)])
    ring_push_torch(recent, recent_len, match_cap, slots, out.clamp(min=0),
                    nout.clamp(0, M))
    return acc_src


def _tier_or(tags: torch.Tensor, T: int) -> torch.Tensor:
    """Each source tag's tier (``tag // 8``), or ``T`` for no tag (-1) or a tier >= T."""
    tier = tags // 8
    return torch.where((tags >= 0) & (tier < T), tier, T)


def _counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``float64 [n]`` occurrences of each value of ``idx`` (in ``[0, n)``), by a fixed-size
    scatter (``bincount`` on a GPU reads ``max(idx)`` back to size its output)."""
    return torch.zeros(n, dtype=torch.float64, device=idx.device).scatter_add_(
        0, idx, torch.ones_like(idx, dtype=torch.float64))
