"""Brute-force references for SuffixIndex.match and the arena's match descriptors (shared by
tests and benchmarks)."""

from __future__ import annotations


def match_reference(corpus: list[int], query: list[int], max_depth: int, max_positions: int
                    ) -> tuple[int, int, list[int]]:
    """Returns (length, count, positions) exactly as the index defines them.

    ``positions`` are the ``min(P, count)`` largest continuation positions, descending.
    """
    n = len(corpus)
    best, hits = 0, []
    if query and query[-1] < 0:  # a separator last: no position's context ends with it
        return 0, 0, []
    for l in range(min(len(query), max_depth), 0, -1):
        pat = query[len(query) - l:]
        hits = [s + l for s in range(0, n - l) if corpus[s:s + l] == pat and corpus[s + l] >= 0]
        if hits:
            best = l
            break
    if best == 0:
        return 0, 0, []
    return best, len(hits), sorted(hits, reverse=True)[:max_positions]


def descriptors_reference(arena, corpus_ids: list[int]) -> tuple[list, list, int, int]:
    """``(int64 fields, int32 fields, max levels, max tail)`` of ``arena.descriptors``, read
    row by row from the arena's corpus objects (what it did before its descriptor table):
    int64 ``tok_base | level sa_base | level key``, int32 ``n | tail | level indptr | level
    sa_len``."""
    from agspec_gpu.kernels.suffix_match import KEY_SEQ_SHIFT

    tok_base, n, tail, ptr, lv_base, lv_len, lv_key = [], [], [], [0], [], [], []
    for cid in corpus_ids:
        c = arena._corpora[cid]
        tok_base.append(c.tok_base)
        n.append(c.n)
        tail.append(c.tail_start)
        for lv in c.levels:
            lv_base.append(lv.sa_base)
            lv_len.append(lv.sa_len)
            lv_key.append(lv.seq << KEY_SEQ_SHIFT)
        ptr.append(len(lv_base))
    return (tok_base + lv_base + lv_key, n + tail + ptr + lv_len,
            max([b - a for a, b in zip(ptr, ptr[1:])] + [0]),
            max([a - b for a, b in zip(n, tail)] + [0]))
