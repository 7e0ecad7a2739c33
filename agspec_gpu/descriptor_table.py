"""Host tables of every corpus's match-descriptor fields, for a step's descriptors in a few
numpy gathers.

A propose matches ``B`` requests against their corpora, ``3 B`` (request, corpus) rows at
three tiers; the suffix-match kernel reads, per row, the corpus's token base, length and
tail start and its levels' suffix-array ranges (:class:`~agspec_gpu.kernels.suffix_match.
MatchDescriptors`). Read row by row from the arena's corpus objects that is a Python loop
of ~0.4 us a row on the development machine (82 us of a propose's host time at B = 64);
here the fields of every live corpus sit in one numpy table, a row per corpus, kept up to
date by :class:`~agspec_gpu.index.IndexArena` whenever a corpus changes, and a step's rows
are gathered at once (8 / 15 / 33 us at 3 / 48 / 192 rows there).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


_FIXED = 4  # columns of a row before its levels: tok_base, n, tail_start, level count


class DescriptorTable:
    """One int64 row per live corpus: ``tok_base, n, tail_start, num_levels``, then its levels'
    ``(sa_base, sa_len, key)`` triples, oldest first, padded to the widest corpus's level
    count (one row gather serves every field).

    :attr:`version` counts the changes to any row (:meth:`set`, :meth:`add_tokens`,
    :meth:`drop`: one each): a caller that keeps gathered descriptors (a running batch's
    drafter, on the device) knows they are current while it has not moved, or moved only by
    the appends the caller mirrored."""

    def __init__(self, rows: int = 64, levels: int = 4) -> None:
        self.version = 0
        self._row: dict[int, int] = {}  # corpus id -> row
        self._free: list[int] = []
        self._t = np.zeros((0, _FIXED + 3 * levels), np.int64)
        self._grow(rows, levels)

    def _grow(self, rows: int, levels: int) -> None:
        old = self._t
        new = np.zeros((rows, _FIXED + 3 * levels), np.int64)
        new[:old.shape[0], :old.shape[1]] = old  # (built whole before it replaces the old)
        self._t = new
        self._free += range(rows - 1, old.shape[0] - 1, -1)

    def set(self, cid: int, tok_base: int, n: int, tail: int,
            levels: Sequence[tuple[int, int, int]]) -> None:
        """Corpus ``cid``'s fields (a new corpus gets a row); ``levels``: ``(sa_base, sa_len,
        key)`` each, oldest first."""
        width = (self._t.shape[1] - _FIXED) // 3
        row = self._row.get(cid)
        rows = self._t.shape[0] * (2 if row is None and not self._free else 1)
        if len(levels) > width or rows > self._t.shape[0]:  # one growth: wider, longer, both
            self._grow(rows, max(width, 2 * len(levels)) if len(levels) > width else width)
        if row is None:
            row = self._row[cid] = self._free.pop()
        self.version += 1
        self._t[row, :_FIXED + 3 * len(levels)] = [tok_base, n, tail, len(levels),
                                                   *(x for lv in levels for x in lv)]

    def add_tokens(self, cids: Sequence[int], counts: Sequence[int]) -> None:
        """``n += counts[i]`` for each (distinct) corpus ``cids[i]``."""
        self.version += 1
        # (numpy's fancy-indexed add costs ~4 us even for one row; item by item ~0.4 us a
        # row, np.add.at 2.5-8 us: the cheaper per batch size)
        if len(cids) <= 16:
            n = self._t[:, 1]
            for c, k in zip(cids, counts):
                n[self._row[c]] += k
        else:
            np.add.at(self._t[:, 1], np.fromiter(map(self._row.__getitem__, cids), np.int64,
                                                 len(cids)), counts)

    def drop(self, cid: int) -> None:
        self.version += 1
        self._free.append(self._row.pop(cid))

    def gather(self, corpus_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The descriptors of rows ``corpus_ids`` (ids may repeat): ``(int64 [R + 2 K]
        tok_base | level sa_base | level key, int64 [3 R + 1 + K] n | tail | level indptr |
        level sa_len, max levels of a row, max tail length of a row)``, ``K`` the rows'
        levels in row order. Raises KeyError for an id it does not hold."""
        R = len(corpus_ids)
        if R == 0:
            return np.zeros(0, np.int64), np.zeros(1, np.int64), 0, 0
        g = self._t[np.fromiter(map(self._row.__getitem__, corpus_ids), np.int64, R)]
        # the per-row counts as host ints: numpy's reductions cost ~2 us a call here, a
        # Python max of a list far less at a step's row counts
        nl = g[:, 3].tolist()
        W = max(nl)
        lv = g[:, _FIXED:_FIXED + 3 * W].reshape(R, W, 3)
        lv = lv.reshape(R * W, 3) if min(nl) == W else lv[np.arange(W) < g[:, 3:4]]
        i64 = np.concatenate([g[:, 0], lv[:, 0], lv[:, 2]])  # [K, 3] row by row above
        i32 = np.concatenate([g[:, 1], g[:, 2], [0, *itertools.accumulate(nl)], lv[:, 1]])
        return i64, i32, W, max(0, max((g[:, 1] - g[:, 2]).tolist()))
