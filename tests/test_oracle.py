"""The oracle's longest prefix (matching statistics over the reversed-text index) against a
brute force: every prefix length, documents that end right after the prefix, the corpus end,
separators, repeated and periodic text, several levels and a tail."""

from __future__ import annotations

import random

import pytest
import torch

from agspec_gpu.index import IndexArena, IndexConfig
from agspec_gpu.oracle import longest_prefix


def brute(corpus: list[int], pattern: list[int]) -> int:
    """Longest prefix of ``pattern`` (cut at its first negative) occurring in ``corpus``."""
    p = []
    for t in pattern:
        if t < 0:
            break
        p.append(t)
    best = 0
    for s in range(len(corpus)):
        l = 0
        while l < len(p) and s + l < len(corpus) and corpus[s + l] == p[l]:
            l += 1
        best = max(best, l)
    return best


def corpora(rng: random.Random) -> list[list[int]]:
    out = [[], [5], [3] * 40, [t % 3 for t in range(60)],
           [1, 2, 3, -1, 1, 2, 4, -1, 7, 1, 2]]  # 1 2 3 only ends a document
    for _ in range(6):
        x = [rng.randrange(4) for _ in range(rng.randrange(1, 90))]
        for i in rng.sample(range(len(x)), len(x) // 8):
            x[i] = -1
        out.append(x)
    return out


@pytest.mark.parametrize("max_depth,tail_tokens,k", [(4, 1, 12), (8, 5, 12), (64, 16, 12),
                                                     (64, 1000, 12), (64, 16, 32), (32, 3, 32)])
def test_longest_prefix_equals_brute_force(max_depth, tail_tokens, k):
    rng = random.Random(max_depth * 7 + tail_tokens + k)
    arena = IndexArena(IndexConfig(max_depth=max_depth, tail_tokens=tail_tokens),
                       initial_tokens=32)
    docs = corpora(rng)
    cids = []
    for d in docs:
        cid = arena.new_corpus(16)
        for i in range(0, len(d), 7):  # chunked appends: levels, merges and a tail
            arena.append(cid, torch.tensor(d[i:i + 7], dtype=torch.int32))
        cids.append(cid)
    rows, pats = [], []
    for ci, d in enumerate(docs):
        for _ in range(8):
            toks = [t for t in d if t >= 0]
            if toks and rng.random() < 0.7:  # a corpus span, then anything
                s = rng.randrange(len(d))
                pat = [t if t >= 0 else 0 for t in d[s:s + rng.randrange(1, k + 1)]]
            else:
                pat = []
            pat += [rng.randrange(5) for _ in range(k - len(pat))]
            if rng.random() < 0.3:  # padded early
                cut = rng.randrange(k + 1)
                pat = pat[:cut] + [-1] * (k - cut)
            rows.append(ci)
            pats.append(pat)
    pats.append([3] * k)  # the whole pattern occurs
    rows.append(2)
    pats.append(([t % 3 for t in range(20)] + [9] * k)[:k])  # found up to 20 tokens
    rows.append(3)
    pats.append([1, 2, 3, 9] + [-1] * (k - 4))  # occurs only right before a separator
    rows.append(4)
    pats.append([7, 1, 2, 5] + [-1] * (k - 4))  # occurs only at the corpus end
    rows.append(4)
    got = longest_prefix(arena, torch.tensor(pats, dtype=torch.int32), [cids[r] for r in rows])
    want = [min(brute(docs[r], p), max_depth) for r, p in zip(rows, pats)]
    assert got.tolist() == want
    assert got[-2:].tolist() == [min(3, max_depth)] * 2
    if k == 32 and max_depth >= 32:  # every round of the search is exercised
        assert {0, 1, 20, 32} <= set(want)


def test_longest_prefix_empty_inputs():
    arena = IndexArena(IndexConfig(max_depth=4, tail_tokens=2))
    cid = arena.new_corpus()
    arena.append(cid, torch.tensor([1, 2, 3], dtype=torch.int32))
    assert longest_prefix(arena, torch.zeros(0, 5, dtype=torch.int32), []).shape == (0,)
    assert longest_prefix(arena, torch.zeros(2, 0, dtype=torch.int32), [cid, cid]).tolist() == [0, 0]
    assert longest_prefix(arena, torch.full((1, 3), -1, dtype=torch.int32), [cid]).tolist() == [0]
