"""Batched longest-suffix match against log-structured indexes of the reversed text.

For every query row ``b`` (a request's recent tokens, right-aligned in ``queries[b]``) and
its corpus (a token segment of the arena plus a few sorted *levels* and an unindexed *tail*),
find

* ``length[b]``: the longest ``l <= min(lengths[b], max_depth)`` such that the last ``l``
  query tokens occur in the corpus followed by a non-separator token (0 if none; then
  ``count`` is 0 and no positions are returned; 0 too for a query whose last token is a
  negative value: no indexed context ends with a separator);
* ``count[b]``: the exact number of such occurrences (levels + tail);
* ``positions[b]``: the continuation positions (index of the token after the match, corpus
  relative) of ``min(P, count)`` occurrences, the most recent first (largest position
  first), ``-1`` padded -- the ``P`` largest among the tail's hits and, per level, the first
  ``max_scan`` entries of its range (all of them when ``max_scan`` is None): a short match
  in a large level has a range of ~10^5 entries, and reading it all would set the latency
  of the whole batch's step;
* ``sa_lo[b, k], sa_hi[b, k]``: the range of level ``k`` (oldest first) holding those
  occurrences, as absolute indices into ``sa`` (``sa_lo == sa_hi ==`` the level's base when
  ``length`` is 0; ``(0, 0)`` for slots past the row's levels).
* optionally (``window = W > 0``) ``windows[b, i]``: the ``W`` tokens from
  ``positions[b, i]`` on (the draft candidates that follow the match), ``PAD_ID`` past the
  corpus end or for a missing position, and their source codes in ``window_sources`` (-1
  there), read in the same launch.

The queries are ``queries[b]`` with length ``lengths[b]``; or, with ``query_rows``, row ``b``
reads query row ``query_rows[b]`` of a shared table (a drafter's ring of recent tokens: one
row per request, read by each of its corpora's rows) with length ``min(lengths,
max_lengths)`` of that row, and no query (length 0) where ``query_rows[b] < 0``.

The index is a suffix array of the *reversed* text, keyed by continuation position: a level
holds the positions ``c`` of a position range whose token ``tokens[c]`` and predecessor
``tokens[c - 1]`` are tokens (not separators), sorted by the context read backwards,
``key(c) = (tokens[c - 1], tokens[c - 2], ..., tokens[c - max_depth])`` (``END`` before the
corpus start, separators as their negative values). The occurrences of the last ``l`` query
tokens are the entries whose key starts with the reversed query: one contiguous range per
level. And the longest match takes a single search: at the insertion point of the whole
reversed query, the entry sharing the longest prefix with it is one of the two neighbours.
So per level: one lower-bound search at ``qlen``, two common-prefix lengths, and the bounds
of the range at the best length. A key is final when its position is appended, so every
position is indexable at once (no look-ahead), and the tail is simply the positions past the
newest level.

Memory layout (all on one device):

* ``tokens``  ``int32 [T]``: corpus ``b`` is ``tokens[tok_base[b] : tok_base[b] + n[b]]``.
* ``sa``      ``int32 [S]``: level ``k`` of a row is ``sa[level_sa_base[k] : + level_sa_len[k]]``,
  corpus-relative continuation positions sorted by ``key`` (``END`` below separators below
  tokens; equal keys in descending position).
* Row ``b``'s levels are ``level_indptr[b] .. level_indptr[b + 1]``; its tail holds the
  positions ``>= tail_start[b]``, scanned directly.

The Triton kernel runs one program per row; the torch implementation vectorizes the same
searches over (row, level) pairs. Both return identical results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from agspec_gpu.kernels._checks import is_py_int
from agspec_gpu.kernels._launch import next_pow2

END = -(2**31)  # value of positions past the end of a corpus; below every separator
PAD_ID = -1  # window entries past a corpus's end, or of a missing position


@dataclass
class MatchDescriptors:
    """Per-row corpus descriptors (see the module docstring for the layout).

    Attributes:
        tok_base: ``int64 [B]``; num_tokens: ``int32 [B]``; tail_start: ``int32 [B]``;
        level_indptr: ``int32 [B + 1]``; level_sa_base: ``int64 [K]``;
        level_sa_len: ``int32 [K]``; max_levels, max_tail: host ints bounding the loops;
        level_key: ``int64 [K]`` or None, each level's ``seq << KEY_SEQ_SHIFT`` in the
        arena's ``sa_key`` (see :func:`prefix_keys`; the torch path's search hints).
    """

    tok_base: torch.Tensor
    num_tokens: torch.Tensor
    tail_start: torch.Tensor
    level_indptr: torch.Tensor
    level_sa_base: torch.Tensor
    level_sa_len: torch.Tensor
    max_levels: int
    max_tail: int
    level_key: torch.Tensor | None = None

    @staticmethod
    def packed(i64: torch.Tensor, i32: torch.Tensor, num_rows: int, max_levels: int,
               max_tail: int) -> "MatchDescriptors":
        """The descriptors as views of two buffers: ``i64 [B + 2 K]`` = ``tok_base |
        level_sa_base | level_key``, ``i32 [3 B + 1 + K]`` = ``num_tokens | tail_start |
        level_indptr | level_sa_len`` (one host-to-device copy each, or both in one)."""
        B = num_rows
        K = (i64.shape[0] - B) // 2
        return MatchDescriptors(
            tok_base=i64[:B], num_tokens=i32[:B], tail_start=i32[B:2 * B],
            level_indptr=i32[2 * B:3 * B + 1], level_sa_base=i64[B:B + K],
            level_sa_len=i32[3 * B + 1:], level_key=i64[B + K:], max_levels=max_levels,
            max_tail=max_tail)


KEY_TOKEN_BITS = 20  # bits of one packed key token (vocabularies up to ~1M ids exactly)
KEY_SEQ_SHIFT = 2 * KEY_TOKEN_BITS  # a level's sequence number sits above two tokens
_KEY_TOKEN_MAX = (1 << KEY_TOKEN_BITS) - 1


def _pack(t: torch.Tensor) -> torch.Tensor:
    """Order-preserving (coarse) code of key tokens: ``END`` and separators 0, token ``t``
    ``t + 1``, ids from ``2^20 - 2`` up share the top code."""
    return (t.to(torch.int64) + 1).clamp(0, _KEY_TOKEN_MAX)


def prefix_keys(tokens: torch.Tensor, base: int, c: torch.Tensor, seq: int) -> torch.Tensor:
    """``int64 [m]`` search keys of a level's entries ``c`` (continuation positions, corpus
    relative, at ``tokens[base:]``) when the level has sequence number ``seq``:
    ``seq << KEY_SEQ_SHIFT | pack(key[0]) << KEY_TOKEN_BITS | pack(key[1])`` (the second
    code 0 when the first is the shared top code).

    Non-decreasing along a level (its entries are sorted by key, and packing keeps order),
    and across levels laid out in increasing ``seq``: one ``searchsorted`` over the whole
    buffer then finds, for any level, the entries whose key starts with one or two given
    tokens. The torch path narrows its searches with it (the kernel does not need it)."""
    c = c.to(torch.int64)
    p0 = _pack(torch.take(tokens, base + c - 1))
    t1 = torch.where(c >= 2, torch.take(tokens, (base + c - 2).clamp(min=0)), END)
    # below a shared (coarse) first code the second token is not ordered: leave it out
    p1 = torch.where(p0 < _KEY_TOKEN_MAX, _pack(t1), 0)
    return (seq << KEY_SEQ_SHIFT) | (p0 << KEY_TOKEN_BITS) | p1


@dataclass
class MatchResult:
    """Result of a batched match (``B`` rows, ``P`` positions, ``K`` = most levels of a row).

    Attributes:
        length: ``int32 [B]`` longest match length (0 if none).
        count: ``int64 [B]`` occurrences of that suffix followed by a token.
        positions: ``int64 [B, P]`` continuation positions, most recent first, -1 padded.
        sa_lo, sa_hi: ``int64 [B, K]`` per-level suffix-array ranges (absolute, empty = equal).
        windows: ``int32 [B, P, W]`` or None: the ``W`` tokens from each position on,
            ``PAD_ID`` past the corpus end or where the position is -1 (``window=W``).
        window_sources: ``int8 [B, P, W]`` or None: their source codes, -1 where
            ``windows`` is ``PAD_ID``.
    """

    length: torch.Tensor
    count: torch.Tensor
    positions: torch.Tensor
    sa_lo: torch.Tensor
    sa_hi: torch.Tensor
    windows: torch.Tensor | None = None
    window_sources: torch.Tensor | None = None


def suffix_match(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                 queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                 max_positions: int, max_scan: int | None = None,
                 use_triton: bool | None = None, sa_key: torch.Tensor | None = None,
                 query_rows: torch.Tensor | None = None,
                 max_lengths: torch.Tensor | None = None, window: int = 0,
                 src: torch.Tensor | None = None, out: MatchResult | None = None,
                 checked: bool = False) -> MatchResult:
    """Launcher: validates (:func:`check_match_args`) and runs the Triton kernel on CUDA
    (while :func:`triton_tiles_fit`), the torch path otherwise.

    Args:
        tokens: ``int32 [T]`` arena tokens. sa: ``int32 [S]`` arena suffix arrays.
        desc: per-row descriptors (``B`` rows). queries: ``int32 [Q, L]`` right-aligned;
        a query holds no ``END`` (``-2**31``, the padding before a corpus's start).
        lengths: ``int32 [Q]``, each in ``[0, L]``. ``Q = B`` without ``query_rows``. (The
        values are the caller's contract, as ``query_rows``' and ``max_lengths``': reading
        them would wait for the device. :meth:`IndexArena.match` checks them.)
        max_depth: longest match searched. max_positions: ``P``. max_scan: entries of a
        level's range read for positions (None: all). use_triton: force a path (None:
        Triton iff on CUDA).
        sa_key: ``int64 [S]`` search keys of every ``sa`` entry (:func:`prefix_keys`, with
        ``desc.level_key``), or None: the torch path starts its searches inside the entries
        sharing the query's last one or two tokens (same results, fewer rounds).
        query_rows: ``int64 [B]`` or None: row ``b``'s query is ``queries[query_rows[b]]``
        (in ``[0, Q)``; none, length 0, where it is negative).
        max_lengths: ``int32 [Q]`` or None: caps ``lengths`` (a query's length is the
        minimum of the two).
        window: ``W >= 0``; with ``W > 0`` the result also holds the ``W`` tokens from each
        position on and their sources (``src``: ``int8 [T]``, the arena's source codes).
        out: where the result goes (a caller that matches every step keeps one, so that a
        step allocates nothing), returned: its tensors shaped and typed as the result's,
        contiguous, except that ``sa_lo``/``sa_hi`` may be wider than the rows' levels (the
        columns past a row's levels hold 0, as they do up to ``K``); ``windows`` and
        ``window_sources`` given iff ``window``. None: a new result.
        checked: the caller passed these very tensors and values in an earlier call, which
        checked them (a drafter's step reusing its buffers): the checks are skipped.
    """
    if not checked:
        check_match_args(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                         max_positions=max_positions, max_scan=max_scan, sa_key=sa_key,
                         query_rows=query_rows, max_lengths=max_lengths, window=window,
                         src=src, out=out)
    if use_triton is None:
        use_triton = tokens.is_cuda
    if use_triton and triton_tiles_fit(max_positions, window):
        from agspec_gpu.kernels.suffix_match_triton import launch_suffix_match

        return launch_suffix_match(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                                   max_positions=max_positions, max_scan=max_scan,
                                   query_rows=query_rows, max_lengths=max_lengths,
                                   window=window, src=src, out=out)
    if query_rows is not None or max_lengths is not None:
        queries, lengths = gather_queries(queries, lengths, query_rows, max_lengths)
    m = suffix_match_torch(tokens, sa, desc, queries, lengths, max_depth=max_depth,
                           max_positions=max_positions, max_scan=max_scan, sa_key=sa_key)
    if window:
        m.windows, m.window_sources = match_windows_torch(tokens, src, desc.tok_base,
                                                          desc.num_tokens, m.positions, window)
    return m if out is None else copy_result(m, out)


# the most elements of the kernel's largest tile, where it compiles for sm_90 without
# spilling: [64, 64] takes 212 registers (64 positions, 64-token windows) and [8, 512]
# 168; [128, 128] spilled 112 bytes, [256, 256] 6.6 KB, and [512, 512] had not compiled
# after 4 minutes (Triton's own bound, 2**20 elements, admitted 1024 positions)
MAX_TILE_NUMEL = 1 << 12


def triton_tiles_fit(max_positions: int, window: int) -> bool:
    """Whether the Triton kernel's ``[BLOCK_P, BLOCK_P]`` merge and ``[BLOCK_P, BLOCK_W]``
    window tiles fit :data:`MAX_TILE_NUMEL` (``BLOCK_P = next_pow2(P)``: ``P <= 64``;
    ``P <= 8`` with windows up to 512 tokens); wider: torch."""
    bp, bw = next_pow2(max(max_positions, 1)), next_pow2(max(window, 1))
    return bp * max(bp, bw) <= MAX_TILE_NUMEL


def copy_result(m: MatchResult, out: MatchResult) -> MatchResult:
    """``m`` written into ``out`` (checked by :func:`check_match_args`), its level columns
    past ``m``'s zeroed; returns ``out``."""
    K = m.sa_lo.shape[1]
    for name in ("length", "count", "positions", "windows", "window_sources"):
        if getattr(m, name) is not None:
            getattr(out, name).copy_(getattr(m, name))
    for name in ("sa_lo", "sa_hi"):
        getattr(out, name)[:, :K].copy_(getattr(m, name))
        getattr(out, name)[:, K:].zero_()
    return out


def check_match_args(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                     queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                     max_positions: int, max_scan: int | None = None,
                     sa_key: torch.Tensor | None = None, query_rows: torch.Tensor | None = None,
                     max_lengths: torch.Tensor | None = None, window: int = 0,
                     src: torch.Tensor | None = None, out: MatchResult | None = None) -> None:
    """Raises ValueError naming the first argument of :func:`suffix_match` with a wrong
    dtype, shape, layout (every tensor contiguous), device (``tokens``'s) or value. Reads
    nothing from the device: a few microseconds of the host's time, once per launch."""
    for name, v, least in (("max_depth", max_depth, 0), ("max_positions", max_positions, 0),
                           ("max_scan", 1 if max_scan is None else max_scan, 1)):
        if not is_py_int(v) or v < least:
            raise ValueError(f"{name} must be an int >= {least}"
                             f"{' or None' if name == 'max_scan' else ''}, got {v!r}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if queries.dim() != 2:
        raise ValueError(f"queries must be [Q, L], got {tuple(queries.shape)}")
    B, Q = desc.tok_base.shape[0], queries.shape[0]
    if query_rows is None and Q != B:
        raise ValueError(f"queries: [{Q}, L] for {B} descriptor rows (without query_rows, "
                         f"one query per row)")
    if window and src is None:
        raise ValueError(f"src: window={window} needs the arena's int8 source codes")
    K = desc.level_sa_base.shape[0]
    i32, i64 = torch.int32, torch.int64
    for name, t in (("tokens", tokens), ("sa", sa)):
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    specs = [("tokens", tokens, i32, None), ("sa", sa, i32, None), ("queries", queries, i32, None),
             ("lengths", lengths, i32, (Q,)), ("desc.tok_base", desc.tok_base, i64, (B,)),
             ("desc.num_tokens", desc.num_tokens, i32, (B,)),
             ("desc.tail_start", desc.tail_start, i32, (B,)),
             ("desc.level_indptr", desc.level_indptr, i32, (B + 1,)),
             ("desc.level_sa_base", desc.level_sa_base, i64, (K,)),
             ("desc.level_sa_len", desc.level_sa_len, i32, (K,))]
    if query_rows is not None:
        specs.append(("query_rows", query_rows, i64, (B,)))
    if max_lengths is not None:
        specs.append(("max_lengths", max_lengths, i32, (Q,)))
    if window:
        specs.append(("src", src, torch.int8, (tokens.numel(),)))
    if sa_key is not None:
        if desc.level_key is None:
            raise ValueError("sa_key needs desc.level_key")
        specs += [("sa_key", sa_key, i64, tuple(sa.shape)),
                  ("desc.level_key", desc.level_key, i64, (K,))]
    if out is not None:
        specs += _out_specs(out, B, max_positions, desc.max_levels, window)
    dev = tokens.device
    for name, t, dtype, shape in specs:
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if shape is not None and t.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, tokens on {dev}")


def _out_specs(out: MatchResult, B: int, P: int, K: int, W: int) -> list[tuple]:
    """``check_match_args``'s specs of ``out`` (``(name, tensor, dtype, shape)``)."""
    if (out.windows is None) != (W == 0) or (out.window_sources is None) != (W == 0):
        raise ValueError(f"out: windows and window_sources must be given iff window > 0 "
                         f"(window={W})")
    i64 = torch.int64
    width = out.sa_lo.shape[1] if out.sa_lo.dim() == 2 and out.sa_lo.shape[1] >= K else K
    specs = [("out.length", out.length, torch.int32, (B,)), ("out.count", out.count, i64, (B,)),
             ("out.positions", out.positions, i64, (B, P)),
             ("out.sa_lo", out.sa_lo, i64, (B, width)), ("out.sa_hi", out.sa_hi, i64, (B, width))]
    if W:
        specs += [("out.windows", out.windows, torch.int32, (B, P, W)),
                  ("out.window_sources", out.window_sources, torch.int8, (B, P, W))]
    return specs


# ------------------------------------------------------------------------ torch path
def gather_queries(queries: torch.Tensor, lengths: torch.Tensor,
                   query_rows: torch.Tensor | None, max_lengths: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row ``(queries int32 [B, L], lengths int32 [B])`` that ``query_rows`` and
    ``max_lengths`` describe (see :func:`suffix_match`): what the kernel reads in place."""
    if max_lengths is not None:
        lengths = torch.minimum(lengths, max_lengths)
    if query_rows is None:
        return queries, lengths
    at = query_rows.clamp(min=0)
    if queries.shape[0] == 0:  # every row without a query
        return (queries.new_zeros(query_rows.shape[0], queries.shape[1]),
                lengths.new_zeros(query_rows.shape[0]))
    return queries[at], torch.where(query_rows >= 0, lengths[at], 0).to(torch.int32)


def match_windows_torch(tokens: torch.Tensor, src: torch.Tensor, tok_base: torch.Tensor,
                        num_tokens: torch.Tensor, positions: torch.Tensor, W: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(windows int32 [B, P, W], window_sources int8 [B, P, W])`` of
    :class:`MatchResult`: ``tokens[tok_base[b] + positions[b, i] + j]`` while inside row
    ``b``'s corpus (``positions[b, i] + j < num_tokens[b]``), else ``PAD_ID``; sources alike,
    -1 outside."""
    if tokens.numel() == 0:  # (no corpus holds a token: every window is padding)
        shape = (*positions.shape, W)
        return (torch.full(shape, PAD_ID, dtype=torch.int32, device=positions.device),
                torch.full(shape, -1, dtype=torch.int8, device=positions.device))
    at = positions[:, :, None] + torch.arange(W, device=positions.device)[None, None, :]
    inside = (positions[:, :, None] >= 0) & (at < num_tokens.to(torch.int64)[:, None, None])
    flat = torch.where(inside, tok_base[:, None, None] + at, 0)
    win = torch.where(inside, torch.take(tokens, flat), PAD_ID).to(torch.int32)
    win_src = torch.where(inside, torch.take(src, flat), -1).to(torch.int8)
    return win, win_src


def _windows(buf: torch.Tensor, start: torch.Tensor, width: int, *, inside: bool = False
             ) -> torch.Tensor:
    """``[R, width]``: ``buf[start[r] : start[r] + width]`` per row. One ``index_select`` on
    an unfolded view: several times faster on CPU than a ``take`` of ``R * width`` computed
    indices. Windows leaving the buffer hold some element of it (callers mask them); with
    ``inside`` the caller vouches there are none it keeps (no check)."""
    n, lim = buf.numel(), buf.numel() - width
    if n == 0:
        return buf.new_zeros(start.shape[0], width)
    out = buf.unfold(0, width, 1).index_select(0, start.clamp(0, lim)) if lim >= 0 else \
        buf.new_empty(start.shape[0], width)
    if inside and lim >= 0:
        return out
    bad = torch.nonzero((start < 0) | (start > lim), as_tuple=True)[0]
    if bad.numel():  # windows leaving the buffer: element by element
        j = torch.arange(width, device=buf.device)
        out[bad] = torch.take(buf, (start[bad, None] + j).clamp(0, n - 1))
    return out


def _keys(tokens: torch.Tensor, base: torch.Tensor, c: torch.Tensor, width: int
          ) -> torch.Tensor:
    """``int32 [G, F, width]``: the first ``width`` tokens of ``key(c)`` in text order,
    ``tokens[c - width : c]`` (so ``key[j]`` is column ``width - 1 - j``), ``END`` before
    the corpus start. ``c [G, F]`` continuation positions of corpora at ``base int64 [G]``."""
    G, F = c.shape
    end = base[:, None] + c
    vals = _windows(tokens, (end - width).reshape(-1), width, inside=True).view(G, F, width)
    sg, sf = torch.nonzero(c < width, as_tuple=True)  # keys reaching the corpus start
    if sg.numel():
        i = torch.arange(width, device=c.device)[None, :]
        at = (end[sg, sf] - width)[:, None] + i
        vals[sg, sf] = torch.where(i >= width - c[sg, sf][:, None],
                                   torch.take(tokens, at.clamp(min=0)), END)
    return vals


def _mismatch(vals: torch.Tensor, pat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``vals [G, F, w]`` keys against ``pat [G, w]`` patterns, both in text order (key
    position ``j`` is column ``w - 1 - j``). Returns (``int64 [G, F]`` first key position
    that differs, else ``w``; whether the key is below the pattern there). Callers cap the
    position at the compared length: a later difference does not matter."""
    w = vals.shape[-1]
    col = torch.arange(w, dtype=torch.int16, device=vals.device)
    last = torch.where(vals != pat[:, None, :], col, -1).max(dim=-1).values  # [G, F]
    at = last.clamp(min=0).to(torch.int64)
    less = vals.gather(2, at[..., None])[..., 0] < pat.gather(1, at)
    return (w - 1) - last.to(torch.int64), less


_PROBE = 8  # key tokens compared first; most keys differ from the pattern within them


def _compare(tokens, base, c, pat, l, prow=None):
    """Compares ``key(c)`` with the patterns over ``l`` tokens, ``F`` candidates per group.

    ``c [G, F]``; per group ``base int64 [G]``, ``l int64 [G]`` and the pattern row ``prow
    [G]`` of ``pat int32 [P, W]`` (reversed queries in text order: the query's last ``W``
    tokens, -1 padded on the left; ``prow`` None: row ``g``), so candidates share their
    pattern without copies. Returns (lcp, less) ``[G, F]``: the common prefix length,
    capped at ``l``, and whether the key is below the pattern at the first mismatch
    (meaningless when ``lcp == l``). Two phases for speed on CPU: a short window for every
    candidate, the full one only for those still equal.
    """
    W = pat.shape[1]
    w0 = min(_PROBE, W)
    head = pat[:, W - w0:]
    first, less = _mismatch(_keys(tokens, base, c, w0),
                            head if prow is None else head.index_select(0, prow))
    tg, tf = torch.nonzero((l[:, None] > w0) & (first >= w0), as_tuple=True)
    if tg.numel():
        f2, less2 = _mismatch(_keys(tokens, base[tg], c[tg, tf][:, None], W),
                              pat[tg if prow is None else prow[tg]])
        first[tg, tf] = f2[:, 0]
        less[tg, tf] = less2[:, 0]
    return torch.minimum(first, l[:, None]), less


_FANOUT = 15  # pivots per search round: fewer, wider torch ops (CPU cost is per op)


def _bound(tokens, sa, base, sa_base, sa_len, pat, prow, l, upper, lo0=None, hi0=None):
    """Vectorized search over ``A`` (row, level) pairs: first index in ``[0, sa_len)``
    whose key fails ``key[:l] < pat[:l]`` (lower bound) or ``key[:l] <= pat[:l]`` (upper).

    ``base, sa_base, sa_len, prow, l``: ``int64 [A]`` (``prow``: the pair's row of ``pat``).
    A ``_FANOUT + 1``-ary search (``_FANOUT`` pivots per round, over the unsettled pairs
    only, their state kept compact) so a level of ``m`` entries takes ``log_16(m)`` rounds
    of a few ops each instead of ``log_2(m)``; the result is a binary search's. ``upper``: a
    bool, or a bool tensor ``[A]`` choosing per pair (lower and upper bounds in one pass).
    ``lo0, hi0``: ``int64 [A]`` an interval known to hold the answer (default the level).
    """
    dev = sa_len.device
    lo = torch.zeros_like(sa_len) if lo0 is None else lo0.clone()
    hi = sa_len if hi0 is None else hi0
    up = upper if isinstance(upper, torch.Tensor) else \
        torch.full(sa_len.shape, bool(upper), device=dev)
    k = torch.arange(1, _FANOUT + 1, device=dev)[None, :]
    live = torch.nonzero(lo < hi, as_tuple=True)[0]
    llo, lhi = lo[live], hi[live]  # the unsettled pairs' intervals, and their constants:
    per_pair = [sa_base[live], base[live], prow[live], l[live], up[live]]
    while live.numel():
        lsb, lbase, lprow, ll, lup = per_pair
        piv = llo[:, None] + ((lhi - llo)[:, None] * k) // (_FANOUT + 1)  # [r, F] in [lo, hi)
        c = torch.take(sa, (lsb[:, None] + piv).clamp(max=sa.numel() - 1))
        lcp, less = _compare(tokens, lbase, c, pat, ll, lprow)
        short = lcp < ll[:, None]
        pred = (short & less) | (~short & lup[:, None])  # monotone along the sorted pivots
        ntrue = pred.sum(dim=1)
        last_true = piv.gather(1, (ntrue - 1).clamp(min=0)[:, None])[:, 0]
        first_false = piv.gather(1, ntrue.clamp(max=_FANOUT - 1)[:, None])[:, 0]
        llo = torch.where(ntrue > 0, last_true + 1, llo)
        lhi = torch.where(ntrue < _FANOUT, first_false, lhi)
        done = torch.nonzero(llo >= lhi, as_tuple=True)[0]
        if done.numel():
            lo[live[done]] = llo[done]
            keep = torch.nonzero(llo < lhi, as_tuple=True)[0]
            live, llo, lhi = live[keep], llo[keep], lhi[keep]
            per_pair = [x[keep] for x in per_pair]
    return lo


def _forward_queries(queries: torch.Tensor, qlen: torch.Tensor, W: int) -> torch.Tensor:
    """``int32 [B, W]``: the last ``min(qlen, W)`` query tokens right-aligned, -1 before
    (the reversed query in text order: ``key`` position ``j`` is column ``W - 1 - j``)."""
    B, L = queries.shape
    if L == 0:
        return torch.full((B, W), -1, dtype=torch.int32, device=queries.device)
    j = torch.arange(W, device=queries.device)[None, :]
    vals = queries.gather(1, (L - W + j).clamp(min=0).expand(B, -1))
    return torch.where(j >= W - qlen[:, None], vals, -1)


class _Hints(NamedTuple):
    """Per searched pair, level relative, from the arena's ``sa_key``: every search starts
    in ``[lo, hi]``; ``[lo1, hi1)`` holds the entries whose key starts with the query's last
    token, exactly when ``exact1``; ``[lo, hi)`` those starting with its last two, exactly
    when ``exact2``."""
    lo: torch.Tensor
    hi: torch.Tensor
    lo1: torch.Tensor
    hi1: torch.Tensor
    exact1: torch.Tensor
    exact2: torch.Tensor


def _hints(sa_key, level_key, sa_base, sa_len, pat, arow, al) -> _Hints:
    """Two ``searchsorted`` over the whole key buffer for all pairs (see :func:`prefix_keys`)."""
    W = pat.shape[1]
    p0 = _pack(pat[arow, W - 1])
    p1 = _pack(pat[arow, W - 2]) if W >= 2 else torch.zeros_like(p0)
    k1 = level_key + (p0 << KEY_TOKEN_BITS)
    k2 = k1 + p1
    lo_abs = torch.searchsorted(sa_key, torch.cat([k1, k2]))
    hi_abs = torch.searchsorted(sa_key, torch.cat([k1 + _KEY_TOKEN_MAX, k2]), right=True)
    base2, len2 = torch.cat([sa_base, sa_base]), torch.cat([sa_len, sa_len])
    lo_rel = torch.minimum((lo_abs - base2).clamp(min=0), len2).view(2, -1)
    hi_rel = torch.minimum((hi_abs - base2).clamp(min=0), len2).view(2, -1)
    # a code is one token's exactly between 0 (END and every separator) and the top code
    exact1 = (p0 > 0) & (p0 < _KEY_TOKEN_MAX)
    two = (al >= 2) & exact1  # the second token orders entries only below an exact first
    return _Hints(torch.where(two, lo_rel[1], lo_rel[0]), torch.where(two, hi_rel[1], hi_rel[0]),
                  lo_rel[0], hi_rel[0], exact1, two & (p1 > 0) & (p1 < _KEY_TOKEN_MAX))


class _Longest(NamedTuple):
    best: torch.Tensor    # int64 [B] longest match length
    pat: torch.Tensor     # int32 [B, W] reversed queries in text order (_forward_queries)
    tail_row: torch.Tensor  # int64 [H] row of each tail position matching a token or more
    tail_pos: torch.Tensor  # int64 [H] that position (corpus relative)
    tail_len: torch.Tensor  # int64 [H] its match length
    prow: torch.Tensor    # int64 [R] row of each (row, level) pair, levels oldest first
    pslot: torch.Tensor   # int64 [R] level slot within the row
    act: torch.Tensor     # int64 [A] the pairs searched (their row's qlen > 0)
    idx: torch.Tensor     # int64 [A] insertion point of the whole reversed query in the level
    hints: _Hints | None  # with an sa_key


def _longest(tokens, sa, desc, queries, lengths, max_depth, sa_key=None) -> _Longest:
    """Longest match per row: the tail scanned, one search plus two neighbours per level."""
    dev = queries.device
    B = queries.shape[0]
    W = max(min(max_depth, queries.shape[1]), 1)  # no match is longer than the query width
    qlen = torch.clamp(lengths.to(torch.int64), max=max_depth)
    pat = _forward_queries(queries, qlen, W)
    n_row = desc.num_tokens.to(torch.int64)
    base_row = desc.tok_base
    tail_row = desc.tail_start.to(torch.int64)

    # tail: positions c in [tail_start, n) with tokens[c - 1], tokens[c] tokens
    T = desc.max_tail
    best = torch.zeros(B, dtype=torch.int64, device=dev)
    kr = kpos = klen = torch.zeros(0, dtype=torch.int64, device=dev)
    if T > 0:
        # tokens[c - 1] and tokens[c] of every tail position c in one window per row: the
        # positions whose tokens[c - 1] is the query's last token (few; one dense op), then
        # those that lie in the tail with tokens[c] a token, for rows with a query
        win = _windows(tokens, base_row + tail_row - 1, T + 1)
        kr, kt = torch.nonzero(win[:, :-1] == pat[:, -1:], as_tuple=True)
        ok = (kt < n_row[kr] - tail_row[kr]) & (kt >= 1 - tail_row[kr]) & (qlen[kr] > 0)
        # (both tokens, as a level's entries: a query's negative last token, a separator,
        # matches nothing, as in the kernel)
        ok = torch.nonzero(ok & (win[kr, kt] >= 0) & (win[kr, kt + 1] >= 0), as_tuple=True)[0]
        kr, kt = kr[ok], kt[ok]
        if kr.numel():
            kpos = tail_row[kr] + kt
            klen = _compare(tokens, base_row[kr], kpos[:, None], pat, qlen[kr], kr)[0][:, 0]
            best.scatter_reduce_(0, kr, klen, reduce="amax")

    # (row, level) pairs, levels oldest first
    lv_ptr = desc.level_indptr.to(torch.int64)
    per_row = lv_ptr[1:] - lv_ptr[:-1]
    prow = torch.repeat_interleave(torch.arange(B, device=dev), per_row)
    pslot = torch.arange(prow.numel(), device=dev) - lv_ptr[:-1][prow]
    act = torch.nonzero(qlen[prow] > 0, as_tuple=True)[0]
    idx, hints = act, None
    if act.numel():
        arow = prow[act]
        ab, abase = base_row[arow], desc.level_sa_base[act]
        alen = desc.level_sa_len[act].to(torch.int64)
        al = qlen[arow]
        if sa_key is not None:
            hints = _hints(sa_key, desc.level_key[act], abase, alen, pat, arow, al)
        idx = _bound(tokens, sa, ab, abase, alen, pat, arow, al, False,
                     *((hints.lo, hints.hi) if hints is not None else ()))
        # the longest common prefix with the whole reversed query is at a neighbour of its
        # insertion point; both neighbours in one compare
        nb = torch.stack([idx - 1, idx], dim=1)  # [A, 2]
        ok = (nb >= 0) & (nb < alen[:, None])
        c = _sa_at(sa, abase[:, None], nb, ok)
        lcp, _ = _compare(tokens, ab, c, pat, al, arow)
        best.scatter_reduce_(0, arow, torch.where(ok, lcp, 0).max(dim=1).values, reduce="amax")
    return _Longest(best, pat, kr, kpos, klen, prow, pslot, act, idx, hints)


def _sa_at(sa: torch.Tensor, sa_base: torch.Tensor, j: torch.Tensor, inside: torch.Tensor
           ) -> torch.Tensor:
    """Suffix-array entries ``sa[sa_base + j]`` where ``inside``, position 0 elsewhere.

    An index past a level's range reads the next level, or another corpus's: its position
    may lie past this corpus, and comparing text there would read past the token buffer.
    Position 0 compares as the empty key (every token before it is ``END``)."""
    at = torch.where(inside, sa_base + j, 0).clamp(max=max(sa.numel() - 1, 0))
    return torch.where(inside, torch.take(sa, at), 0)


_WINDOW = 16  # entries read on each side of the insertion point before searching


def _range_at(tokens, sa, base, sa_base, sa_len, pat, prow, l, i0, lo0=None, hi0=None):
    """``(lo, hi)`` per pair: the entries whose key starts with ``pat[prow][:l]``.

    That range holds ``i0``, the insertion point of a longer pattern with this prefix, so the
    ``_WINDOW`` entries on each side of it are compared first (long matches have a few
    occurrences); a side whose run reaches the window's edge is searched instead, within
    ``[lo0, hi0]`` when given (an interval holding the range).
    """
    dev = i0.device
    H = _WINDOW
    j = i0[:, None] + torch.arange(-H, H, device=dev)[None, :]  # [R, 2H]
    inside = (j >= 0) & (j < sa_len[:, None])
    c = _sa_at(sa, sa_base[:, None], j, inside)
    lcp, _ = _compare(tokens, base, c, pat, l, prow)
    hit = (inside & (lcp >= l[:, None])).to(torch.int64)
    left = torch.cumprod(hit[:, :H].flip(1), 1).sum(1)
    right = torch.cumprod(hit[:, H:], 1).sum(1)
    lo, hi = i0 - left, i0 + right
    wide_lo = torch.nonzero(left == H, as_tuple=True)[0]
    wide_hi = torch.nonzero(right == H, as_tuple=True)[0]
    if wide_lo.numel() or wide_hi.numel():
        w = torch.cat([wide_lo, wide_hi])
        found = _bound(tokens, sa, base[w], sa_base[w], sa_len[w], pat, prow[w], l[w],
                       torch.arange(w.numel(), device=dev) >= wide_lo.numel(),
                       *((lo0[w], hi0[w]) if lo0 is not None else ()))
        lo[wide_lo] = found[:wide_lo.numel()]
        hi[wide_hi] = found[wide_lo.numel():]
    return lo, hi


def match_lengths_torch(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                        queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                        sa_key: torch.Tensor | None = None) -> torch.Tensor:
    """``int64 [B]``: only the ``length`` of :func:`suffix_match` (no ranges, no positions)."""
    return _longest(tokens, sa, desc, queries, lengths, max_depth, sa_key).best


def suffix_match_torch(tokens: torch.Tensor, sa: torch.Tensor, desc: MatchDescriptors,
                       queries: torch.Tensor, lengths: torch.Tensor, *, max_depth: int,
                       max_positions: int, max_scan: int | None = None,
                       sa_key: torch.Tensor | None = None) -> MatchResult:
    """Pure-torch implementation of :func:`suffix_match` (same results as the kernel)."""
    dev = queries.device
    B = queries.shape[0]
    P, K = max_positions, desc.max_levels
    best, pat, tail_r, tail_pos, tail_len, prow, pslot, act, idx, hints = _longest(
        tokens, sa, desc, queries, lengths, max_depth, sa_key)

    # ranges at the best length (empty at best 0)
    sa_lo = torch.zeros(B, K, dtype=torch.int64, device=dev)
    sa_hi = torch.zeros(B, K, dtype=torch.int64, device=dev)
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    if prow.numel():
        p_base = desc.level_sa_base
        lo = torch.zeros(prow.numel(), dtype=torch.int64, device=dev)
        hi = torch.zeros_like(lo)
        keep = best[prow[act]] > 0
        sel, i0 = act[keep], idx[keep]
        L = best[prow[sel]]
        if hints is not None and sel.numel():  # one- and two-token ranges are the hints
            h = _Hints(*(x[keep] for x in hints))
            d1 = (L == 1) & h.exact1
            d2 = (L == 2) & h.exact2
            lo[sel] = torch.where(d1, h.lo1, h.lo)
            hi[sel] = torch.where(d1, h.hi1, h.hi)
            rest = torch.nonzero(~(d1 | d2), as_tuple=True)[0]
            sel, i0, L, bounds = sel[rest], i0[rest], L[rest], (h.lo[rest], h.hi[rest])
        else:
            bounds = ()
        if sel.numel():
            lo[sel], hi[sel] = _range_at(tokens, sa, desc.tok_base[prow[sel]], p_base[sel],
                                         desc.level_sa_len[sel].to(torch.int64),
                                         pat, prow[sel], L, i0, *bounds)
        sa_lo[prow, pslot] = p_base + lo
        sa_hi[prow, pslot] = p_base + hi
        count.scatter_add_(0, prow, hi - lo)
    tail_hit = (tail_len >= best[tail_r]) & (best[tail_r] > 0)
    tail_hits = torch.zeros_like(count).scatter_add_(0, tail_r, tail_hit.to(torch.int64))
    count += tail_hits

    # positions: the P largest continuation positions among tail hits and level ranges
    positions = torch.full((B, P), -1, dtype=torch.int64, device=dev)
    if P > 0:
        cand_row = [tail_r[tail_hit]]
        cand_pos = [tail_pos[tail_hit]]
        if prow.numel():
            size = sa_hi[prow, pslot] - sa_lo[prow, pslot]
            if max_scan is not None:
                size = size.clamp(max=max_scan)  # the first max_scan entries of a range
            # a newer source's positions are all larger (tail, then levels newest first): a
            # level whose row already has P hits in newer sources adds nothing
            csum = torch.cumsum(size, 0)
            last = desc.level_indptr[1:].to(torch.int64)[prow] - 1  # the row's newest pair
            newer = csum[last] - csum + tail_hits[prow]
            size = torch.where(newer < P, size, 0)
            r = torch.repeat_interleave(prow, size)
            start = torch.repeat_interleave(sa_lo[prow, pslot], size)
            first = torch.cumsum(size, 0) - size
            off = torch.arange(r.numel(), device=dev) - torch.repeat_interleave(first, size)
            cand_row.append(r)
            cand_pos.append(torch.take(sa, start + off).to(torch.int64))
        rr = torch.cat(cand_row)
        cp = torch.cat(cand_pos)
        if rr.numel():
            order = torch.argsort(rr * (1 << 40) - cp, stable=True)
            rr, cp = rr[order], cp[order]
            grp_first = torch.searchsorted(rr, torch.arange(B, device=dev))
            rank = torch.arange(rr.numel(), device=dev) - grp_first[rr]
            keep = rank < P
            positions[rr[keep], rank[keep]] = cp[keep]
    return MatchResult(best.to(torch.int32), count, positions, sa_lo, sa_hi)
