"""Batched longest-suffix match against log-structured suffix-array indexes.

For every query row ``b`` (a request's recent tokens, right-aligned in ``queries[b]``) and
its corpus (a token segment of the arena plus a few suffix-array *levels* and an unindexed
*tail*), find

* ``length[b]``: the longest ``l <= min(lengths[b], max_depth)`` such that the last ``l``
  query tokens occur in the corpus followed by a non-separator token (0 if none; then
  ``count`` is 0 and no positions are returned);
* ``count[b]``: the exact number of such occurrences (levels + tail);
* ``positions[b]``: the continuation positions (index of the token after the match, corpus
  relative) of ``min(P, count)`` occurrences, the most recent first (largest position
  first), ``-1`` padded;
* ``sa_lo[b, k], sa_hi[b, k]``: the range of level ``k`` (oldest first) of suffixes that
  start with the match and continue with a token, as absolute indices into ``sa``. Their
  continuation tokens come out sorted: the range is the implicit trie of continuations.

Memory layout (all on one device):

* ``tokens``  ``int32 [T]``: corpus ``b`` is ``tokens[tok_base[b] : tok_base[b] + n[b]]``.
* ``sa``      ``int32 [S]``: level ``k`` of a row is ``sa[level_sa_base[k] : + level_sa_len[k]]``
  holding corpus-relative start positions sorted by their first ``max_depth + 1`` tokens
  (``END`` below separators below tokens).
* Row ``b``'s levels are ``level_indptr[b] .. level_indptr[b + 1]``; its tail holds the
  suffix starts ``>= tail_start[b]``, scanned directly.

The Triton kernel runs one program per row; the torch implementation vectorizes the same
binary searches over (row, level) pairs. Both return identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

END = -(2**31)  # value of positions past the end of a corpus; below every separator


@dataclass
class MatchDescriptors:
    """Per-row corpus descriptors (see the module docstring for the layout).

    Attributes:
        tok_base: ``int64 [B]``; num_tokens: ``int32 [B]``; tail_start: ``int32 [B]``;
        level_indptr: ``int32 [B + 1]``; level_sa_base: ``int64 [K]``;
        level_sa_len: ``int32 [K]``; max_levels, max_tail: host ints bounding the loops.
    """

    tok_base: torch.Tensor
    num_tokens: torch.Tensor
    tail_start: torch.Tensor
    level_indptr: torch.Tensor
    level_sa_base: torch.Tensor
    level_sa_len: torch.Tensor
    max_levels: int
    max_tail: int


@dataclass
class MatchResult:
    """Result of a batched match (``B`` rows, ``P`` positions, ``K`` = most levels of a row).

    Attributes:
        length: ``int32 [B]`` longest match length (0 if none).
        count: ``int64 [B]`` occurrences of that suffix followed by a token.
        positions: ``int64 [B, P]`` continuation positions, most recent first, -1 padded.
        sa_lo, sa_hi: ``int64 [B, K]`` per-level suffix-array ranges (absolute, empty = equal).
    """

    length: torch.Tensor
    count: torch.Tensor
    positions: torch.Tensor
    sa_lo: torch.Tensor
    sa_hi: torch.Tensor


def suffix_match(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                 queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                 max_positions: int, use_triton: bool | None = None) -> MatchResult:
    """Launcher: validates and runs the Triton kernel on CUDA, the torch path otherwise.

    Args:
        tokens: ``int32 [T]`` arena tokens. sa: ``int32 [S]`` arena suffix arrays.
        desc: per-row descriptors. queries: ``int32 [B, L]`` right-aligned.
        lengths: ``int32 [B]``. max_depth: longest match searched.
        max_positions: ``P``. use_triton: force a path (None: Triton iff on CUDA).
    """
    for name, t, dt in (("tokens", tokens, torch.int32), ("sa", sa, torch.int32),
                        ("queries", queries, torch.int32), ("lengths", lengths, torch.int32)):
        if t.dtype != dt:
            raise ValueError(f"{name} must be {dt}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if queries.dim() != 2 or lengths.shape != (queries.shape[0],):
        raise ValueError(f"queries must be [B, L] and lengths [B], got {tuple(queries.shape)} "
                         f"and {tuple(lengths.shape)}")
    if desc.tok_base.shape[0] != queries.shape[0]:
        raise ValueError("desc has a different number of rows than queries")
    if use_triton is None:
        use_triton = tokens.is_cuda
    if use_triton:
        from agspec_gpu.kernels.suffix_match_triton import suffix_match_triton

        return suffix_match_triton(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                                   max_positions=max_positions)
    return suffix_match_torch(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                              max_positions=max_positions)


# ------------------------------------------------------------------------ torch path
def _window(tokens: torch.Tensor, base: torch.Tensor, n: torch.Tensor, start: torch.Tensor,
            width: int) -> torch.Tensor:
    """``int64 [R, width]``: corpus tokens from ``start`` on, ``END`` past the end."""
    off = start[:, None] + torch.arange(width, device=start.device)[None, :]
    inside = off < n[:, None]
    idx = torch.where(inside, base[:, None] + off, 0)
    # torch.take, not tokens[idx]: advanced indexing is several times slower on CPU
    return torch.where(inside, torch.take(tokens, idx).to(torch.int64), END)


def _compare_window(vals: torch.Tensor, pat: torch.Tensor, l: torch.Tensor):
    """(first mismatch index < l, or W if none; lt_lo; le_hi) for windows ``vals [R, W]``."""
    W = vals.shape[1]
    j = torch.arange(W, device=vals.device)[None, :]
    diff = (vals != pat[:, :W]) & (j < l[:, None])
    first = torch.where(diff, j, W).min(dim=1).values
    has = first < l
    fj = first.clamp(max=W - 1)[:, None]
    less = vals.gather(1, fj)[:, 0] < pat.gather(1, fj)[:, 0]
    after = vals.gather(1, l.clamp(max=W - 1)[:, None])[:, 0]
    lt_lo = torch.where(has, less, after < 0)
    le_hi = torch.where(has, less, torch.ones_like(has))
    return first, lt_lo, le_hi


_PROBE = 8  # tokens compared first; most suffixes differ from the pattern within them


def _compare(tokens, base, n, start, pat, l):
    """Compares suffixes with patterns.

    Args: start ``[R]`` corpus-relative suffix starts; pat ``int64 [R, W]`` pattern padded
    past ``l``; l ``[R]`` pattern lengths (``W > max l``).
    Returns (lt_lo, le_hi) ``bool [R]``: suffix < (pattern, 0) and suffix[:l] <= pattern.
    Two phases for speed on CPU: a short window for every row, the full window only for
    rows still equal after it.
    """
    W = pat.shape[1]
    w0 = min(_PROBE, W)
    if w0 == W:
        return _compare_window(_window(tokens, base, n, start, W), pat, l)[1:]
    # the probe checks tokens [0, w0 - 1) of the pattern plus the token after it: exact for
    # rows with l < w0 and for rows that mismatch inside the probe
    first, lt_lo, le_hi = _compare_window(_window(tokens, base, n, start, w0), pat,
                                          l.clamp(max=w0 - 1))
    todo = torch.nonzero((l >= w0) & (first >= w0 - 1), as_tuple=True)[0]
    if todo.numel():
        _, lt2, le2 = _compare_window(_window(tokens, base[todo], n[todo], start[todo], W),
                                      pat[todo], l[todo])
        lt_lo = lt_lo.scatter(0, todo, lt2)
        le_hi = le_hi.scatter(0, todo, le2)
    return lt_lo, le_hi


_FANOUT = 15  # pivots per search round: fewer, wider torch ops (CPU cost is per op)


def _bound(tokens, sa, base, n, sa_base, sa_len, pat, l, upper):
    """Vectorized search: first index in ``[0, sa_len)`` failing the predicate.

    A ``_FANOUT + 1``-ary search (``_FANOUT`` pivots per round, only unsettled rows) so a
    level of ``m`` entries takes ``log_16(m)`` rounds of a few ops each instead of
    ``log_2(m)``; the result is the same as a binary search's. ``upper``: a bool, or a bool
    tensor ``[R]`` choosing per row (lower and upper bounds in one pass).
    """
    dev = sa_len.device
    lo = torch.zeros_like(sa_len)
    hi = sa_len.clone()
    k = torch.arange(1, _FANOUT + 1, device=dev)[None, :]
    live = torch.nonzero(lo < hi, as_tuple=True)[0]
    while live.numel():
        llo, lhi = lo[live], hi[live]
        piv = llo[:, None] + ((lhi - llo)[:, None] * k) // (_FANOUT + 1)  # [r, F] in [lo, hi)
        s = torch.take(sa, (sa_base[live][:, None] + piv).clamp(max=sa.numel() - 1))
        rows = live[:, None].expand(-1, _FANOUT).reshape(-1)
        lt_lo, le_hi = _compare(tokens, base[rows], n[rows], s.reshape(-1).to(torch.int64),
                                pat[rows], l[rows])
        if isinstance(upper, torch.Tensor):
            pred = torch.where(upper[rows], le_hi, lt_lo).view(-1, _FANOUT)
        else:
            pred = (le_hi if upper else lt_lo).view(-1, _FANOUT)
        ntrue = pred.sum(dim=1)  # predicates are monotone along the sorted pivots
        last_true = piv.gather(1, (ntrue - 1).clamp(min=0)[:, None])[:, 0]
        first_false = piv.gather(1, ntrue.clamp(max=_FANOUT - 1)[:, None])[:, 0]
        lo[live] = torch.where(ntrue > 0, last_true + 1, llo)
        hi[live] = torch.where(ntrue < _FANOUT, first_false, lhi)
        live = live[lo[live] < hi[live]]
    return lo


def _patterns(queries: torch.Tensor, rows: torch.Tensor, l: torch.Tensor, W: int) -> torch.Tensor:
    """``int64 [R, W]``: the last ``l[r]`` tokens of ``queries[rows[r]]``, left-aligned."""
    L = queries.shape[1]
    j = torch.arange(W, device=queries.device)[None, :]
    src = (L - l)[:, None] + j
    ok = (j < l[:, None]) & (src < L)
    vals = torch.take(queries, rows[:, None] * L + src.clamp(0, max(L - 1, 0))) if L else \
        torch.zeros(rows.shape[0], W, dtype=queries.dtype, device=queries.device)
    return torch.where(ok, vals.to(torch.int64), -1)


def suffix_match_torch(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                       queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                       max_positions: int) -> MatchResult:
    """Pure-torch implementation of :func:`suffix_match` (same results as the kernel)."""
    dev = queries.device
    B, L = queries.shape
    P, K, W = max_positions, desc.max_levels, max_depth + 1
    qlen = torch.minimum(lengths.to(torch.int64), torch.tensor(max_depth, device=dev))
    n_row = desc.num_tokens.to(torch.int64)
    base_row = desc.tok_base
    tail_row = desc.tail_start.to(torch.int64)

    # (row, level) pairs, levels oldest first
    lv_ptr = desc.level_indptr.to(torch.int64)
    per_row = lv_ptr[1:] - lv_ptr[:-1]
    prow = torch.repeat_interleave(torch.arange(B, device=dev), per_row)
    pslot = torch.arange(prow.numel(), device=dev) - lv_ptr[:-1][prow]
    p_base, p_len = desc.level_sa_base, desc.level_sa_len.to(torch.int64)
    pb, pn = base_row[prow], n_row[prow]

    best = torch.zeros(B, dtype=torch.int64, device=dev)
    # tail: continuation c in (tail_start, n) with m(c) = backward match length
    T = desc.max_tail
    tail_m = torch.zeros(B, max(T, 0), dtype=torch.int64, device=dev)
    c_all = tail_row[:, None] + 1 + torch.arange(max(T, 0), device=dev)[None, :]
    if T > 0 and L > 0:
        inside = c_all < n_row[:, None]
        cidx = torch.where(inside, base_row[:, None] + c_all, 0)
        cont_ok = inside & (torch.take(tokens, cidx) >= 0)
        prev = torch.take(tokens, torch.where(inside, cidx - 1, 0)).to(torch.int64)
        cand = cont_ok & (prev == queries[:, L - 1:L].to(torch.int64)) & (qlen[:, None] > 0)
        kr, kt = torch.nonzero(cand, as_tuple=True)
        if kr.numel():
            c = c_all[kr, kt]
            cap = torch.minimum(qlen[kr], c - tail_row[kr])
            i = torch.arange(max_depth, device=dev)[None, :]
            pos = c[:, None] - 1 - i
            okp = (i < cap[:, None]) & (pos >= 0)
            tv = torch.take(tokens, torch.where(okp, base_row[kr][:, None] + pos, 0)).to(torch.int64)
            qv = torch.take(queries, kr[:, None] * L + (L - 1 - i).clamp(min=0)).to(torch.int64)
            run = torch.cumprod((okp & (tv == qv)).to(torch.int64), dim=1).sum(dim=1)
            tail_m[kr, kt] = run
        best = tail_m.max(dim=1).values

    # longest l: binary search over l on existence, per row. Existence is monotone in l
    # for the whole corpus (an occurrence of l tokens at s gives one of l - 1 at s + 1), not
    # for a single level, so levels and tail are searched together; the tail is exact first.
    lo_l = best.clone()
    hi_l = torch.maximum(qlen, best)
    # the first probe is the upper end: a drafter that caps ``lengths`` by its previous match
    # plus the appended tokens (a valid bound) then settles copy-mode steps in one probe
    # (a while loop, like the kernel's: no break anywhere under kernels/)
    # only the pairs of rows still searching take part in a probe (copy-mode rows settle
    # in the first)
    it = 0
    while prow.numel() and bool((lo_l < hi_l).any()):
        mid = hi_l if it == 0 else (lo_l + hi_l + 1) // 2
        it += 1
        act = torch.nonzero(lo_l[prow] < hi_l[prow], as_tuple=True)[0]
        arow, ab, an, abase, alen = prow[act], pb[act], pn[act], p_base[act], p_len[act]
        lm = mid[arow]
        pat = _patterns(queries, arow, lm, W)
        idx = _bound(tokens, sa, ab, an, abase, alen, pat, lm, False)
        inside = idx < alen
        s = torch.take(sa, (abase + idx.clamp(max=torch.clamp(alen - 1, min=0))).clamp(
            max=sa.numel() - 1))
        lt_lo, le_hi = _compare(tokens, ab, an, s.to(torch.int64), pat, lm)
        ok_pair = (inside & ~lt_lo & le_hi & (lm > 0)).to(torch.int64)
        ok = torch.zeros(B, dtype=torch.int64, device=dev).scatter_reduce_(
            0, arow, ok_pair, reduce="amax").bool()
        active = lo_l < hi_l
        lo_l = torch.where(active & ok, mid, lo_l)
        hi_l = torch.where(active & ~ok, mid - 1, hi_l)
    best = lo_l

    # ranges at the best length
    sa_lo = torch.zeros(B, K, dtype=torch.int64, device=dev)
    sa_hi = torch.zeros(B, K, dtype=torch.int64, device=dev)
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    if prow.numel():
        lb = best[prow]
        pat = _patterns(queries, prow, lb, W)
        R = prow.numel()
        two = lambda x: torch.cat([x, x])  # noqa: E731 - lower and upper bounds in one search
        both = _bound(tokens, sa, two(pb), two(pn), two(p_base), two(p_len), two(pat), two(lb),
                      torch.arange(2 * R, device=dev) >= R)
        lo, hi = both[:R], both[R:]
        hi = torch.where(lb > 0, hi, lo)
        sa_lo[prow, pslot] = p_base + lo
        sa_hi[prow, pslot] = p_base + hi
        count.scatter_add_(0, prow, hi - lo)
    tail_hit = (tail_m >= best[:, None]) & (best[:, None] > 0) if T > 0 else tail_m.bool()
    count += tail_hit.sum(dim=1)

    # positions: the P largest continuation positions among tail hits and level ranges
    positions = torch.full((B, P), -1, dtype=torch.int64, device=dev)
    if P > 0:
        cand_row = [torch.nonzero(tail_hit, as_tuple=True)[0]] if T > 0 else []
        cand_pos = [c_all[tail_hit]] if T > 0 else []
        if prow.numel():
            size = (sa_hi[prow, pslot] - sa_lo[prow, pslot])
            r = torch.repeat_interleave(prow, size)
            start = torch.repeat_interleave(sa_lo[prow, pslot], size)
            first = torch.cumsum(size, 0) - size
            off = torch.arange(r.numel(), device=dev) - torch.repeat_interleave(first, size)
            cand_row.append(r)
            cand_pos.append(torch.take(sa, start + off).to(torch.int64) + best[r])
        if cand_row:
            rr = torch.cat(cand_row)
            cp = torch.cat(cand_pos)
            order = torch.argsort(rr * (1 << 40) - cp, stable=True)
            rr, cp = rr[order], cp[order]
            grp_first = torch.searchsorted(rr, torch.arange(B, device=dev))
            rank = torch.arange(rr.numel(), device=dev) - grp_first[rr]
            keep = rank < P
            positions[rr[keep], rank[keep]] = cp[keep]
    length = best.to(torch.int32)
    return MatchResult(length, count, positions, sa_lo, sa_hi)
