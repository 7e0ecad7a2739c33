"""Triton implementation of :func:`agspec_gpu.kernels.suffix_match.suffix_match`.

One launch serves the whole batch: one program per query row, grid ``(B,)``. The contract and
the memory layout are in :mod:`agspec_gpu.kernels.suffix_match`: a level is a suffix array of
the reversed text, its entries continuation positions ``c`` sorted by ``key(c) = (tokens[c -
1], tokens[c - 2], ...)`` (``END`` before position 0). The results are identical to
``suffix_match_torch``: every search below is a lower or upper bound of a monotone predicate
over a sorted level, so the index it returns does not depend on the midpoints visited.

Per program (row ``b``, ``qlen = min(lengths[b], max_depth)``, ``qvec`` = the query read
backwards, ``qvec[i] = queries[b, L - 1 - i]`` for ``i < qlen``, ``-1`` after):

1. Longest length over the levels (skipped when ``qlen == 0``). Per level: a lower-bound
   search of the whole reversed query (first entry whose ``key[:qlen]`` is not below
   ``qvec[:qlen]``), then the common prefix lengths of its two neighbours (entries ``idx -
   1`` and ``idx``, when inside the level, in one compare) with ``qvec``: the longest prefix
   shared with the query is at one of them. A compare of ``key(c)`` with the pattern over
   ``l`` tokens loads ``BLOCK_D`` tokens backwards from ``c - 1`` (``END`` below position 0)
   and takes the first mismatch index ``j < l``: ``key < pattern`` iff there is one and the
   key's token is below the pattern's there. Searches are ``FAN``-ary: a round compares
   ``FAN`` pivots at once (a ``[FAN, BLOCK_D]`` tile), so a level of ``n`` entries takes
   ``ceil(log_{FAN + 1}(n + 1))`` rounds, not ``log2``: a round is two dependent memory
   reads (the pivots' entries, then their keys), whose latency, not the width of the read,
   sets a program's time (5 rounds instead of 22 on a 4M-entry level).
2. Tail, one pass. For continuation positions ``c`` in ``[tail_start, n)`` with ``c >= 1``
   and ``tokens[c]``, ``tokens[c - 1]`` tokens (``>= 0``), ``m(c)`` = common prefix length of
   ``key(c)`` and ``qvec``, capped at ``qlen``; the key reads back freely into the indexed
   positions. Blocks of ``BLOCK_T`` candidates x ``BLOCK_D`` depths: one vector compare, then
   the first mismatch index (a ``tl.min`` over masked aranges) is ``m(c)``. ``best`` is the
   running maximum over the levels and the blocks read; the hits ``m(c) >= best`` are
   counted and their positions kept (step 4) as the blocks go, and a block that raises
   ``best`` drops the hits held first (no earlier position matched that much).
3. Ranges at the final ``best``: per level the lower bound (first entry with ``key[:best]``
   not below ``qvec[:best]``) and the upper bound (first entry with ``key[:best]`` above
   it, searched from the lower bound) -> ``sa_lo/sa_hi``, ``count`` (+ the tail's hits). At
   ``best = 0`` a level's range is empty at its base (``sa_lo = sa_hi = level base``); slots
   past the row's levels are written ``(0, 0)``, as in the torch path (no fill before the
   launch).
4. Positions: the ``P`` largest continuation positions among the tail hits and the level
   ranges (the ``sa`` entries themselves, the first ``max_scan`` of each range: a round
   loads ``SCAN_BLOCKS`` blocks of ``BLOCK_C`` at once and merges them one by one), kept in
   a descending ``BLOCK_P`` register vector. Sources are read newest
   first (tail, then levels newest to oldest): a newer source's positions are all larger,
   so a level met with ``P`` positions already held is not read (steps 3 and 4 run
   together, level by level). A block merges by ranks (every valid position is distinct):
   an entry's new rank is the number of larger values in both; blocks with nothing above
   the current ``P``-th value are skipped.

5. Windows (``WINDOWS``): the ``W`` tokens and source codes from each of the ``P``
   positions on, one ``[BLOCK_P, BLOCK_W]`` tile: the draft candidates, read in the same
   launch (on a GPU a separate kernel cost the step a launch and its outputs' allocations).

Queries (``QUERY_ROWS``): row ``b`` reads row ``query_rows[b]`` of the query table (a
drafter's ring, one row per request for each of its corpora), length ``min(lengths,
max_lengths)`` there, none where the row is negative: no per-row copy of the queries.

Block sizes: ``BLOCK_D = next_pow2(max(max_depth, 1))`` (the pattern; no continuation token
in the window), ``BLOCK_T = clamp(4096 // BLOCK_D, 1, 32)`` (bounds the ``[BLOCK_T, BLOCK_D]``
tile), ``BLOCK_P = next_pow2(max(P, 1))``, ``BLOCK_C = 32``, ``SCAN_BLOCKS = 4``, ``FAN =
clamp(2048 // BLOCK_D, 1, 32)`` (search pivots per round); launched with up to 255
registers (``LAUNCH_OPTIONS``).

Loops with runtime bounds are ``while`` loops with conditions (no ``break``/``continue``/early
``return``, which the sm_90 compiler rejects; and the interpreter cannot use a loaded scalar
as a ``range`` bound).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._launch import next_pow2
from agspec_gpu.kernels.suffix_match import (END, MatchDescriptors, MatchResult,
                                             check_match_args, triton_tiles_fit)

_END = tl.constexpr(END)  # int32 value of positions before the start of a corpus
_BLOCK_C = 32  # level-range entries merged into the top-P per step
_SCAN_BLOCKS = 4  # BLOCK_C blocks of a level's range loaded per round
_MAX_FAN = 32  # search pivots per round
# A program is one row's chain of dependent reads (few programs, latency-bound): registers
# matter more than occupancy. Left to itself ptxas may cap the kernel below what it needs
# and spill (sm_90, depth 16 without positions: 48 registers and 4 bytes of spills)
LAUNCH_OPTIONS = dict(maxnreg=255)


@triton.jit
def _compare(tokens_ptr, tb, c, qvec, l, jd, BLOCK_D: tl.constexpr):
    """``key(c)`` (tokens ``c - 1, c - 2, ...``, ``END`` below 0) vs the pattern ``qvec[:l]``
    for a vector of positions ``c`` (``int64 [F]``), all loaded at once.

    Returns (lcp, lt), ``[F]`` each: the common prefix length, capped at ``l``, and whether
    the key is below the pattern at the first mismatch (False when ``lcp == l``).
    """
    off = c[:, None] - 1 - jd[None, :]  # int64 [F, BLOCK_D]
    inside = off >= 0
    use = jd[None, :] < l
    vals = tl.load(tokens_ptr + tb + off, mask=inside & use, other=0)
    vals = tl.where(inside, vals, _END)
    diff = (vals != qvec[None, :]) & use
    first = tl.min(tl.where(diff, jd[None, :], BLOCK_D), axis=1)  # [F]
    at = jd[None, :] == first[:, None]
    v_first = tl.sum(tl.where(at, vals, 0), axis=1)
    p_first = tl.sum(tl.where(at, qvec[None, :], 0), axis=1)
    return tl.minimum(first, l), (first < l) & (v_first < p_first)


@triton.jit
def _bound(tokens_ptr, sa_ptr, tb, sa_base, lo, hi, qvec, l, jd, UPPER: tl.constexpr,
           BLOCK_D: tl.constexpr, FAN: tl.constexpr):
    """First index in ``[lo, hi)`` of the level whose key fails ``key[:l] < qvec[:l]``
    (lower bound) or ``key[:l] <= qvec[:l]`` (``UPPER``); ``hi`` if none does.

    A ``FAN``-ary search: each round compares ``FAN`` pivots ``lo + m * (i + 1) // (FAN +
    1)`` (``m = hi - lo``) at once and keeps the gap between the last pivot that passes and
    the first that fails, so a level of ``n`` entries takes ``ceil(log_{FAN + 1}(n + 1))``
    rounds of two dependent reads (the pivots' entries, then their keys) instead of
    ``log2`` rounds: on a GPU a round costs a memory latency, whatever its width. The
    predicate is monotone along the level, so the pivots that pass are a prefix of them
    (``FAN = 1`` is the binary search)."""
    f = tl.arange(0, FAN).to(tl.int64)
    while lo < hi:
        piv = lo + (hi - lo) * (f + 1) // (FAN + 1)  # [FAN] in [lo, hi), non-decreasing
        c = tl.load(sa_ptr + sa_base + piv).to(tl.int64)
        lcp, lt = _compare(tokens_ptr, tb, c, qvec, l, jd, BLOCK_D)
        if UPPER:
            pred = lt | (lcp >= l)
        else:
            pred = lt
        lo = tl.maximum(lo, tl.max(tl.where(pred, piv + 1, lo), axis=0))
        hi = tl.minimum(hi, tl.min(tl.where(pred, hi, piv), axis=0))
    return lo


@triton.jit
def _tail_block(tokens_ptr, tb, n, tail, qlen, qvec, t0, jd, BLOCK_T: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Continuation positions ``c`` (``int64 [BLOCK_T]``) of one tail block and ``m(c)``
    (0 where ``c`` is not a candidate). The keys' tile is read for every position inside
    the corpus, candidate or not: its load does not wait for the candidates' tokens, so a
    block costs one memory latency, not two."""
    c = tail + t0 + tl.arange(0, BLOCK_T).to(tl.int64)
    valid = (c < n) & (c >= 1)
    cur = tl.load(tokens_ptr + tb + c, mask=valid, other=-1)
    prv = tl.load(tokens_ptr + tb + c - 1, mask=valid, other=-1)
    cand = valid & (cur >= 0) & (prv >= 0) & (qlen > 0)
    off = c[:, None] - 1 - jd[None, :]  # [BLOCK_T, BLOCK_D]
    okp = (jd[None, :] < qlen) & valid[:, None] & (off >= 0)
    tv = tl.load(tokens_ptr + tb + off, mask=okp, other=0)
    eq = okp & (tv == qvec[None, :])  # END (off < 0) never equals a query token
    m = tl.min(tl.where(eq, BLOCK_D, jd[None, :]), axis=1)  # first mismatch = match length
    return c, tl.where(cand, tl.minimum(m, qlen), 0).to(tl.int64)


@triton.jit
def _merge_top(top, cand, P: tl.constexpr, BLOCK_P: tl.constexpr):
    """Top ``P`` of ``top`` (``int64 [BLOCK_P]`` descending, -1 padded) and ``cand`` (-1 = none).

    Valid values are distinct and ``>= 0``, so ranks (number of larger values) are unique.
    """
    r = tl.arange(0, BLOCK_P)
    rank_t = tl.sum((top[None, :] > top[:, None]).to(tl.int32), axis=1) \
        + tl.sum((cand[None, :] > top[:, None]).to(tl.int32), axis=1)
    rank_c = tl.sum((top[:, None] > cand[None, :]).to(tl.int32), axis=0) \
        + tl.sum((cand[:, None] > cand[None, :]).to(tl.int32), axis=0)
    sel_t = (rank_t[None, :] == r[:, None]) & (top[None, :] >= 0)  # [BLOCK_P rank, BLOCK_P]
    sel_c = (rank_c[None, :] == r[:, None]) & (cand[None, :] >= 0)  # [BLOCK_P rank, BLOCK_C]
    new = tl.maximum(tl.max(tl.where(sel_t, top[None, :], -1), axis=1),
                     tl.max(tl.where(sel_c, cand[None, :], -1), axis=1))
    return tl.where(r < P, new, -1)


# the rows' level count and the scan bound follow the corpora: not specialized; the
# per-row arrays are views of a staging ring (a drafter's descriptors and query rows start
# anywhere in it) or of each other, read a scalar at a time: their alignment is not
# specialized either. One compile per block config
@triton.jit(do_not_specialize=["max_levels", "max_scan"],
            do_not_specialize_on_alignment=[
                "tok_base_ptr", "num_tokens_ptr", "tail_start_ptr", "level_indptr_ptr",
                "level_base_ptr", "level_len_ptr", "lengths_ptr", "max_lengths_ptr",
                "query_rows_ptr", "length_ptr", "count_ptr", "sa_lo_ptr", "sa_hi_ptr"])
def _suffix_match_kernel(
    tokens_ptr,      # *int32 [T]     arena tokens
    src_ptr,         # *int8 [T]      WINDOWS: the tokens' source codes
    sa_ptr,          # *int32 [S]     arena levels: continuation positions sorted by key
    tok_base_ptr,    # *int64 [B]     corpus start in tokens
    num_tokens_ptr,  # *int32 [B]     corpus length n
    tail_start_ptr,  # *int32 [B]     first unindexed position
    level_indptr_ptr,  # *int32 [B + 1] row b's levels
    level_base_ptr,  # *int64 [K]     level start in sa
    level_len_ptr,   # *int32 [K]     level length
    queries_ptr,     # *int32 [Q, L]  right-aligned queries (Q = B without QUERY_ROWS)
    lengths_ptr,     # *int32 [Q]
    max_lengths_ptr,  # *int32 [Q]    caps of lengths (lengths itself when none)
    query_rows_ptr,  # *int64 [B]     QUERY_ROWS: row b's query row, < 0: none
    length_ptr,      # *int32 [B]     out: best length
    count_ptr,       # *int64 [B]     out: occurrences
    positions_ptr,   # *int64 [B, P]  out: continuation positions, descending, -1 padded
    sa_lo_ptr,       # *int64 [B, max_levels] out
    sa_hi_ptr,       # *int64 [B, max_levels] out
    win_ptr,         # *int32 [B, P, W]  out (WINDOWS): tokens from each position, PAD_ID after
    win_src_ptr,     # *int8 [B, P, W]   out (WINDOWS): their sources, -1 after
    L,               # query width
    max_levels,      # row stride of sa_lo / sa_hi
    max_depth,
    max_scan,        # entries of a level's range read for positions
    P: tl.constexpr,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FAN: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
    QUERY_ROWS: tl.constexpr,
    WINDOWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tb = tl.load(tok_base_ptr + b)
    n = tl.load(num_tokens_ptr + b).to(tl.int64)
    tail = tl.load(tail_start_ptr + b).to(tl.int64)
    k0 = tl.load(level_indptr_ptr + b).to(tl.int64)
    k1 = tl.load(level_indptr_ptr + b + 1).to(tl.int64)
    if QUERY_ROWS:
        qr = tl.load(query_rows_ptr + b)
        qi = tl.maximum(qr, 0)
        has_query = qr >= 0
    else:
        qi = b
        has_query = b >= 0
    qmax = tl.minimum(tl.load(lengths_ptr + qi, mask=has_query, other=0),
                      tl.load(max_lengths_ptr + qi, mask=has_query, other=0))
    qlen = tl.minimum(qmax.to(tl.int64), max_depth)
    q_row_ptr = queries_ptr + qi * L
    jd = tl.arange(0, BLOCK_D)
    # query read backwards: qvec[i] = query[L - 1 - i]
    qvec = tl.load(q_row_ptr + tl.maximum(L - 1 - jd, 0), mask=(jd < qlen) & (L > 0), other=-1)

    # (1) per level: insertion point of the whole reversed query, then its two neighbours
    # runtime-bounded loops are while-loops: the interpreter cannot index a loaded scalar
    best = qlen * 0
    k = k0
    k_end = tl.where(qlen > 0, k1, k0)
    while k < k_end:
        sa_base = tl.load(level_base_ptr + k)
        sa_len = tl.load(level_len_ptr + k).to(tl.int64)
        idx = _bound(tokens_ptr, sa_ptr, tb, sa_base, sa_len * 0, sa_len, qvec, qlen, jd, False,
                     BLOCK_D, FAN)
        # entries idx - 1 and idx, when inside the level: compared in one round
        nb = idx - 1 + tl.arange(0, 2).to(tl.int64)
        inl = (nb >= 0) & (nb < sa_len)
        c = tl.load(sa_ptr + sa_base + nb, mask=inl, other=0).to(tl.int64)
        lcp, _ = _compare(tokens_ptr, tb, c, qvec, qlen, jd, BLOCK_D)
        best = tl.maximum(best, tl.max(tl.where(inl, lcp, 0), axis=0))
        k += 1

    # (2) the tail in one pass: the longest match there and its hits, with best the running
    # maximum over the levels and the blocks read so far. A block that raises it drops the
    # hits held (they matched less than the new best: no earlier position reached it).
    # Then (3) ranges at best, (4) the P largest continuation positions: the tail first,
    # then the levels newest first: every position of a newer source is larger than every
    # position of an older one, so a level met with P positions already held only adds to
    # count (its range is not read)
    count = best * 0
    top = tl.full([BLOCK_P], -1, tl.int64)
    t0 = qlen * 0
    while t0 < n - tail:
        c, m = _tail_block(tokens_ptr, tb, n, tail, qlen, qvec, t0, jd, BLOCK_T, BLOCK_D)
        block_best = tl.max(m, axis=0)
        if block_best > best:
            best = block_best
            count = count * 0
            top = tl.full([BLOCK_P], -1, tl.int64)
        hit = m >= tl.maximum(best, 1)  # m is 0 off the candidates
        count += tl.sum(hit.to(tl.int64), axis=0)
        if P > 0:
            cand = tl.where(hit, c, -1)
            thr = tl.min(tl.where(tl.arange(0, BLOCK_P) < P, top, 1 << 62), axis=0)
            if tl.max(cand, axis=0) > thr:
                top = _merge_top(top, cand, P, BLOCK_P)
        t0 += BLOCK_T
    k = k1 - 1
    while k >= k0:
        sa_base = tl.load(level_base_ptr + k)
        sa_len = tl.load(level_len_ptr + k).to(tl.int64)
        n_search = tl.where(best > 0, sa_len, 0)  # best 0: empty range at the level base
        lo = _bound(tokens_ptr, sa_ptr, tb, sa_base, n_search * 0, n_search, qvec, best, jd,
                    False, BLOCK_D, FAN)
        hi = _bound(tokens_ptr, sa_ptr, tb, sa_base, lo, n_search, qvec, best, jd, True,
                    BLOCK_D, FAN)
        tl.store(sa_lo_ptr + b * max_levels + (k - k0), sa_base + lo)
        tl.store(sa_hi_ptr + b * max_levels + (k - k0), sa_base + hi)
        count += hi - lo
        if P > 0:
            # the P-th largest held position; -1 while fewer than P are held
            thr = tl.min(tl.where(tl.arange(0, BLOCK_P) < P, top, 1 << 62), axis=0)
            hi_scan = tl.minimum(hi, lo + max_scan)
            i0 = tl.where(thr < 0, lo, hi_scan)
            # SCAN_BLOCKS blocks of BLOCK_C entries per round: one load of the tile, then
            # the blocks merged one by one (the loads of a round wait on one latency)
            u = tl.arange(0, SCAN_BLOCKS)[:, None]
            while i0 < hi_scan:
                ii = i0 + u * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
                inr = ii < hi_scan
                tile = tl.load(sa_ptr + sa_base + ii, mask=inr, other=0).to(tl.int64)
                tile = tl.where(inr, tile, -1)
                for v in tl.static_range(SCAN_BLOCKS):
                    cand = tl.max(tl.where(u == v, tile, -1), axis=0)  # block v, [BLOCK_C]
                    thr = tl.min(tl.where(tl.arange(0, BLOCK_P) < P, top, 1 << 62), axis=0)
                    if tl.max(cand, axis=0) > thr:
                        top = _merge_top(top, cand, P, BLOCK_P)
                i0 += SCAN_BLOCKS * BLOCK_C
        k -= 1
    k = k1 - k0  # the row's slots past its levels: (0, 0)
    while k < max_levels:
        tl.store(sa_lo_ptr + b * max_levels + k, k * 0)
        tl.store(sa_hi_ptr + b * max_levels + k, k * 0)
        k += 1

    tl.store(length_ptr + b, best.to(tl.int32))
    tl.store(count_ptr + b, count)
    if P > 0:
        r = tl.arange(0, BLOCK_P)
        tl.store(positions_ptr + b * P + r, top, mask=r < P)
        if WINDOWS:  # (5) the W tokens from each position on: the draft candidates
            w = tl.arange(0, BLOCK_W)
            at = top[:, None] + w[None, :]  # [BLOCK_P, BLOCK_W]
            live = (r[:, None] < P) & (w[None, :] < W)
            inside = live & (top[:, None] >= 0) & (at < n)
            o = b * P * W + r[:, None] * W + w[None, :]
            tl.store(win_ptr + o, tl.load(tokens_ptr + tb + at, mask=inside, other=-1),
                     mask=live)
            tl.store(win_src_ptr + o, tl.load(src_ptr + tb + at, mask=inside, other=-1),
                     mask=live)


@functools.cache
def block_sizes(max_depth: int, max_positions: int, fan: int | None = None) -> dict[str, int]:
    """The deterministic block-size rule (see the module docstring); ``fan``: the search's
    pivots per round instead of the rule's (a power of two; 1 is the binary search).
    Cached: a launch's host time matters (callers copy before changing it)."""
    block_d = next_pow2(max(max_depth, 1))
    if fan is None:
        fan = max(1, min(_MAX_FAN, 2048 // block_d))
    elif fan < 1 or fan & (fan - 1):
        raise ValueError(f"fan must be a power of two >= 1, got {fan}")
    return dict(BLOCK_D=block_d, BLOCK_T=max(1, min(32, 4096 // block_d)),
                BLOCK_P=next_pow2(max(max_positions, 1)), BLOCK_C=_BLOCK_C,
                FAN=fan, SCAN_BLOCKS=_SCAN_BLOCKS)


def suffix_match_triton(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                        queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                        max_positions: int, max_scan: int | None = None,
                        fan: int | None = None, query_rows: torch.Tensor | None = None,
                        max_lengths: torch.Tensor | None = None, window: int = 0,
                        src: torch.Tensor | None = None, out: MatchResult | None = None
                        ) -> MatchResult:
    """Batched longest-suffix match, one Triton program per row (see the module docstring).

    Args:
        tokens: ``int32 [T]``. sa: ``int32 [S]``. desc: per-row descriptors (``B`` rows).
        queries: ``int32 [Q, L]`` right-aligned. lengths: ``int32 [Q]`` in ``[0, L]``.
        max_depth: longest match searched. max_positions: ``P``.
        max_scan: entries of each level's range read for positions (None: all).
        fan: search pivots per round (:func:`block_sizes`; None: the rule's; benchmarks
            compare it with 1, the binary search). Results do not depend on it.
        query_rows, max_lengths, window, src, out: as in
            :func:`~agspec_gpu.kernels.suffix_match.suffix_match` (``Q = B`` without
            ``query_rows``).

    Returns:
        :class:`MatchResult` with ``length int32 [B]``, ``count int64 [B]``,
        ``positions int64 [B, P]``, ``sa_lo / sa_hi int64 [B, desc.max_levels]`` (and
        ``windows int32 / window_sources int8 [B, P, window]`` with a window).
    """
    check_match_args(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                     max_positions=max_positions, max_scan=max_scan, query_rows=query_rows,
                     max_lengths=max_lengths, window=window, src=src, out=out)
    if not triton_tiles_fit(max_positions, window):
        raise ValueError(f"max_positions, window: {max_positions} positions of {window} "
                         f"tokens exceed the kernel's tiles (2**12 elements: at most 64 "
                         f"positions); suffix_match runs the torch path for them")
    return launch_suffix_match(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                               max_positions=max_positions, max_scan=max_scan, fan=fan,
                               query_rows=query_rows, max_lengths=max_lengths, window=window,
                               src=src, out=out)


def launch_suffix_match(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                        queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                        max_positions: int, max_scan: int | None = None,
                        fan: int | None = None, query_rows: torch.Tensor | None = None,
                        max_lengths: torch.Tensor | None = None, window: int = 0,
                        src: torch.Tensor | None = None, out: MatchResult | None = None
                        ) -> MatchResult:
    """:func:`suffix_match_triton` without the checks: for a caller that ran
    :func:`~agspec_gpu.kernels.suffix_match.check_match_args` (the launcher)."""
    B, L = desc.tok_base.shape[0], queries.shape[1]
    dev = tokens.device
    P = max_positions
    blocks = block_sizes(max_depth, P, fan)
    # every program writes its length, count, all P positions and every level slot (0 past
    # its levels), and every window entry: no fills before the launch
    if out is None:
        out = _empty_result(B, P, desc.max_levels, window, dev)
    length, count, positions, sa_lo, sa_hi, win, win_src = (
        out.length, out.count, out.positions, out.sa_lo, out.sa_hi, out.windows,
        out.window_sources)
    K = sa_lo.shape[1]  # >= desc.max_levels: the row stride of sa_lo / sa_hi
    if B == 0:
        return out
    windows = bool(window and P)
    # zero-size tensors (no levels, P = 0, L = 0, no tokens) and the pointers of a mode that
    # is off are never read or written by the kernel, but need a valid pointer of their
    # dtype all the same: a tensor of the launch stands in (no allocation)
    i32, i64, i8 = torch.int32, torch.int64, torch.int8
    stand_in = {i64: desc.tok_base, i32: length,
                i8: win_src if windows else tokens.view(i8) if tokens.numel() else None}

    def nz(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if t is not None and t.numel():
            return t
        if stand_in[dtype] is None:
            stand_in[dtype] = torch.zeros(1, dtype=dtype, device=dev)
        return stand_in[dtype]

    _suffix_match_kernel[(B,)](
        nz(tokens, i32), nz(src if windows else None, i8), nz(sa, i32), desc.tok_base,
        desc.num_tokens, desc.tail_start, desc.level_indptr, nz(desc.level_sa_base, i64),
        nz(desc.level_sa_len, i32), nz(queries, i32), nz(lengths, i32),
        nz(lengths if max_lengths is None else max_lengths, i32), nz(query_rows, i64),
        length, count, nz(positions, i64), nz(sa_lo, i64), nz(sa_hi, i64),
        nz(win if windows else None, i32), nz(win_src if windows else None, i8), L, K,
        max_depth, sa.numel() if max_scan is None else max_scan, P=P, W=window,
        BLOCK_W=next_pow2(max(window, 1)), QUERY_ROWS=query_rows is not None,
        WINDOWS=windows, **blocks, **LAUNCH_OPTIONS)
    return out


def _empty_result(B: int, P: int, K: int, W: int, dev: torch.device) -> MatchResult:
    """Uninitialized outputs of a match of ``B`` rows (windows iff ``W``)."""
    def new(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=dev)
    return MatchResult(new(B, dtype=torch.int32), new(B), new(B, P), new(B, K), new(B, K),
                       new(B, P, W, dtype=torch.int32) if W else None,
                       new(B, P, W, dtype=torch.int8) if W else None)
