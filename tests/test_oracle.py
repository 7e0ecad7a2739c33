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
    assert longest_prefix(arena, torch.zeros(2, 0, dtype=torch.int32),
                          [cid, cid]).tolist() == [0, 0]
    assert longest_prefix(arena, torch.full((1, 3), -1, dtype=torch.int32), [cid]).tolist() == [0]


def _stepwise(arena, session_cid, other_cids, message, k):
    """``longest_prefix`` at every position of ``message``, the session corpus growing by
    one emitted token at a time (what the replay's oracle lane computed per step)."""
    out = []
    for p in range(len(message)):
        pat = (message[p:p + k] + [-1] * k)[:k]
        cids = [session_cid] + other_cids
        got = longest_prefix(arena, torch.tensor([pat] * len(cids), dtype=torch.int32), cids)
        out.append(int(got.max()))
        arena.append(session_cid, torch.tensor([message[p]], dtype=torch.int32))
    return out


@pytest.mark.parametrize("max_depth,tail_tokens,k,seed", [
    (8, 3, 8, 0), (8, 5, 12, 1), (32, 16, 32, 2), (32, 1000, 32, 3), (64, 7, 32, 4),
    (16, 2, 16, 5)])
def test_message_prefix_lengths_equals_longest_prefix_per_step(max_depth, tail_tokens, k, seed):
    from agspec_gpu.oracle import message_prefix_lengths

    rng = random.Random(seed)
    for trial in range(6):
        arena = IndexArena(IndexConfig(max_depth=max_depth, tail_tokens=tail_tokens),
                           initial_tokens=32)
        docs = corpora(rng)[rng.randrange(11)] if trial % 2 else \
            [1, 2, 3, -1, 1, 2, 4, -1, 7, 1, 2]  # 1 2 3 only ends a document
        docs_cid = arena.new_corpus(16)
        for i in range(0, len(docs), 5):
            arena.append(docs_cid, torch.tensor(docs[i:i + 5], dtype=torch.int32))
        empty_cid = arena.new_corpus(16)  # a tier with nothing in it yet
        context = [rng.randrange(4) for _ in range(rng.choice([0, 1, 5, 40, 90]))]
        session_cid = arena.new_corpus(16)
        for i in range(0, len(context), 9):
            arena.append(session_cid, torch.tensor(context[i:i + 9], dtype=torch.int32))
        message: list[int] = []
        size = [1, 2, 30, 70, 120, 200][trial]
        while len(message) < size:
            kind = rng.randrange(5)
            if kind == 0 and context:  # a copy of the context, possibly straddling its end
                s = rng.randrange(len(context))
                message += context[s:s + rng.randrange(1, 40)]
            elif kind == 1 and message:  # a copy of what the message emitted already
                s = rng.randrange(len(message))
                message += message[s:s + rng.randrange(1, 40)]
            elif kind == 2:
                message += [t for t in docs if t >= 0][:rng.randrange(1, 12)]
            elif kind == 3:
                message += [5] * rng.randrange(1, 20) + [t % 3 for t in range(rng.randrange(9))]
            else:
                message.append(rng.randrange(6))
        if trial == 0:
            message = [1, 2, 3, 9, 7, 1, 2] + message  # document ends: docs and the session
        lead = torch.tensor(context[-k:], dtype=torch.int32)
        got = message_prefix_lengths(arena, [session_cid, empty_cid, docs_cid], lead,
                                     torch.tensor(message, dtype=torch.int32), k)
        want = _stepwise(arena, session_cid, [empty_cid, docs_cid], message, k)
        assert got.tolist() == want, (trial, message)


def test_message_prefix_lengths_empty_message_and_self_copies():
    from agspec_gpu.oracle import message_prefix_lengths

    arena = IndexArena(IndexConfig(max_depth=8, tail_tokens=4))
    cid = arena.new_corpus()
    assert message_prefix_lengths(arena, [cid], torch.zeros(0, dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.int32), 8).shape == (0,)
    # nothing before it: only the message's own earlier text counts, the copy ending by p
    got = message_prefix_lengths(arena, [cid], torch.zeros(0, dtype=torch.int32),
                                 torch.tensor([4, 4, 4, 4, 4, 4], dtype=torch.int32), 8)
    assert got.tolist() == [0, 1, 2, 3, 2, 1]
