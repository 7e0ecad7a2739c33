"""Depth-bounded suffix arrays built on the device with torch sorts (prefix doubling).

A suffix array over positions ``[lo, hi)`` of a token tensor orders those positions by the
first ``depth`` tokens of the suffix starting there. Tokens beyond the end of the tensor
compare as ``END``, below every value; separators (negative values) compare below every
token, so among suffixes that share a pattern those followed by a separator or the end come
first, and the ones followed by a real token come out sorted by that token.

Prefix doubling, by up to four: ranks of single tokens come from one sort; each round packs
the ranks of ``k`` consecutive covered-length blocks into one int64 key (``k = 4`` while
four ranks fit, 3 or 2 for longer texts) and ranks the keys with one sort, so the covered
length grows ``k``-fold (the last round's blocks overlap to cover exactly ``depth``):
``depth`` tokens take ``ceil(log_k(depth))`` rounds, 3 for 64 where pairs took 6. The index
sorts by ``max_depth + 1`` tokens so that a match's continuation token is ordered too.
Ties (identical first ``depth`` tokens) keep ascending position order: every sort is stable.
On a CPU the rounds stop once every rank is distinct; on a GPU every round runs (knowing
the rank count is a wait for the device), so a build reads the device at most once, for the
size of its selection of positions, and not at all when the caller knows that size
(``num_selected``: the index counts it from the separators it records). A session corpus
builds a level every ``tail_tokens`` appended tokens, inside a decode step's commit.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import torch


def _dense_rank(key: torch.Tensor, count: bool) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Stable sort of ``key`` -> (rank per element, 1-based; sort order; number of ranks, read
    from the device only with ``count``, else None)."""
    sorted_key, order = torch.sort(key, stable=True)
    # 1 + the number of key changes up to each element (four ops; a build runs ~7 of these)
    changes = torch.cumsum(sorted_key[1:] != sorted_key[:-1], 0)
    rank_sorted = torch.nn.functional.pad(changes, (1, 0)) + 1 if sorted_key.numel() else changes
    # scatter_, not `rank[order] = ...`: advanced-index assignment is ~100x slower on CPU
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    num = (int(rank_sorted[-1]) if rank_sorted.numel() else 0) if count else None
    return rank, order, num


def _compress(values: torch.Tensor, keep: torch.Tensor, num: int) -> torch.Tensor:
    """``values[keep]`` for a mask of ``num`` set elements that the caller knows: one scatter
    (each kept element to its rank among the kept, the rest to a spare slot past the end)
    instead of a boolean index, which waits for the device to learn its size. On a CPU, where
    that costs nothing, a wrong ``num`` raises."""
    if values.device.type == "cpu" and int(keep.sum()) != num:
        raise ValueError(f"num_selected: {num} positions given, the selection holds "
                         f"{int(keep.sum())}")
    dst = torch.cumsum(keep, 0).sub_(1).clamp_(max=num)
    dst = torch.where(keep, dst, num)
    out = torch.empty(num + 1, dtype=values.dtype, device=values.device)
    return out.scatter_(0, dst, values)[:num]


def _ranks_per_key(m: int) -> int:
    """How many ranks (each in ``[0, m]``) one int64 key holds: the most ``k <= 4`` with
    ``(m + 1)^k < 2^63`` (4 up to m = 55,107, 3 up to 2,097,150, else 2)."""
    k = 4
    while k > 2 and (m + 1) ** k >= 1 << 63:
        k -= 1
    return k


def _check_range(fn: str, tokens: torch.Tensor, lo: int, hi: int, depth: int) -> int:
    """``n`` of ``tokens``; ValueError naming ``fn`` unless ``0 <= lo <= hi <= n``, depth >= 1."""
    n = tokens.numel()
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"{fn}: bad range [{lo}, {hi}) for n={n}")
    if depth < 1:
        raise ValueError(f"{fn}: depth must be >= 1, got {depth}")
    return n


