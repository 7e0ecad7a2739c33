"""Tests for agspec_gpu.index (SuffixIndex, IndexArena) and agspec_gpu.kernels.suffix_array.

Everything is compared with the brute-force ``index_reference.match_reference``: hand-written
golden cases (expected ``(length, count, positions)`` written out), hypothesis property tests
over small corpora, appends/merges against a fresh build of the concatenation, several corpora
in one arena, memory accounting and input validation. The torch path runs here; the Triton
kernel has its own tests (``test_suffix_match.py``).
"""

from __future__ import annotations

import importlib.util
import math
import random
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agspec_gpu.index import IndexArena, IndexConfig, SuffixIndex
from agspec_gpu.kernels.suffix_array import (build_context_array, build_suffix_array,
                                     num_context_positions)
from agspec_gpu.kernels.suffix_match import KEY_SEQ_SHIFT
from index_reference import descriptors_reference, match_reference

PROPS = settings(max_examples=150, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PAD = -7  # left padding of short query rows: negative, so reading it would be caught




# ------------------------------------------------------------------------------ helpers
def t32(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int32)


def pack(queries: list[list[int]], L: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligns query rows into ``int32 [B, L]`` (left padding ``PAD``) + lengths."""
    L = max([len(q) for q in queries] + [0]) if L is None else L
    rows = [[PAD] * (L - len(q)) + list(q) for q in queries]
    q = torch.tensor(rows, dtype=torch.int32).reshape(len(queries), L)
    return q, t32(len(x) for x in queries)


def rows_of(m, P: int) -> list[tuple[int, int, list[int]]]:
    """(length, count, positions without padding) per row; checks the padding and shapes."""
    B = m.length.shape[0]
    assert m.positions.shape == (B, P)
    out = []
    for b in range(B):
        pos = m.positions[b].tolist()
        k = sum(p >= 0 for p in pos)
        assert pos[k:] == [-1] * (P - k), f"row {b}: padding not at the end: {pos}"
        out.append((int(m.length[b]), int(m.count[b]), pos[:k]))
    return out


def check_against_reference(idx, corpus: list[int], queries: list[list[int]], max_depth: int,
                            P: int, L: int | None = None) -> list:
    q, lens = pack(queries, L)
    m = idx.match(q, lens, max_positions=P)
    got = rows_of(m, P)
    for b, qr in enumerate(queries):
        want = match_reference(corpus, qr, max_depth, P)
        assert got[b] == want, (
            f"row {b}: query={qr} max_depth={max_depth} P={P}\n  got  {got[b]}\n  want {want}"
            f"\n  corpus={corpus if len(corpus) < 200 else f'<{len(corpus)} tokens>'}")
    check_level_ranges(idx, corpus, queries, m)
    return got


def check_level_ranges(idx, corpus: list[int], queries: list[list[int]], m) -> None:
    """Every per-level range holds continuation positions preceded by the match and followed
    by a token, the levels' ranges hold ``count`` minus the tail's hits, and the contexts
    (read backwards) come out sorted."""
    sa = idx.arena.sa
    for b, qr in enumerate(queries):
        l = int(m.length[b])
        pat = qr[len(qr) - l:] if l else []
        total = 0
        for k in range(m.sa_lo.shape[1]):
            lo, hi = int(m.sa_lo[b, k]), int(m.sa_hi[b, k])
            assert lo <= hi
            if l == 0:
                assert lo == hi
                continue
            keys = []
            for c in sa[lo:hi].tolist():
                assert corpus[c - l:c] == pat, f"row {b}: context of {c} does not end with {pat}"
                assert c < len(corpus) and corpus[c] >= 0
                keys.append(corpus[max(0, c - idx.arena.config.max_depth):c][::-1])
            assert keys == sorted(keys), f"row {b} level {k}: contexts unsorted"
            total += hi - lo
        assert total <= int(m.count[b])


def stdlib_tokens(n: int) -> list[int]:
    """``n`` real cl100k tokens of Python standard-library sources (files joined by -1)."""
    from agspec_gpu.tokenizer import load_tokenizer

    tok = load_tokenizer("cl100k")
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[int] = []
    for name in ("textwrap.py", "difflib.py", "argparse.py", "inspect.py", "typing.py",
                 "pathlib.py", "dataclasses.py", "functools.py", "ast.py", "tarfile.py"):
        if len(out) >= n:
            break
        path = root / name
        if path.exists():
            out += tok.encode(path.read_text(encoding="utf-8")) + [-1]
    assert len(out) >= n, "not enough standard-library sources on this machine"
    return out[:n]


# ------------------------------------------------------------------------------ contract
def test_contract_dtypes_and_shapes():
    idx = SuffixIndex.build(t32([3, 1, 4, 1, 5, 9, 2, 6, -1, 3, 1, 4]), max_depth=64)
    for B, L, P in ((3, 5, 8), (1, 1, 1), (2, 4, 0), (0, 4, 8), (2, 0, 3)):
        q = torch.randint(0, 10, (B, L), dtype=torch.int32)
        m = idx.match(q, torch.full((B,), L, dtype=torch.int32), max_positions=P)
        assert m.length.dtype == torch.int32 and m.length.shape == (B,)
        assert m.count.dtype == torch.int64 and m.count.shape == (B,)
        assert m.positions.dtype == torch.int64 and m.positions.shape == (B, P)
    m = idx.match(*pack([[3, 1, 4]]))  # default max_positions = 8
    assert m.positions.shape == (1, 8)
    assert rows_of(m, 8) == [(3, 1, [3])]  # the later "3 1 4" ends the corpus
    assert idx.num_tokens == 12 and idx.max_depth == 64
    assert idx.tokens.dtype == torch.int32 and idx.tokens.tolist()[:3] == [3, 1, 4]


# ------------------------------------------------------------------------------ golden cases
# (corpus, max_depth, query, P, expected (length, count, positions)); positions are the
# index of the token after each match, largest (most recent) first.
REP = [5] * 10
PER = [1, 2, 3] * 5                      # token at i is i % 3 + 1
TINY = [1, -1, 1, 2, -1, 1, -1, 1, 2, -1, 2]
EMPTY_DOCS = [-1, -1, 4, 5, -1, -1, -1, 4, 5, 6, -1, -1]
ALT = [1, -1, 2, -1, 1, -1, 2, -1, 1]     # a separator at every other position
GOLDEN = [
    # one repeated token: 5^l at s needs s + l < 10
    (REP, 64, [5, 5, 5], 8, (3, 7, [9, 8, 7, 6, 5, 4, 3])),
    (REP, 64, [5, 5, 5], 2, (3, 7, [9, 8])),
    (REP, 64, [5] * 12, 8, (9, 1, [9])),
    (REP, 4, [5] * 12, 8, (4, 6, [9, 8, 7, 6, 5, 4])),
    (REP, 64, [3, 5], 8, (1, 9, [9, 8, 7, 6, 5, 4, 3, 2])),
    (REP, 64, [5, 3], 8, (0, 0, [])),
    (REP, 64, [5], 0, (1, 9, [])),
    # periodic text
    (PER, 64, [1, 2, 3, 1], 8, (4, 4, [13, 10, 7, 4])),
    (PER, 64, PER[1:], 8, (12, 1, [12])),          # the full suffix has no continuation
    (PER, 5, PER[1:], 8, (5, 3, [12, 9, 6])),
    (PER, 64, [9, 3], 8, (1, 4, [12, 9, 6, 3])),
    # many tiny documents: matches never cross or continue into a separator
    (TINY, 64, [1], 8, (1, 2, [8, 3])),
    (TINY, 64, [2, 1], 8, (1, 2, [8, 3])),
    (TINY, 64, [1, 2], 8, (0, 0, [])),              # "1 2" occurs, but always before -1
    (TINY, 64, [2], 8, (0, 0, [])),
    # empty documents (consecutive separators)
    (EMPTY_DOCS, 64, [4, 5], 8, (2, 1, [9])),
    (EMPTY_DOCS, 64, [5], 8, (1, 1, [9])),
    (EMPTY_DOCS, 64, [6], 8, (0, 0, [])),
    (EMPTY_DOCS, 64, [7, 4], 8, (1, 2, [8, 3])),
    ([-1, -2, -3], 64, [1], 8, (0, 0, [])),
    # separators at every other position: no token is ever followed by a token
    (ALT, 64, [1], 8, (0, 0, [])),
    (ALT, 64, [2, 1], 8, (0, 0, [])),
    # length-0 query
    (PER, 64, [], 8, (0, 0, [])),
    # single-token corpus: nothing follows it
    ([4], 64, [4], 8, (0, 0, [])),
    ([4, 4], 1, [4, 4, 4], 8, (1, 1, [1])),
]


@pytest.mark.parametrize("tail_tokens", [1, 256])
@pytest.mark.parametrize("case", range(len(GOLDEN)))
def test_golden(case, tail_tokens):
    corpus, max_depth, query, P, want = GOLDEN[case]
    assert match_reference(corpus, query, max_depth, P) == want  # the hand-written value
    idx = SuffixIndex.build(t32(corpus), max_depth=max_depth, tail_tokens=tail_tokens)
    q, lens = pack([query], L=len(query) + 3)  # padded: the padding must not be read
    assert rows_of(idx.match(q, lens, max_positions=P), P) == [want]


def test_golden_batch_mixed_lengths():
    """One batch with length-0, length-1 and over-long rows; rows are independent."""
    corpus = PER * 30  # 450 tokens, period 3
    idx = SuffixIndex.build(t32(corpus), max_depth=64, tail_tokens=16)
    long_q = corpus[:100]  # longer than max_depth: only the last 64 tokens count
    qs = [[], [2], long_q, [3, 1], [7]]
    q, lens = pack(qs, L=100)
    got = rows_of(idx.match(q, lens, max_positions=3), 3)
    assert got[0] == (0, 0, [])
    assert got[1] == (1, 150, [449, 446, 443])
    # long_q ends with corpus[99] = 1; its last 64 tokens end at e % 3 == 0, 63 <= e <= 447
    assert got[2] == (64, 129, [448, 445, 442])
    assert got[3] == (2, 149, [448, 445, 442])
    assert got[4] == (0, 0, [])
    check_against_reference(idx, corpus, qs, 64, 3, L=100)


def test_lengths_zero_with_tokens_present():
    idx = SuffixIndex.build(t32(REP), max_depth=64)
    q = torch.full((2, 4), 5, dtype=torch.int32)
    got = rows_of(idx.match(q, t32([0, 4]), max_positions=8), 8)
    assert got == [(0, 0, []), (4, 6, [9, 8, 7, 6, 5, 4])]


def test_empty_corpus_then_append():
    idx = SuffixIndex.build(torch.empty(0, dtype=torch.int32), max_depth=64)
    assert idx.num_tokens == 0
    assert rows_of(idx.match(*pack([[1, 2], [], [3]]), max_positions=4), 4) == [(0, 0, [])] * 3
    idx.append(t32([1, 2, 3]))
    assert rows_of(idx.match(*pack([[1, 2], [2], [3]]), max_positions=4), 4) == [
        (2, 1, [2]), (1, 1, [2]), (0, 0, [])]


def test_query_longer_than_corpus_and_depth():
    corpus = list(range(1, 21))
    idx = SuffixIndex.build(t32(corpus), max_depth=8)
    q = [0] * 50 + corpus[:15]
    assert rows_of(idx.match(*pack([q]), max_positions=8), 8) == [(8, 1, [15])]


# ------------------------------------------------------------------------------ properties
@st.composite
def corpora(draw, max_len: int = 80):
    vocab = draw(st.integers(1, 5))
    sep_p = draw(st.sampled_from([0.0, 0.05, 0.2, 0.5]))
    n = draw(st.integers(0, max_len))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    return [(-1 - rng.randrange(3)) if rng.random() < sep_p else rng.randrange(vocab)
            for _ in range(n)], vocab


def draw_queries(draw, corpus: list[int], vocab: int, B: int) -> list[list[int]]:
    """Query rows: corpus slices (sometimes with a token changed) or random tokens."""
    qs = []
    for _ in range(B):
        kind = draw(st.sampled_from(["slice", "slice", "random"]))
        if kind == "slice" and corpus:
            a = draw(st.integers(0, len(corpus) - 1))
            b = draw(st.integers(a, min(len(corpus), a + 40)))
            q = [t for t in corpus[a:b] if t >= 0][-30:]
            if q and draw(st.booleans()):
                q[draw(st.integers(0, len(q) - 1))] = draw(st.integers(0, vocab))
        else:
            q = draw(st.lists(st.integers(0, vocab), max_size=12))
        qs.append(q)
    return qs


@PROPS
@given(data=st.data(), cv=corpora(),
       max_depth=st.sampled_from([1, 2, 3, 5, 8, 64]),
       tail_tokens=st.sampled_from([1, 3, 16, 256]),
       P=st.sampled_from([0, 1, 3, 8]),
       B=st.integers(1, 5))
def test_match_equals_reference(data, cv, max_depth, tail_tokens, P, B):
    corpus, vocab = cv
    # build in one go or through a random sequence of appends (levels, merges and tail)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(corpus)), max_size=16)))
    idx = SuffixIndex.build(t32(corpus[:cuts[0]] if cuts else corpus), max_depth=max_depth,
                            tail_tokens=tail_tokens)
    for a, b in zip(cuts, cuts[1:] + [len(corpus)]):
        idx.append(t32(corpus[a:b]))
    assert idx.tokens.tolist() == corpus
    queries = draw_queries(data.draw, corpus, vocab, B)
    got = check_against_reference(idx, corpus, queries, max_depth, P)
    event(f"levels={min(idx.arena.num_levels(idx.cid), 3)}")
    event(f"longest match={min(max(g[0] for g in got), 4)}")


# ------------------------------------------------------------------------------ appends
def fresh_vs_incremental(corpus: list[int], chunks: list[int], tail_tokens: int,
                         max_depth: int, queries: list[list[int]], every: int = 1):
    """Appends ``corpus`` in chunks; periodically checks against a fresh build."""
    idx = SuffixIndex.build(torch.empty(0, dtype=torch.int32), max_depth=max_depth,
                            tail_tokens=tail_tokens)
    pos, max_levels, merges, prev = 0, 0, 0, 0
    for i, k in enumerate(chunks):
        idx.append(t32(corpus[pos:pos + k]))
        pos += k
        nl = idx.arena.num_levels(idx.cid)
        merges += nl < prev
        prev, max_levels = nl, max(max_levels, nl)
        assert nl <= math.log2(max(pos, 2)) + 2, f"{nl} levels for {pos} tokens"
        if i % every == every - 1 or pos == len(corpus):
            fresh = SuffixIndex.build(t32(corpus[:pos]), max_depth=max_depth)
            q, lens = pack(queries)
            P = 5
            inc = rows_of(idx.match(q, lens, max_positions=P), P)
            assert inc == rows_of(fresh.match(q, lens, max_positions=P), P), f"after {pos}"
    return idx, max_levels, merges


@pytest.mark.parametrize("tail_tokens", [1, 3, 16])
def test_many_small_appends_equal_fresh_build(tail_tokens):
    corpus = stdlib_tokens(1500)
    rng = random.Random(tail_tokens)
    chunks = [rng.randint(1, 8) for _ in range(len(corpus))]
    # queries: real windows from the text, some perturbed, plus the corpus's own last tokens
    queries = []
    for _ in range(12):
        a = rng.randrange(len(corpus) - 20)
        q = [t for t in corpus[a:a + rng.randint(1, 20)] if t >= 0]
        if q and rng.random() < 0.5:
            q[rng.randrange(len(q))] = rng.randrange(1000)
        queries.append(q)
    queries.append([t for t in corpus[-10:] if t >= 0])
    idx, max_levels, merges = fresh_vs_incremental(corpus, chunks, tail_tokens, 16, queries,
                                                   every=25)
    assert merges > 0, "the append sequence never merged levels"
    assert max_levels >= 2
    check_against_reference(idx, corpus, queries, 16, 8)


def _levels_step_by_step(levels: list[tuple[int, int]], n: int, tail: int, ratio: float
                         ) -> list[tuple[int, int]]:
    """The level ranges after ``n`` tokens, by the rule applied one merge at a time: the
    tail (once it holds ``tail`` positions) becomes a level, then the two newest merge
    while the older is at most ``ratio`` times larger."""
    lo = levels[-1][1] if levels else 0
    if n - lo < tail:
        return levels
    levels = levels + [(lo, n)]
    while len(levels) >= 2 and levels[-2][1] - levels[-2][0] <= \
            ratio * (levels[-1][1] - levels[-1][0]):
        levels[-2:] = [(levels[-2][0], levels[-1][1])]
    return levels


@pytest.mark.parametrize("tail_tokens,ratio", [(1, 2.0), (4, 2.0), (5, 1.0), (3, 3.5)])
def test_a_flush_builds_one_level_over_its_merged_range(tail_tokens, ratio, monkeypatch):
    """Each flush of the tail builds one level, over the range the merges would reach one
    at a time (the levels equal that rule's after every append); matches equal a fresh
    build's."""
    from agspec_gpu import index as index_mod

    builds = []
    build = index_mod.context_array
    monkeypatch.setattr(index_mod, "context_array",
                        lambda seg, lo, hi, d, **kw: builds.append((lo, hi)) or
                        build(seg, lo, hi, d, **kw))
    arena = IndexArena(IndexConfig(max_depth=8, tail_tokens=tail_tokens, merge_ratio=ratio))
    cid = arena.new_corpus()
    corpus = stdlib_tokens(700)
    rng = random.Random(tail_tokens)
    want, pos, flushes = [], 0, 0
    while pos < len(corpus):
        k = rng.choice([1, 1, 2, 3, 9])
        arena.append(cid, t32(corpus[pos:pos + k]))
        pos = min(pos + k, len(corpus))
        after = _levels_step_by_step(want, pos, tail_tokens, ratio)
        flushes += after is not want
        want = after
        got = [(lv.pos_lo, lv.pos_hi) for lv in arena._corpora[cid].levels]
        assert got == want, pos
    assert len(builds) == flushes and any(hi - lo > 2 * tail_tokens for lo, hi in builds)
    queries = [corpus[a:a + 6] for a in range(0, 690, 37)]
    q, lens = pack([[t for t in x if t >= 0] for x in queries])
    fresh = SuffixIndex.build(t32(corpus), max_depth=8)
    got = arena.match(q, lens, [cid] * len(queries), max_positions=5)
    assert rows_of(got, 5) == rows_of(fresh.match(q, lens, max_positions=5), 5)


def test_a_level_build_that_raises_leaves_the_table_on_the_levels_it_kept(monkeypatch):
    """A flush whose build raises (out of memory) after its merge dropped older levels:
    the descriptor table lists only the levels the corpus kept (its tail now reaching back
    over the merged range), matches equal a fresh build's, and the next flush indexes the
    whole range."""
    from agspec_gpu import index as index_mod

    build, calls = index_mod.context_array, []

    def flaky(seg, lo, hi, d, **kw):
        calls.append((lo, hi))
        if len(calls) == 3:  # the third flush merges the first two levels
            raise torch.OutOfMemoryError("a level build (simulated)")
        return build(seg, lo, hi, d, **kw)

    monkeypatch.setattr(index_mod, "context_array", flaky)
    arena = IndexArena(IndexConfig(max_depth=8, tail_tokens=8, merge_ratio=2.0))
    cid = arena.new_corpus()
    corpus = stdlib_tokens(200)
    queries = [corpus[a:a + 5] for a in range(0, 190, 11)]
    q, lens = pack([[t for t in x if t >= 0] for x in queries])
    pos, failed = 0, False
    while pos < len(corpus):
        try:
            arena.append(cid, t32(corpus[pos:pos + 4]))
        except torch.OutOfMemoryError:
            failed = True
            levels = [(lv.sa_base, lv.sa_len) for lv in arena._corpora[cid].levels]
            i64, _, num_levels, _ = arena.descriptor_fields([cid])
            assert num_levels == len(levels) and arena._corpora[cid].tail_start == 0
        pos = min(pos + 4, len(corpus))
        fresh = SuffixIndex.build(t32(corpus[:pos]), max_depth=8)
        got = arena.match(q, lens, [cid] * len(queries), max_positions=4)
        assert rows_of(got, 4) == rows_of(fresh.match(q, lens, max_positions=4), 4), pos
    assert failed and calls[3][0] == 0  # the flush after it took the range from 0


def test_append_one_token_at_a_time_decode_steps():
    """One token per step with a separator now and then (new documents)."""
    rng = random.Random(7)
    corpus = [rng.randrange(4) if rng.random() > 0.05 else -1 for _ in range(300)]
    queries = [[rng.randrange(4) for _ in range(rng.randint(0, 10))] for _ in range(8)]
    fresh_vs_incremental(corpus, [1] * len(corpus), 3, 6, queries, every=10)


def test_append_after_build_then_big_chunk():
    """A built corpus, then a 'file' sized append, then decode steps."""
    corpus = stdlib_tokens(3000)
    idx = SuffixIndex.build(t32(corpus[:2000]), max_depth=64, tail_tokens=16)
    idx.append(t32(corpus[2000:2900]))
    for i in range(2900, 3000, 4):
        idx.append(t32(corpus[i:i + 4]))
    rng = random.Random(3)
    queries = [[t for t in corpus[a:a + 64] if t >= 0]
               for a in (rng.randrange(2900) for _ in range(10))]
    check_against_reference(idx, corpus, queries, 64, 8)


# ------------------------------------------------------------------------------ suffix array
def sa_reference(tokens: list[int], lo: int, hi: int, depth: int) -> list[int]:
    END = -(2**40)
    n = len(tokens)

    def key(p):
        return tuple(tokens[p + i] if p + i < n else END for i in range(depth)), p

    return sorted((p for p in range(lo, hi) if tokens[p] >= 0), key=key)


def context_reference(tokens: list[int], lo: int, hi: int, depth: int) -> list[int]:
    """Continuation positions with a token before and at them, by context read backwards."""
    END = -(2**40)

    def key(c):
        return tuple(tokens[c - 1 - i] if c - 1 - i >= 0 else END for i in range(depth)), -c

    keep = [c for c in range(max(lo, 1), hi) if tokens[c] >= 0 and tokens[c - 1] >= 0]
    return sorted(keep, key=key)


BUILDERS = [(build_suffix_array, sa_reference), (build_context_array, context_reference)]


@pytest.mark.parametrize("build,reference", BUILDERS, ids=["suffix", "context"])
@PROPS
@given(cv=corpora(max_len=80), depth=st.sampled_from([1, 2, 3, 4, 5, 7, 9, 16, 17, 28, 64,
                                                     100]),
       data=st.data())
def test_build_equals_sorted(build, reference, cv, depth, data):
    tokens, _ = cv
    lo = data.draw(st.integers(0, len(tokens)))
    hi = data.draw(st.integers(lo, len(tokens)))
    early_stop = data.draw(st.sampled_from([None, True, False]))  # False: a GPU's rounds
    want = reference(tokens, lo, hi, depth)
    out = build(t32(tokens), lo, hi, depth, early_stop=early_stop)
    assert out.dtype == torch.int32
    assert out.tolist() == want
    if build is build_context_array:  # the size counted on the host from the separators
        seps = [i for i, t in enumerate(tokens) if t < 0]
        num = num_context_positions(seps, lo, hi)
        assert num == len(want)
        out = build(t32(tokens), lo, hi, depth, early_stop=early_stop, num_selected=num)
        assert out.dtype == torch.int32 and out.tolist() == want
        with pytest.raises(ValueError, match="num_selected"):  # a CPU checks the count
            build(t32(tokens), lo, hi, depth, num_selected=num + 1)


def _device_reads(fn) -> int:
    """What ``fn`` reads back from the device: scalar reads and boolean selections (whose
    size the host must know), counted on the CPU by the ops the dispatcher sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense" or name == "nonzero" or (
                    name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                            for i in args[1])):
                reads.append(name)
            return func(*args, **(kwargs or {}))

    with Reads():
        fn()
    return len(reads)


@pytest.mark.parametrize("build,reference", BUILDERS, ids=["suffix", "context"])
def test_build_reads_the_device_once_without_early_stop(build, reference):
    """A session corpus builds a level inside a decode step's commit: on a GPU every read
    back is a wait for the device. Without the early stop (a GPU's default) a build reads
    once, the size of its selection of positions (nine reads per context build before
    session 26: a rank count per round, three selections); with it, once per round more.
    Separators in the text, and real tokens' repeats, as a session's tail holds them."""
    toks = stdlib_tokens(1100)
    toks[::37] = [-1] * len(toks[::37])
    for lo, hi in ((0, 1024), (70, 1100)):
        want = reference(toks, lo, hi, 33)
        for early_stop, reads in ((False, 1), (True, None)):
            out = []
            n = _device_reads(lambda: out.append(build(t32(toks), lo, hi, 33,
                                                       early_stop=early_stop)))
            assert out[0].tolist() == want
            if reads is not None:
                assert n == reads, (early_stop, n)
            else:  # a read per round: more than one
                assert n > 1, n


def test_context_build_with_its_size_reads_nothing():
    """With its selection's size counted on the host (``num_selected``: the arena records
    its corpora's separators), a GPU's build (no early stop) reads nothing back: a level
    built inside a decode step's commit does not wait for the device. Checked on the meta
    device, where every op whose output size depends on the data (a boolean selection,
    ``nonzero``) or a scalar read raises; on the CPU the dispatcher sees one read, the
    CPU's own check of the count (free there)."""
    toks = stdlib_tokens(1100)
    toks[::37] = [-1] * len(toks[::37])
    seps = [i for i, t in enumerate(toks) if t < 0]
    for lo, hi in ((0, 1024), (70, 1100), (1099, 1100)):
        num = num_context_positions(seps, lo, hi)
        out = []
        assert _device_reads(lambda: out.append(build_context_array(
            t32(toks), lo, hi, 33, early_stop=False, num_selected=num))) == 1
        assert out[0].tolist() == context_reference(toks, lo, hi, 33)
        meta = torch.empty(len(toks), dtype=torch.int32, device="meta")
        assert build_context_array(meta, lo, hi, 33, early_stop=False,
                                   num_selected=num).shape == (num,)
    with pytest.raises(NotImplementedError):  # the meta device does see a selection
        build_context_array(meta, 0, 1024, 33, early_stop=False)


@pytest.mark.parametrize("seps, lo, hi", [
    ([], 0, 0), ([], 0, 5), ([0], 0, 5), ([4], 0, 5), ([2, 3], 0, 8), ([0, 1, 2], 1, 3),
    ([5], 5, 6), ([5], 6, 9), ([9], 3, 9), ([1, 3, 5, 7], 0, 9), ([3], 4, 4)])
def test_num_context_positions(seps, lo, hi):
    """The positions ``c`` of ``[max(lo, 1), hi)`` with neither ``c`` nor ``c - 1`` a
    separator, against a text that has its separators exactly there."""
    toks = [-1 if i in seps else 7 for i in range(10)]
    want = [c for c in range(max(lo, 1), hi) if toks[c] >= 0 and toks[c - 1] >= 0]
    assert num_context_positions(seps, lo, hi) == len(want)


@pytest.mark.parametrize("depth", [33, 64])
def test_context_build_launches_few_ops(depth):
    """A session's 1,024-token level build on a GPU (no early stop: every round, three for
    depth 33 or 64 with four ranks a key) is this many launches, each a few microseconds of
    the host's time inside a decode step's commit, and four sorts: 76 and seven sorts for
    depth 33 in session 26 (rank pairs: six rounds), 95 before it packed a round's key in
    one op and ranked a sorted key in four. With its size given (the arena's builds since
    session 37: a scatter instead of a boolean selection, no read), four more on a GPU; a
    CPU counts two more still, its check of the size."""
    from op_count import CountOps

    toks = t32(stdlib_tokens(1100))
    for num_selected, most in ((None, 55), (1023, 61)):
        count = CountOps()
        with count.mode:
            build_context_array(toks, 0, 1024, depth, early_stop=False,
                                num_selected=num_selected)
        assert len(count.ops) <= most and count.ops.count("sort") == 4, count.ops


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("build,reference", BUILDERS, ids=["suffix", "context"])
def test_build_with_fewer_ranks_a_key(build, reference, k, monkeypatch):
    """Texts too long for four ranks in an int64 key (over 55,107 positions) pack three or
    two a round: forced here on small texts, every depth's blocks overlap as they must."""
    import agspec_gpu.kernels.suffix_array as sa_mod

    monkeypatch.setattr(sa_mod, "_ranks_per_key", lambda m: k)
    toks = stdlib_tokens(700)
    toks[::29] = [-1] * len(toks[::29])
    for depth in (1, 2, 3, 5, 8, 9, 10, 27, 28, 37, 64, 65):
        for early_stop in (False, True):
            got = build(t32(toks), 3, 650, depth, early_stop=early_stop)
            assert got.tolist() == reference(toks, 3, 650, depth), (depth, early_stop)


def test_ranks_per_key_fit_in_int64():
    from agspec_gpu.kernels.suffix_array import _ranks_per_key

    for m, k in ((1, 4), (55_107, 4), (55_108, 3), (2_097_150, 3), (2_097_151, 2)):
        assert _ranks_per_key(m) == k, m
        assert (m + 1) ** k < 1 << 63


@pytest.mark.parametrize("build,reference", BUILDERS, ids=["suffix", "context"])
def test_build_real_tokens(build, reference):
    toks = stdlib_tokens(2000)
    for lo, hi, depth in ((0, 2000, 65), (500, 1300, 9), (0, 2000, 1)):
        assert build(t32(toks), lo, hi, depth).tolist() == reference(toks, lo, hi, depth)


def test_build_suffix_array_fixed():
    toks = [2, 1, 2, 1, -1, 2, 1, 0]
    assert build_suffix_array(t32(toks), 0, 8, 8).tolist() == sa_reference(toks, 0, 8, 8)
    # 0 | 1 -1 < 1 0 < 1 2 | 2 1 -1 < 2 1 0 < 2 1 2: separators sort below tokens
    assert build_suffix_array(t32(toks), 0, 8, 8).tolist() == [7, 3, 6, 1, 2, 5, 0]
    # depth 1: ties stay in position order
    assert build_suffix_array(t32(toks), 0, 8, 1).tolist() == [7, 1, 3, 6, 0, 2, 5]
    assert build_suffix_array(t32(toks), 3, 3, 4).tolist() == []
    assert build_suffix_array(t32([]), 0, 0, 4).tolist() == []
    with pytest.raises(ValueError):
        build_suffix_array(t32(toks), 5, 3, 4)
    with pytest.raises(ValueError):
        build_suffix_array(t32(toks), 0, 9, 4)
    with pytest.raises(ValueError):
        build_suffix_array(t32(toks), 0, 8, 0)
    for args, name in (((t32(toks), True, 3, 2), "lo"), ((t32(toks), 0, 8.0, 2), "hi"),
                       ((t32(toks), 0, 8, 2.5), "depth"), ((t32(toks).view(2, 4), 0, 1, 2),
                                                            "tokens must be 1-D")):
        for build in (build_suffix_array, build_context_array):
            with pytest.raises(ValueError, match=name):
                build(*args)


def test_build_context_array_fixed():
    toks = [2, 1, 2, 1, -1, 2, 1, 0]
    # contexts backwards: 2 (1 2 END) < 7 (1 2 -1 ...) < 1 (2 END) < 6 (2 -1 ...) < 3 (2 1 2);
    # END sorts below separators below tokens; 5 follows a separator, 4 is one
    assert build_context_array(t32(toks), 0, 8, 8).tolist() == [2, 7, 1, 6, 3]
    # depth 1: 1 1 | 2 2 2, ties in descending position
    assert build_context_array(t32(toks), 0, 8, 1).tolist() == [7, 2, 6, 3, 1]
    assert build_context_array(t32(toks), 3, 7, 2).tolist() == [6, 3]
    assert build_context_array(t32(toks), 0, 1, 4).tolist() == []
    assert build_context_array(t32([]), 0, 0, 4).tolist() == []
    for lo, hi, depth in ((5, 3, 4), (0, 9, 4), (0, 8, 0)):
        with pytest.raises(ValueError):
            build_context_array(t32(toks), lo, hi, depth)


# ------------------------------------------------------------------------------ validation
def test_invalid_inputs_raise_value_error_naming_the_argument():
    good = t32([1, 2, 3, -1, 1, 2])
    with pytest.raises(ValueError, match="tokens"):
        SuffixIndex.build(good.to(torch.int64))
    with pytest.raises(ValueError, match="tokens"):
        SuffixIndex.build(good.reshape(2, 3))
    with pytest.raises(ValueError, match="tokens"):
        SuffixIndex.build([1, 2, 3])  # type: ignore[arg-type]
    idx = SuffixIndex.build(good, max_depth=64)
    with pytest.raises(ValueError, match="tokens"):
        idx.append(t32([1, 2]).to(torch.int64))
    with pytest.raises(ValueError, match="tokens"):
        idx.append(t32([1, 2, 3, 4]).reshape(2, 2))
    q, lens = pack([[1, 2], [2]])
    with pytest.raises(ValueError, match="queries"):
        idx.match(q.to(torch.int64), lens)
    with pytest.raises(ValueError, match="queries"):
        idx.match(q[0], lens)
    with pytest.raises(ValueError, match="queries"):
        idx.match(torch.tensor([[1, -1]], dtype=torch.int32), t32([2]))
    with pytest.raises(ValueError, match="lengths"):
        idx.match(q, t32([3, 1]))                  # longer than L = 2
    with pytest.raises(ValueError, match="lengths"):
        idx.match(q, t32([-1, 1]))
    with pytest.raises(ValueError, match="lengths"):
        idx.match(q, lens.to(torch.int64))
    with pytest.raises(ValueError, match="lengths"):
        idx.match(q, t32([2]))                     # wrong number of rows
    with pytest.raises(ValueError, match="max_positions"):
        idx.match(q, lens, max_positions=-1)
    # negative tokens in the unused (left-padding) part are fine
    m = idx.match(torch.tensor([[-5, 1]], dtype=torch.int32), t32([1]), max_positions=2)
    assert rows_of(m, 2) == [(1, 2, [5, 1])]
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex.build(good, max_depth=0)
    for bad in (0, 10 ** 8):  # (the CPU match path reads rows x tail_tokens each step)
        with pytest.raises(ValueError, match="tail_tokens"):
            IndexConfig(tail_tokens=bad)


# ------------------------------------------------------------------------------ arena
def test_arena_corpora_are_isolated_and_batched():
    arena = IndexArena(IndexConfig(max_depth=8, tail_tokens=3), initial_tokens=16)
    rng = random.Random(11)
    docs = {}
    for _ in range(3):
        cid = arena.new_corpus(capacity=16)
        docs[cid] = []
    # interleaved appends force relocation of corpora and growth of the shared buffers
    bases = set()
    for step in range(120):
        cid = rng.choice(list(docs))
        chunk = [rng.randrange(3) + 10 * cid if rng.random() > 0.1 else -1
                 for _ in range(rng.randint(1, 6))]
        arena.append(cid, t32(chunk))
        docs[cid] += chunk
        bases.add(arena.tokens.data_ptr())
    assert len(bases) > 1, "the arena never relocated its token buffer"
    for cid, toks in docs.items():
        assert arena.corpus_tokens(cid).tolist() == toks
    # the same query against every corpus: matches only its own tokens (disjoint alphabets)
    queries, cids = [], []
    for cid, toks in docs.items():
        own = [t for t in toks[-12:] if t >= 0][-5:]
        for other in docs:
            queries.append(own)
            cids.append(other)
    q, lens = pack(queries)
    got = rows_of(arena.match(q, lens, cids, max_positions=4), 4)
    for (qr, cid), g in zip(zip(queries, cids), got):
        assert g == match_reference(docs[cid], qr, 8, 4)
        if qr and qr[-1] // 10 != cid:
            assert g == (0, 0, [])


def test_append_rows_equals_one_append_per_row():
    """The batched commit append: same tokens, sources, levels and matches as appending
    each row on its own, through relocations, level builds, zero counts and separators
    (appended on their own: the rows are token ids, a model's output)."""
    cfg = IndexConfig(max_depth=8, tail_tokens=5)
    one, rows = IndexArena(cfg, initial_tokens=16), IndexArena(cfg, initial_tokens=16)
    rng = random.Random(5)
    cids = [one.new_corpus(capacity=4) for _ in range(4)]
    assert [rows.new_corpus(capacity=4) for _ in range(4)] == cids
    for step in range(60):
        batch = rng.sample(cids, rng.randint(1, 4))
        M = rng.randint(1, 6)
        toks = [[rng.randrange(4) for _ in range(M)] for _ in batch]
        counts = [rng.randint(0, M) for _ in batch]
        src = step % 3
        if rng.random() < 0.2:  # a document boundary
            for x in (one, rows):
                x.append(batch[0], t32([-1]), src)
        for cid, t, m in zip(batch, toks, counts):
            one.append(cid, t32(t[:m]), src)
        rows.append_rows(batch, t32(sum(toks, [])).view(len(batch), M), counts, src)
    for cid in cids:
        assert rows.corpus_tokens(cid).tolist() == one.corpus_tokens(cid).tolist()
        assert rows.num_levels(cid) == one.num_levels(cid)
        a, b = (x.src[x._corpora[cid].tok_base:][:x._corpora[cid].n] for x in (one, rows))
        assert torch.equal(a, b)
    q, lens = pack([[1, 2], [3], [0, 1, 2, 3]] * 4)
    ids = [c for c in cids for _ in range(3)]
    assert rows_of(rows.match(q, lens, ids, max_positions=4), 4) == \
        rows_of(one.match(q, lens, ids, max_positions=4), 4)
    with pytest.raises(ValueError, match="at most once"):
        rows.append_rows([cids[0], cids[0]], t32([1, 2]).view(2, 1), [1, 1])
    rows.append_rows([cids[0]], t32([1, -1]).view(1, 2), [1])  # past its count: padding
    with pytest.raises(ValueError, match="num_selected"):  # not ids: on a CPU the level
        rows.append_rows([cids[0]], t32([-1, 2, 3, 4, 5]).view(1, 5), [5])  # build says so
    with pytest.raises(ValueError, match="counts"):
        rows.append_rows([cids[0]], t32([1, 2]).view(1, 2), [3])
    for bad in (1.0, True):  # a host length must stay an int (a float broke compaction)
        with pytest.raises(ValueError, match="counts: each an int"):
            rows.append_rows([cids[0]], t32([1, 2]).view(1, 2), [bad])
    with pytest.raises(ValueError, match="tokens"):
        rows.append_rows([cids[0]], t32([1, 2]), [1])


def test_deferred_append_rows_equals_append_per_row():
    """append_rows with device counts (a commit queued before the loop reads them): the
    tokens written at once, lengths and level builds when it settles, whether by the
    counts the caller passes, by a read back (settle() with none), or by the next call
    that needs them (another append, a new corpus, a length, a match): the same corpora,
    levels and matches as appending each row on its own."""
    cfg = IndexConfig(max_depth=8, tail_tokens=5)
    one, rows = IndexArena(cfg, initial_tokens=16), IndexArena(cfg, initial_tokens=16)
    rng = random.Random(7)
    cids = [one.new_corpus(capacity=4) for _ in range(4)]
    assert [rows.new_corpus(capacity=4) for _ in range(4)] == cids
    tickets = []
    for step in range(60):
        batch = rng.sample(cids, rng.randint(1, 4))
        M = rng.randint(1, 6)
        toks = [[rng.randrange(4) for _ in range(M)] for _ in batch]
        counts = [rng.randint(0, M) for _ in batch]
        for cid, t, m in zip(batch, toks, counts):
            one.append(cid, t32(t[:m]), 1)
        dev_counts = torch.tensor(counts, dtype=torch.int32 if step % 2 else torch.int64)
        rows.append_rows(batch, t32(sum(toks, [])).view(len(batch), M), dev_counts, 1)
        dev_counts.fill_(0)  # the caller's buffer, reused: the arena copied it
        tickets.append(rows.unsettled)
        how = step % 5
        if how == 0:
            rows.settle(counts)
        elif how == 1:
            rows.settle()  # read back
        elif how == 2:
            assert rows.num_tokens(batch[0]) == one.num_tokens(batch[0])
        elif how == 3 and step < 30:  # (the next step's append settles the others)
            cid = one.new_corpus(capacity=4)
            assert rows.new_corpus(capacity=4) == cid
            cids.append(cid)
        assert rows.unsettled is None or how >= 3
    rows.settle()
    assert rows.unsettled is None and tickets == list(range(1, 61))
    for cid in cids:
        assert rows.corpus_tokens(cid).tolist() == one.corpus_tokens(cid).tolist()
        assert rows.num_levels(cid) == one.num_levels(cid)
    q, lens = pack([[1, 2], [3], [0, 1, 2, 3]] * len(cids))
    ids = [c for c in cids for _ in range(3)]
    rows.append_rows(cids[:1], t32([1, 2]).view(1, 2), torch.tensor([2]))
    one.append(cids[0], t32([1, 2]))
    assert rows_of(rows.match(q, lens, ids, max_positions=4), 4) == \
        rows_of(one.match(q, lens, ids, max_positions=4), 4)  # (the match settled first)
    assert rows.unsettled is None
    for bad, msg in ((torch.tensor([1.0]), "int32/int64"), (torch.tensor([[1]]), r"\[1\]"),
                     (torch.tensor([1], device="meta"), "tensor on cpu")):
        with pytest.raises(ValueError, match=msg):
            rows.append_rows(cids[:1], t32([1, 2]).view(1, 2), bad)
    rows.append_rows(cids[:1], t32([1, 2]).view(1, 2), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"counts: expected 1 counts in \[0, 2\]"):
        rows.settle([3])
    rows.settle([1])
    assert rows.num_tokens(cids[0]) == one.num_tokens(cids[0]) + 1


def test_arena_free_releases_memory_and_keeps_others():
    arena = IndexArena(IndexConfig(max_depth=16, tail_tokens=16))
    toks = stdlib_tokens(6000)
    a, b, c = arena.new_corpus(), arena.new_corpus(), arena.new_corpus()
    arena.append(a, t32(toks[:3000]))
    arena.append(b, t32(toks[3000:]))
    arena.append(c, t32(toks[1000:2000]))
    q, lens = pack([toks[2500:2510], toks[4000:4010], toks[1500:1520]])
    before = rows_of(arena.match(q, lens, [a, b, c], max_positions=8), 8)
    total = arena.nbytes()
    per_b = arena.nbytes(b)
    arena.free(b)
    assert b not in arena and a in arena
    assert arena.nbytes() < total
    assert arena.nbytes() <= 2 * (arena.nbytes(a) + arena.nbytes(c)) + 256
    assert per_b >= 4 * 3000
    with pytest.raises(KeyError):
        arena.match(q, lens, [a, b, c])
    with pytest.raises(KeyError):
        arena.append(b, t32([1]))
    with pytest.raises(KeyError):
        arena.num_tokens(b)
    with pytest.raises(KeyError):
        arena.free(b)
    after = rows_of(arena.match(q[[0, 2]], lens[[0, 2]], [a, c], max_positions=8), 8)
    assert after == [before[0], before[2]]
    # a new corpus after a free works and sees only its own tokens
    d = arena.new_corpus()
    arena.append(d, t32([1, 2, 3]))
    assert rows_of(arena.match(*pack([toks[2500:2510]]), [d], max_positions=8), 8) == \
        [(0, 0, [])]


def assert_keys_in_step(arena: IndexArena) -> None:
    """The torch path's search keys: non-decreasing over the whole buffer (one
    ``searchsorted`` serves every level) and each live level's are its entries' keys."""
    from agspec_gpu.kernels.suffix_match import prefix_keys

    keys = arena.sa_key
    assert keys.shape == arena.sa.shape
    assert bool((keys[1:] >= keys[:-1]).all())
    seqs = []
    for c in arena._corpora.values():
        for lv in c.levels:
            got = keys[lv.sa_base:lv.sa_base + lv.sa_len]
            assert torch.equal(got, prefix_keys(arena.tokens, c.tok_base,
                                                arena.sa[lv.sa_base:lv.sa_base + lv.sa_len],
                                                lv.seq))
            seqs.append(lv.seq)
    assert len(set(seqs)) == len(seqs)


def test_free_zeroes_the_text_and_compaction_in_place_keeps_the_others():
    """Freeing one corpus among several live ones leaves the buffers as they are (no new
    buffers) but erases its text at once; later appends compact in place (holes closed,
    oldest first), and every other corpus matches what a brute force finds."""
    arena = IndexArena(IndexConfig(max_depth=16, tail_tokens=16))
    toks = stdlib_tokens(5000)
    parts = {arena.new_corpus(): toks[i * 1000:(i + 1) * 1000] for i in range(4)}
    secret = arena.new_corpus()
    arena.append(secret, t32(range(200_000, 200_400)))  # ids no other corpus holds
    for cid, part in parts.items():
        arena.append(cid, t32(part))
    arena._compact(shrink=True)  # buffers of 1.5x the live data
    ptr = arena.tokens.data_ptr()
    levels = [(lv.sa_base, lv.sa_len, lv.seq << KEY_SEQ_SHIFT)
              for lv in arena._corpora[secret].levels]
    keys = {int(k) for b, n, _ in levels for k in arena.sa_key[b:b + n]}
    arena.free(secret)
    assert arena.tokens.data_ptr() == ptr  # no shrink: the others hold most of the data
    assert int((arena.tokens >= 200_000).sum()) == 0 and secret not in arena
    # nor do its suffix array and (CPU) search keys, which held two tokens of each
    # position until a compaction (a helper read 690 token pairs back after a close)
    assert levels and all(int(arena.sa[b:b + n].abs().sum()) == 0 and
                          bool((arena.sa_key[b:b + n] == low).all()) for b, n, low in levels)
    assert not (keys - {low for _, _, low in levels}) & set(arena.sa_key.tolist())
    assert_keys_in_step(arena)
    rng = random.Random(2)
    extra = toks[4000:5000]
    for i, cid in enumerate(parts):  # grow every corpus: relocations leave holes, and
        for k in range(0, 1000, 50):  # allocations at the buffer's end compact in place
            arena.append(cid, t32(extra[k:k + 50]))
            parts[cid] = parts[cid] + extra[k:k + 50]
        if i == 1:
            arena.free(cid)
    del parts[list(parts)[1]]
    for cid, part in parts.items():
        queries = [part[a:a + 12] for a in (rng.randrange(len(part) - 12) for _ in range(6))]
        queries = [[t for t in qr if t >= 0] for qr in queries]
        q, lens = pack(queries)
        got = rows_of(arena.match(q, lens, [cid] * len(queries), max_positions=8), 8)
        for row, query in zip(got, queries):
            assert row == match_reference(part, query, 16, 8)
    live = sum(arena.nbytes(c) for c in parts)
    assert arena.nbytes() <= 4 * live  # bounded by the live data
    assert_keys_in_step(arena)


def test_level_numbers_restart_before_they_overflow_the_keys():
    """Sequence numbers sit in the keys' top bits: at the limit the next level renumbers
    every level (0, 1, ... in buffer order) first; matches are unchanged."""
    from agspec_gpu import index as index_mod

    arena = IndexArena(IndexConfig(max_depth=16, tail_tokens=16))
    toks = stdlib_tokens(600)
    a, b = arena.new_corpus(), arena.new_corpus()
    arena.append(a, t32(toks[:300]))
    q, lens = pack([toks[100:110], toks[400:410]])
    arena._next_seq = index_mod._MAX_SEQ
    arena.append(b, t32(toks[300:]))
    assert arena._next_seq < 64
    assert_keys_in_step(arena)
    got = rows_of(arena.match(q, lens, [a, b], max_positions=8), 8)
    assert got == [match_reference(toks[:300], toks[100:110], 16, 8),
                   match_reference(toks[300:], toks[400:410], 16, 8)]


@pytest.mark.parametrize("base_id", [0, (1 << 20) - 4, 5_000_000])
def test_search_hints_are_exact_for_any_token_ids(base_id):
    """The torch path's search hints pack two key tokens in 20 bits each: ids from 2^20 - 2
    up share one code, where the hints only bound the searches. Small alphabets (long
    repeats, many levels, merges) at both sides of that limit: the hinted path equals the
    unhinted one and the brute force, ranges included."""
    from agspec_gpu.kernels.suffix_match import suffix_match

    rng = random.Random(base_id)
    arena = IndexArena(IndexConfig(max_depth=12, tail_tokens=8))
    corpora = {}
    for _ in range(3):
        cid = arena.new_corpus()
        toks = [base_id + rng.randrange(5) if rng.random() > 0.05 else -1 for _ in range(400)]
        for k in range(0, 400, 37):
            arena.append(cid, t32(toks[k:k + 37]))
        corpora[cid] = toks
    queries, ids = [], []
    for cid, toks in corpora.items():
        for _ in range(6):
            a = rng.randrange(350)
            qr = [t for t in toks[a:a + rng.randrange(1, 14)] if t >= 0] or [base_id]
            queries.append(qr)
            ids.append(cid)
    q, lens = pack(queries, 14)
    desc = arena.descriptors(ids)
    args = (arena.tokens, arena.sa, desc, q, lens)
    kw = {"max_depth": 12, "max_positions": 8, "use_triton": False}
    hinted = suffix_match(*args, **kw, sa_key=arena.sa_key)
    plain = suffix_match(*args, **kw)
    for f in ("length", "count", "positions", "sa_lo", "sa_hi"):
        assert torch.equal(getattr(hinted, f), getattr(plain, f)), f
    for row, qr, cid in zip(rows_of(hinted, 8), queries, ids):
        assert row == match_reference(corpora[cid], qr, 12, 8)
    assert_keys_in_step(arena)


@pytest.mark.parametrize("seed", range(6))
def test_descriptor_table_follows_every_change_of_the_corpora(seed):
    """``descriptors`` gathers from the arena's descriptor table: after every operation of a
    random run (new and prebuilt corpora, appends one by one and in rows, levels built and
    merged, relocations on growth, compactions in place and shrinking, level renumbering,
    frees) it equals the fields read from the corpora themselves, for every live corpus,
    repeated and in any order; a freed id raises KeyError naming it."""
    rng = random.Random(seed)
    arena = IndexArena(IndexConfig(max_depth=8, tail_tokens=rng.choice([4, 16])),
                       initial_tokens=64)
    live: list[int] = []

    def check(where):
        ids = [rng.choice(live) for _ in range(rng.randrange(0, 12))] + live if live else []
        rng.shuffle(ids)
        d = arena.descriptors(ids)
        i64, i32, max_levels, max_tail = descriptors_reference(arena, ids)
        R = len(ids)
        K = len(i64) - R >> 1
        got64 = torch.cat([d.tok_base, d.level_sa_base, d.level_key]).tolist()
        got32 = torch.cat([d.num_tokens, d.tail_start, d.level_indptr,
                           d.level_sa_len]).tolist()
        assert (got64, got32, d.max_levels, d.max_tail) == (i64, i32, max_levels, max_tail), \
            where
        assert d.level_sa_base.numel() == K

    for step in range(120):
        op = rng.random()
        if op < 0.15 or not live:
            live.append(arena.new_corpus(rng.choice([16, 40, 200])))
        elif op < 0.2:
            toks = t32([rng.randrange(20) for _ in range(rng.randrange(1, 60))])
            end = rng.randrange(toks.numel() + 1)
            live.append(arena.add_prebuilt(toks, build_context_array(toks, 0, end, 8), end))
        elif op < 0.45:
            arena.append(rng.choice(live), t32([rng.randrange(-1, 20)
                                                for _ in range(rng.randrange(0, 40))]))
        elif op < 0.75:
            cids = rng.sample(live, rng.randrange(1, len(live) + 1))
            M = rng.randrange(1, 9)
            arena.append_rows(cids, t32([rng.randrange(20) for _ in range(len(cids) * M)])
                              .view(len(cids), M), [rng.randrange(M + 1) for _ in cids])
        elif op < 0.8 and len(live) > 1:
            gone = live.pop(rng.randrange(len(live)))
            arena.free(gone)
            with pytest.raises(KeyError, match=f"corpus id {gone} is unknown or freed"):
                arena.descriptors(live[:1] + [gone])
        elif op < 0.85:
            arena._compact(renumber=rng.random() < 0.5)
        check((seed, step, op))
    assert max(arena.num_levels(c) for c in live) >= 2  # levels were built, and merged


def test_relocation_on_growth_keeps_results():
    toks = stdlib_tokens(4000)
    idx = SuffixIndex(IndexConfig(max_depth=32, tail_tokens=64), capacity=16)
    rng = random.Random(5)
    queries = [toks[a:a + 32] for a in (rng.randrange(3900) for _ in range(8))]
    queries = [[t for t in qr if t >= 0] for qr in queries]
    ptrs = set()
    pos = 0
    while pos < len(toks):
        k = rng.choice([1, 7, 300])
        idx.append(t32(toks[pos:pos + k]))
        pos += k
        ptrs.add(idx.arena.tokens.data_ptr())
    assert len(ptrs) > 2
    assert_keys_in_step(idx.arena)
    check_against_reference(idx, toks, queries, 32, 8)
    fresh = SuffixIndex.build(t32(toks), max_depth=32)
    q, lens = pack(queries)
    assert rows_of(idx.match(q, lens), 8) == rows_of(fresh.match(q, lens), 8)


def test_nbytes_per_token_100k():
    toks = stdlib_tokens(100_000)
    idx = SuffixIndex.build(t32(toks), max_depth=64)
    assert idx.num_tokens == 100_000
    assert idx.nbytes / 100_000 <= 16
    assert idx.arena.nbytes() / 100_000 <= 16
    # grown by appends (capacity doubling): the corpus's own footprint stays bounded too
    inc = SuffixIndex.build(t32(toks[:1000]), max_depth=64)
    for i in range(1000, 100_000, 9_900):
        inc.append(t32(toks[i:i + 9_900]))
    assert inc.num_tokens == 100_000
    assert inc.nbytes / 100_000 <= 16


# ------------------------------------------------------------------------------ baseline
def test_unfold_baseline_equals_reference():
    """bench/match_baselines.py is exact too (the benchmarks compare against it)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "match_baselines.py"
    spec = importlib.util.spec_from_file_location("match_baselines", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = random.Random(2)
    for corpus, max_depth, query, P, want in GOLDEN:
        q, lens = pack([query], L=len(query) + 2)
        m = mod.unfold_match(t32(corpus), q, lens, max_depth=max_depth, max_positions=P)
        assert rows_of(m, P) == [want]
    corpus = stdlib_tokens(3000)
    queries = []
    for _ in range(16):
        a = rng.randrange(2900)
        qr = [t for t in corpus[a:a + 40] if t >= 0]
        if qr:
            qr[rng.randrange(len(qr))] = rng.randrange(5000)
        queries.append(qr)
    q, lens = pack(queries)
    m = mod.unfold_match(t32(corpus), q, lens, max_depth=16, max_positions=8, chunk_elems=4096)
    assert rows_of(m, 8) == [match_reference(corpus, qr, 16, 8) for qr in queries]


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_index_equals_cpu_and_reference():
    """Built, appended and matched on the GPU (Triton path): same results as on the CPU."""
    toks = stdlib_tokens(20_000)
    rng = random.Random(9)
    queries = []
    for _ in range(33):
        a = rng.randrange(19_900)
        qr = [t for t in toks[a:a + 80] if t >= 0]
        if qr and rng.random() < 0.7:
            qr[rng.randrange(len(qr))] = rng.randrange(5000)
        queries.append(qr)
    queries += [[], [toks[0]]]
    q, lens = pack(queries)
    cpu = SuffixIndex.build(t32(toks), max_depth=64)
    gpu = SuffixIndex.build(t32(toks[:15_000]).cuda(), max_depth=64, tail_tokens=64)
    for i in range(15_000, 20_000, 250):
        gpu.append(t32(toks[i:i + 250]).cuda())
    assert gpu.tokens.is_cuda and gpu.tokens.tolist() == toks
    want = rows_of(cpu.match(q, lens), 8)
    assert rows_of(gpu.match(q.cuda(), lens.cuda()), 8) == want
    assert want == [match_reference(toks, qr, 64, 8) for qr in queries]
    for corpus, max_depth, query, P, expected in GOLDEN:
        idx = SuffixIndex.build(t32(corpus).cuda(), max_depth=max_depth)
        qq, ll = pack([query], L=len(query) + 1)
        assert rows_of(idx.match(qq.cuda(), ll.cuda(), max_positions=P), P) == [expected]
    with pytest.raises(ValueError, match="queries"):
        gpu.match(q, lens.cuda())  # queries on the CPU, index on the GPU
    with pytest.raises(ValueError, match="tokens"):
        gpu.append(t32([1, 2]))


def test_a_corpus_past_int32_positions_is_refused_before_it_changes(monkeypatch):
    """Positions, lengths and suffix-array entries of a corpus are int32: a corpus that
    would pass 2**31 - 1 tokens is refused, naming ``tokens``, by every way in (the limit
    lowered here: the real one takes 8 GB of tokens), and the corpus is left as it was."""
    import agspec_gpu.index as index

    monkeypatch.setattr(index, "MAX_CORPUS_TOKENS", 40)
    ar = index.IndexArena(index.IndexConfig(max_depth=8, tail_tokens=16))
    cid = ar.new_corpus()
    ar.append(cid, torch.arange(30, dtype=torch.int32))
    for call in (lambda: ar.append(cid, torch.arange(11, dtype=torch.int32)),
                 lambda: ar.append_rows([cid], torch.zeros(1, 11, dtype=torch.int32), [11]),
                 lambda: ar.add_prebuilt(torch.arange(41, dtype=torch.int32),
                                         torch.zeros(0, dtype=torch.int32), 0)):
        with pytest.raises(ValueError, match="tokens: .* past 40"):
            call()
    assert ar.num_tokens(cid) == 30 and ar.corpus_tokens(cid).tolist() == list(range(30))
    ar.append_rows([cid], torch.zeros(1, 11, dtype=torch.int32), [10])  # up to the limit
    assert ar.num_tokens(cid) == 40
