"""Brute-force reference for SuffixIndex.match (shared by tests and benchmarks)."""

from __future__ import annotations


def match_reference(corpus: list[int], query: list[int], max_depth: int, max_positions: int
                    ) -> tuple[int, int, list[int]]:
    """Returns (length, count, positions) exactly as the index defines them.

    ``positions`` are the ``min(P, count)`` largest continuation positions, descending.
    """
    n = len(corpus)
    best, hits = 0, []
    for l in range(min(len(query), max_depth), 0, -1):
        pat = query[len(query) - l:]
        hits = [s + l for s in range(0, n - l) if corpus[s:s + l] == pat and corpus[s + l] >= 0]
        if hits:
            best = l
            break
    if best == 0:
        return 0, 0, []
    return best, len(hits), sorted(hits, reverse=True)[:max_positions]