def build_suffix_array(tokens: torch.Tensor, lo: int, hi: int, depth: int, *,
                       early_stop: bool | None = None, after_token: bool = False,
                       num_selected: int | None = None) -> torch.Tensor:
    """Sorts the non-separator positions in ``[lo, hi)`` by their first ``depth`` tokens.

    Args:
        tokens: ``int32 [n]`` corpus (negative values are separators).
        lo, hi: position range to index, ``0 <= lo <= hi <= n``.
        depth: number of leading tokens that define the order (>= 1).
        early_stop: stop the doubling rounds once every rank is distinct (a read of the
            rank count per round: a wait for the device on a GPU); None: on a CPU only.
            The result is the same either way (distinct ranks keep their order).
        after_token: keep only positions ``p`` whose predecessor ``tokens[p - 1]`` is a
            token too (``lo >= 1``), in the same selection.
        num_selected: the number of positions selected (``m`` below) when the caller knows
            it (a CPU checks it): then nothing is read from the device without
            ``early_stop``.

    Returns:
        ``int32 [m]``: the positions ``p`` in ``[lo, hi)`` with ``tokens[p] >= 0``, sorted by
        ``tokens[p : p + depth]`` (shorter-by-END and separator-terminated suffixes first),
        ties in ascending position. Without ``early_stop`` the one read from the device is
        the selection's size, unless ``num_selected`` gives it.
    """
    n = _check_range("build_suffix_array", tokens, lo, hi, depth)
    if after_token and lo < 1:
        raise ValueError("build_suffix_array: after_token needs lo >= 1")
    if early_stop is None:
        early_stop = tokens.device.type == "cpu"
    end = min(n, hi + depth)
    win = tokens[lo:end].to(torch.int64)
    m = win.numel()
    if hi == lo:
        if num_selected:
            raise ValueError(f"num_selected: {num_selected} positions given, the range is "
                             f"empty")
        return torch.empty(0, dtype=torch.int32, device=tokens.device)
    # rank 0 is END (beyond the window); token values get dense ranks >= 1 in value order
    rank, order, num = _dense_rank(win, early_stop)
    covered, k = 1, _ranks_per_key(m)
    while covered < depth and (num is None or num < m):
        # the ranks of the blocks at i, i + c, i + 2c, ... (c = covered) and, last, at
        # i + L - c, which overlaps the one before unless L is k * c, so that exactly
        # `depth` tokens define the order (ties then stay in position order, as
        # documented). Ranks are at most m: the key (rank, next, ...) is the number
        # rank * (m + 1)^(k - 1) + ... in base m + 1, built without a read
        L = min(k * covered, depth)
        ext = torch.nn.functional.pad(rank, (0, L - covered))  # rank 0 (END) past the end
        key = rank
        for at in [j * covered for j in range(1, k - 1) if j * covered < L - covered] + \
                [L - covered]:
            key = torch.add(ext[at:at + m], key, alpha=m + 1)
        rank, order, num = _dense_rank(key, early_stop)
        covered = L
    keep = (order < (hi - lo)) & (win[order] >= 0)
    if after_token:
        keep &= tokens[(order + (lo - 1)).clamp(max=n - 1)] >= 0
    picked = order[keep] if num_selected is None else _compress(order, keep, num_selected)
    return (picked + lo).to(torch.int32)


def build_context_array(tokens: torch.Tensor, lo: int, hi: int, depth: int, *,
                        early_stop: bool | None = None, num_selected: int | None = None
                        ) -> torch.Tensor:
    """The suffix array of the reversed text over continuation positions ``[lo, hi)``.

    Args:
        tokens: ``int32 [n]`` corpus (negative values are separators).
        lo, hi: position range to index, ``0 <= lo <= hi <= n``.
        depth: number of context tokens that define the order (>= 1).

    Returns:
        ``int32 [m]``: the positions ``c`` in ``[lo, hi)`` with ``c >= 1`` and ``tokens[c - 1]``,
        ``tokens[c]`` both ``>= 0``, sorted by their context read backwards,
        ``tokens[c - 1], tokens[c - 2], ..., tokens[c - depth]`` (``END`` before position 0,
        so shorter contexts first; separators below tokens), equal contexts in descending
        position. Every key is final once ``c < n``: appends never change it. ``early_stop``
        and ``num_selected`` (the number of such ``c``, :func:`num_context_positions`) as
        :func:`build_suffix_array`'s: without either, one read of the device per build.
    """
    _check_range("build_context_array", tokens, lo, hi, depth)
    lo = max(lo, 1)  # position 0 has an empty context
    if hi <= lo:
        if num_selected:
            raise ValueError(f"num_selected: {num_selected} positions given, the selection "
                             f"is empty")
        return torch.empty(0, dtype=torch.int32, device=tokens.device)
    # rev[j] = tokens[hi - 1 - j] over the tokens any key reads; key(c) is the suffix of rev
    # at j = hi - c, and the end of rev is position 0's start only when a = 0 (else it lies
    # beyond depth tokens of every key)
    a = max(0, lo - depth)
    rev = tokens[a:hi].flip(0)
    # rev[j] = tokens[c - 1] >= 0 and, after_token, rev[j - 1] = tokens[c] >= 0: one selection
    j = build_suffix_array(rev, 1, hi - lo + 1, depth, early_stop=early_stop,
                           after_token=True, num_selected=num_selected)
    return (hi - j).to(torch.int32)


def num_context_positions(separators: Sequence[int], lo: int, hi: int) -> int:
    """How many positions :func:`build_context_array` selects in ``[lo, hi)`` of a text whose
    negative values sit exactly at ``separators`` (ascending): the ``c >= 1`` with neither
    ``c`` nor ``c - 1`` among them. Host arithmetic over the separators near the range."""
    lo = max(lo, 1)
    if hi <= lo:
        return 0
    near = separators[bisect_left(separators, lo - 1):bisect_left(separators, hi)]
    out = {c for s in near for c in (s, s + 1) if lo <= c < hi}
    return hi - lo - len(out)
