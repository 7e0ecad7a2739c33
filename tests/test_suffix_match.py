"""Triton kernel ``_suffix_match_kernel`` vs ``suffix_match_torch``: identical results.

Corpora are built through :class:`IndexArena` (several corpora in one arena, appended in chunks
so that small ``tail_tokens`` force many levels and merges, 0..5 levels, non-empty tails), and
every field of :class:`MatchResult` is compared exactly, -1 padding and the ``sa_lo/sa_hi`` of
unused level slots included. Without a GPU the kernel runs under ``TRITON_INTERPRET=1``
(``conftest.py``), so the sizes stay small. ``test_compiles_for_sm90`` runs ``triton.compile``
for sm_90 (``kernel_compile.py``: a child process without the interpreter).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch

from agspec_gpu.index import IndexArena, IndexConfig
from agspec_gpu.kernels.suffix_match import MatchDescriptors, MatchResult, suffix_match
from agspec_gpu.kernels.suffix_match_triton import LAUNCH_OPTIONS, _suffix_match_kernel, block_sizes
from agspec_gpu.tokenizer import load_tokenizer
from index_reference import match_reference
from kernel_compile import compile_all_for_sm90

# the arenas live on the GPU when there is one: there the kernel runs compiled, not interpreted
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAD = -7  # left padding of query rows: negative, so a kernel reading it would be caught
FIELDS = ("length", "count", "positions", "sa_lo", "sa_hi")


# ------------------------------------------------------------------------------ corpora
def t32(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int32)


@lru_cache(maxsize=None)
def corpora() -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """Name -> (tokens, append chunk sizes, cycled). All under 300 tokens."""
    g = torch.Generator().manual_seed(0)

    def rnd(n: int, vocab: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32)

    out = {
        "empty": (t32([]), (1,)),
        "one": (t32([5]), (1,)),
        "repeat": (torch.full((90,), 3, dtype=torch.int32), (7, 1, 12)),
        # chunks shrinking by 3x keep the levels from merging: up to 5 levels
        "levels5": (torch.arange(232, dtype=torch.int32) * 7 % 5, (160, 50, 16, 5, 1)),
        "sep_last": (t32([1, 2, 1, 2, 3, -1, 1, 2, -1]), (9,)),  # tail empty once indexed
    }
    # a level of separators only (empty suffix array) that does not merge into the one before
    out["sep_level"] = (torch.cat([rnd(19, 3), t32([-1, -1, -1, -1]), rnd(8, 3)]), (20, 1, 2, 8))
    for p in (2, 3, 7):
        out[f"period{p}"] = (torch.arange(120, dtype=torch.int32) % p, (5, 11, 2))
    docs: list[int] = []
    for _ in range(25):
        docs += rnd(int(torch.randint(0, 5, (1,), generator=g)), 3).tolist() + [-1]
    out["tiny_docs"] = (t32(docs), (3, 8))
    x = rnd(100, 3)
    x[torch.randint(0, 100, (30,), generator=g)] = -1
    x[40:44] = -2  # empty documents: consecutive separators
    out["empty_docs"] = (x, (4, 9, 1))
    x = rnd(80, 2)
    x[1::2] = -1
    out["alt_sep"] = (x, (6,))
    x = rnd(250, 4)
    x[::37] = -1
    out["random"] = (x, (10, 3, 25))
    return out


@lru_cache(maxsize=None)
def arena(max_depth: int, tail_tokens: int) -> tuple[IndexArena, dict[str, int]]:
    """Every corpus of :func:`corpora` in one arena, appended chunk by chunk."""
    ar = IndexArena(IndexConfig(max_depth=max_depth, tail_tokens=tail_tokens), DEV,
                    initial_tokens=64)
    ids = {}
    for name, (tokens, chunks) in corpora().items():
        cid = ids[name] = ar.new_corpus(16)
        i = j = 0
        while i < tokens.numel():
            k = chunks[j % len(chunks)]
            ar.append(cid, tokens[i:i + k].to(DEV))
            i, j = i + k, j + 1
    return ar, ids


def make_queries(names: list[str], L: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligned queries: most are corpus substrings (long matches), some random tokens;
    lengths cycle through 0, 1, L and random values (L exceeds max_depth)."""
    g = torch.Generator().manual_seed(seed)
    B = len(names)
    q = torch.full((B, L), PAD, dtype=torch.int32)
    lengths = torch.zeros(B, dtype=torch.int32)
    for b, name in enumerate(names):
        tokens = corpora()[name][0]
        want = (0, 1, L, int(torch.randint(0, L + 1, (1,), generator=g)))[b % 4]
        if b % 3 != 2 and tokens.numel() > 0:
            end = int(torch.randint(0, tokens.numel() + 1, (1,), generator=g))
            seg = tokens[max(0, end - want):end].clamp(min=0)  # separators -> token 0
        else:
            seg = torch.randint(0, 4, (want,), generator=g, dtype=torch.int32)
        if seg.numel():
            q[b, L - seg.numel():] = seg
        lengths[b] = seg.numel()
    return q, lengths


# ------------------------------------------------------------------------------ comparison
def run_both(ar: IndexArena, ids: list[int], q: torch.Tensor, lengths: torch.Tensor,
             P: int, max_scan: int | None = None) -> tuple[MatchResult, MatchResult]:
    desc = ar.descriptors(ids)
    md = ar.config.max_depth
    q, lengths = q.to(ar.device), lengths.to(ar.device)
    ref = suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=md, max_positions=P,
                       max_scan=max_scan, use_triton=False)
    got = suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=md, max_positions=P,
                       max_scan=max_scan, use_triton=True)
    if ar.sa_key is not None:  # the torch path's searches started from the key hints
        assert_same(ref, suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=md,
                                      max_positions=P, max_scan=max_scan, use_triton=False,
                                      sa_key=ar.sa_key))
    return ref, got


def assert_same(ref: MatchResult, got: MatchResult, labels: list[str] | None = None) -> None:
    """Exact equality of every field (dtype and shape included); prints the first bad rows."""
    bad: set[int] = set()
    for f in FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        assert a.dtype == b.dtype and a.shape == b.shape, (f, a.dtype, b.dtype, a.shape, b.shape)
        diff = (a != b) if a.dim() == 1 else (a != b).any(dim=1)
        bad |= set(torch.nonzero(diff).flatten().tolist())
    if bad:
        lines = []
        for r in sorted(bad)[:5]:
            lines.append(f"row {r} {labels[r] if labels else ''}:")
            for f in FIELDS:
                lines.append(f"  {f:9s} torch {getattr(ref, f)[r].tolist()} "
                             f"triton {getattr(got, f)[r].tolist()}")
        pytest.fail(f"{len(bad)} mismatching rows\n" + "\n".join(lines))


# (max_depth, tail_tokens, B, P): each case is one batched call over all corpus kinds
CASES = [(1, 1, 17, 8), (4, 3, 3, 3), (4, 1, 17, 0), (16, 1, 17, 8), (16, 16, 1, 8),
         (64, 3, 17, 1), (64, 16, 3, 5), (8, 100, 17, 8)]


@pytest.mark.parametrize("max_depth,tail_tokens,B,P", CASES)
def test_matches_torch(max_depth, tail_tokens, B, P):
    ar, ids = arena(max_depth, tail_tokens)
    names = list(ids)
    start = (max_depth + tail_tokens) % len(names)  # B = 1, 3 pick different corpora
    rows = [names[(start + i) % len(names)] for i in range(B)]
    L = max_depth + 5
    q, lengths = make_queries(rows, L, seed=max_depth * 100 + tail_tokens)
    ref, got = run_both(ar, [ids[r] for r in rows], q, lengths, P)
    assert_same(ref, got, rows)
    if P:  # positions from the first 2 entries of each level's range: kernel == torch
        assert_same(*run_both(ar, [ids[r] for r in rows], q, lengths, P, max_scan=2), rows)
    # the torch path itself against the brute force (cheap here)
    for b, name in enumerate(rows):
        query = q[b, L - int(lengths[b]):].tolist()
        exp = match_reference(ar.corpus_tokens(ids[name]).tolist(), query, max_depth, P)
        assert (int(ref.length[b]), int(ref.count[b]),
                [p for p in ref.positions[b].tolist() if p >= 0]) == (exp[0], exp[1], exp[2]), name


def test_level_counts_cover_0_to_5():
    """The corpora above really exercise 0..5 levels, empty levels and empty and long tails."""
    levels, level_lens, tails = set(), set(), set()
    for md, tt, _, _ in CASES:
        ar, ids = arena(md, tt)
        desc = ar.descriptors(list(ids.values()))
        levels |= set(torch.diff(desc.level_indptr).tolist())
        level_lens |= set(desc.level_sa_len.tolist())
        tails |= set((desc.num_tokens - desc.tail_start).tolist())
    assert set(range(6)) <= levels
    assert 0 in level_lens
    # tails of several BLOCK_T = 32 blocks (the tail holds fewer than tail_tokens positions)
    assert 0 in tails and max(tails) > 32


def test_golden_tiny():
    """Hand-written. Row 0 (0 1 2): "1 2" is followed by a token at 0, 3, 6 (not at 10: end of
    corpus). Row 1 (9 3): "3" is followed by a token at 2 only (a separator at 8)."""
    corpus = t32([1, 2, 3, 1, 2, 4, 1, 2, 3, -1, 1, 2])
    q = t32([0, 1, 2, PAD, 9, 3]).view(2, 3)
    lengths = t32([3, 2])
    for tail_tokens in (1, 100):  # all in levels / all in the tail
        ar = IndexArena(IndexConfig(max_depth=4, tail_tokens=tail_tokens), DEV)
        cid = ar.new_corpus()
        for i in range(0, 12, 2):
            ar.append(cid, corpus[i:i + 2].to(DEV))
        for use_triton in (False, True):
            m = ar.match(q.to(DEV), lengths.to(DEV), [cid, cid], max_positions=4,
                         use_triton=use_triton)
            assert m.length.tolist() == [2, 1]
            assert m.count.tolist() == [3, 1]
            assert m.positions.tolist() == [[8, 5, 2, -1], [3, -1, -1, -1]]


def _adversarial_corpora() -> dict[str, list[int]]:
    return {
        # every key ties up to the corpus start (END)
        "one_token": [3] * 70,
        # separators (several values) right before each occurrence of "1 2 3"
        "sep_before": [-1, 1, 2, 3, -2, 1, 2, 3, 4, -1, 1, 2, 3, -5, 1, 2, 3, 0, 1, 2, 3],
        # the match starts at position 0: the key continues with END
        "at_start": [1, 2, 3, 0, 0, 1, 2, 3, 1, 2, 3, 7],
        # a separator right after every occurrence but one (no continuation token)
        "sep_after": [5, 1, 2, -1, 5, 1, 2, -3, 5, 1, 2, 9, 5, 1, 2, -1],
        # long periodic runs: many equal keys across the levels and the tail
        "period2": [0, 1] * 40,
    }


def _adversarial_queries() -> list[tuple[str, list[int]]]:
    return [
        ("one_token", [3] * 30),  # longer than the corpus's longest match at small depth
        ("one_token", [3]),
        ("one_token", [4, 3, 3]),  # a token absent from the corpus before the match
        ("one_token", [9]),  # no match at all
        ("sep_before", [9, 1, 2, 3]),
        ("sep_before", [0, 1, 2, 3]),  # exactly one full match, preceded by token 0
        ("sep_before", [1, 2, 3]),
        ("sep_before", [3]),
        ("at_start", [8, 8, 1, 2, 3]),
        ("at_start", [0, 1, 2, 3]),
        ("sep_after", [5, 1, 2]),  # only one occurrence is followed by a token
        ("sep_after", [2]),
        ("period2", [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]),
        ("period2", [1, 1]),  # matches "1" only
        ("period2", []),
        # separator values in the query (a drafter's never has them): a last one matches
        # nothing (the torch path's tail scan had matched it), one before reads as in a key
        ("sep_after", [1, 2, -1]),
        ("sep_before", [-1]),
        ("sep_before", [-2, 1, 2, 3]),
    ]


def _adversarial_batch(max_depth: int, tail_tokens: int):
    """The adversarial corpora in one arena (small appends: several levels and merges) and
    the adversarial queries as one right-aligned batch: ``(arena, ids, rows, q, lengths)``."""
    ar = IndexArena(IndexConfig(max_depth=max_depth, tail_tokens=tail_tokens), DEV)
    ids = {}
    for name, toks in _adversarial_corpora().items():
        cid = ids[name] = ar.new_corpus()
        for i in range(0, len(toks), 5):
            ar.append(cid, t32(toks[i:i + 5]).to(DEV))
    rows = _adversarial_queries()
    L = max(len(q) for _, q in rows) + 2
    q = torch.full((len(rows), L), PAD, dtype=torch.int32)
    lengths = torch.zeros(len(rows), dtype=torch.int32)
    for b, (_, query) in enumerate(rows):
        if query:
            q[b, L - len(query):] = t32(query)
        lengths[b] = len(query)
    return ar, ids, rows, q.to(DEV), lengths.to(DEV)


@pytest.mark.parametrize("max_depth,tail_tokens,P", [(1, 1, 3), (5, 3, 4), (8, 1000, 8),
                                                     (16, 7, 1), (16, 1, 40)])
def test_adversarial(max_depth, tail_tokens, P):
    """Hand-built corner cases, kernel vs torch vs the brute force: queries longer than any
    match (and than ``max_depth``), one repeated token (every key ties), separators right
    before and right after the matches, matches at position 0, keys read across the
    level / tail boundary, more occurrences than ``P`` and ``P`` above the count."""
    ar, ids, rows, q, lengths = _adversarial_batch(max_depth, tail_tokens)
    names = [name for name, _ in rows]
    ref, got = run_both(ar, [ids[name] for name in names], q, lengths, P)
    assert_same(ref, got, names)
    for b, (name, query) in enumerate(rows):
        exp = match_reference(_adversarial_corpora()[name], query, max_depth, P)
        assert (int(got.length[b]), int(got.count[b]),
                [p for p in got.positions[b].tolist() if p >= 0]) == exp, (name, query)


@pytest.mark.parametrize("P", [0, 8])
def test_edge_shapes(P):
    ar, ids = arena(4, 3)
    cids = list(ids.values())
    # B = 0
    ref, got = run_both(ar, [], torch.zeros(0, 5, dtype=torch.int32),
                        torch.zeros(0, dtype=torch.int32), P)
    assert_same(ref, got)
    assert got.positions.shape == (0, P)
    # L = 0 (every length 0): length 0, sa_lo == sa_hi == level base
    ref, got = run_both(ar, cids, torch.zeros(len(cids), 0, dtype=torch.int32),
                        torch.zeros(len(cids), dtype=torch.int32), P)
    assert_same(ref, got)
    assert (got.length == 0).all() and (got.count == 0).all() and (got.positions == -1).all()
    # max_levels = 0: only tails; max_tail = 0: only corpora with an empty tail
    big, big_ids = arena(4, 1000)
    for a, a_ids, names in ((big, big_ids, list(big_ids)), (ar, ids, ["sep_last", "empty"])):
        chosen = [a_ids[name] for name in names]
        desc = a.descriptors(chosen)
        assert desc.max_levels == 0 or desc.max_tail == 0
        q, lengths = make_queries(names, 6, seed=3)
        ref, got = run_both(a, chosen, q, lengths, P)
        assert_same(ref, got, names)
    # max_depth = 0: nothing is searched
    desc = ar.descriptors(cids)
    q, lengths = (t.to(DEV) for t in make_queries(list(ids), 6, seed=4))
    ref, got = (suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=0, max_positions=P,
                             use_triton=u) for u in (False, True))
    assert_same(ref, got, list(ids))
    assert (got.length == 0).all()


@pytest.mark.parametrize("max_scan", [1, 2, 5])
def test_max_scan_reads_the_first_entries_of_each_range(max_scan):
    """With ``max_scan``, positions are the ``P`` largest among the tail's hits and the first
    ``max_scan`` entries of each level's range (a bound on the kernel's work per row): kernel
    vs torch, and both against that rule applied to the brute force's hits and the ranges;
    length, count and the ranges are those of the unbounded search."""
    P = 4
    ar, ids, rows, q, lengths = _adversarial_batch(8, 3)
    cids = [ids[name] for name, _ in rows]
    ref, got = run_both(ar, cids, q, lengths, P, max_scan)
    assert_same(ref, got, [name for name, _ in rows])
    full, _ = run_both(ar, cids, q, lengths, P)
    for f in ("length", "count", "sa_lo", "sa_hi"):
        assert torch.equal(getattr(got, f), getattr(full, f)), f
    desc = ar.descriptors(cids)
    capped_somewhere = False
    for b, (name, query) in enumerate(rows):
        corpus = _adversarial_corpora()[name]
        _, _, hits = match_reference(corpus, query, 8, len(corpus) + 1)
        cand = [c for c in hits if c >= int(desc.tail_start[b])]
        for lo, hi in zip(got.sa_lo[b].tolist(), got.sa_hi[b].tolist()):
            cand += ar.sa[lo:min(hi, lo + max_scan)].tolist()
            capped_somewhere |= hi - lo > max_scan
        assert [p for p in got.positions[b].tolist() if p >= 0] == \
            sorted(cand, reverse=True)[:P], (name, query)
    assert capped_somewhere  # the bound was exercised
    with pytest.raises(ValueError, match="max_scan"):
        suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=8, max_positions=P,
                     max_scan=0)


def test_reads_past_a_level_stay_inside_the_corpus():
    """A neighbour or window entry past a level's end belongs to the next level, here another
    corpus's with larger positions; the torch path compared text at that foreign position
    (past the token buffer: IndexError, seen on the demo's workload). Now it is masked
    before any read; kernel and torch agree with the brute force."""
    from agspec_gpu.kernels.suffix_array import build_context_array

    g = torch.Generator().manual_seed(0)
    b_tok = torch.randint(0, 5, (100,), generator=g, dtype=torch.int32)  # corpus B first
    a_tok = t32([1, 2, 3, 1, 2, 3, 1, 2, 3, 4])  # corpus A at the end of the buffer
    tokens = torch.cat([b_tok, a_tok]).to(DEV)
    sa_a = build_context_array(a_tok, 0, 10, 8)
    sa = torch.cat([sa_a, build_context_array(b_tok, 0, 100, 8)]).to(DEV)  # B right after A
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    desc = MatchDescriptors(i64([100, 100]), t32([10, 10]).to(DEV), t32([10, 10]).to(DEV),
                            t32([0, 1, 2]).to(DEV), i64([0, 0]), t32([sa_a.numel()] * 2).to(DEV),
                            1, 0)
    # row 0 sorts after every key of A (its insertion point is the level's end); row 1 ends
    # in "2 3", which A holds near the end of its level
    q = t32([4, 4, 4, 9, 3, 1, 2, 3]).view(2, 4).to(DEV)
    lengths = t32([4, 4]).to(DEV)
    got = [suffix_match(tokens, sa, desc, q, lengths, max_depth=8, max_positions=4,
                        use_triton=u) for u in (False, True)]
    assert_same(*got)
    for b in range(2):
        exp = match_reference(a_tok.tolist(), q[b].tolist(), 8, 4)
        assert (int(got[0].length[b]), int(got[0].count[b]),
                [p for p in got[0].positions[b].tolist() if p >= 0]) == exp, b


@pytest.mark.parametrize("n_buf,width", [(0, 4), (3, 4), (4, 4), (50, 1), (50, 8)])
def test_windows_of_the_torch_path_match_a_loop(n_buf, width):
    """``_windows`` (one ``index_select`` on an unfolded view) gives ``buf[s : s + width]``
    for every start inside the buffer, also when the buffer is shorter than a window, and
    some element of the buffer (no error) for starts that leave it."""
    from agspec_gpu.kernels.suffix_match import _windows

    buf = torch.arange(100, 100 + n_buf, dtype=torch.int32)
    starts = torch.tensor([-5, -1, 0, 1, n_buf - width, n_buf - width + 1, n_buf, n_buf + 3])
    got = _windows(buf, starts, width)
    assert got.shape == (starts.numel(), width)
    for r, s in enumerate(starts.tolist()):
        for j in range(width):
            if 0 <= s + j < n_buf:
                assert int(got[r, j]) == 100 + s + j if 0 <= s and s + width <= n_buf \
                    else int(got[r, j]) in buf.tolist()
            elif n_buf:
                assert int(got[r, j]) in buf.tolist()


def test_tails_and_keys_at_both_ends_of_a_tight_buffer():
    """Corpora at offset 0 and at the very end of a token buffer with no spare capacity:
    the tail's window (padded to the longest tail) leaves the buffer, and keys reach back
    past the corpus start. Torch path == kernel == brute force."""
    from agspec_gpu.kernels.suffix_array import build_context_array

    g = torch.Generator().manual_seed(3)
    a_tok = torch.randint(0, 3, (40,), generator=g, dtype=torch.int32)
    b_tok = torch.cat([t32([2, 1]), torch.randint(0, 3, (9,), generator=g, dtype=torch.int32)])
    tokens = torch.cat([a_tok, b_tok]).to(DEV)  # b ends exactly at the buffer end
    # rows 0, 3: a with positions 0..29 indexed, the rest its tail; rows 1, 2: b all tail;
    # row 4: a all tail (its window starts before the buffer); tails padded to 42
    sa_a = build_context_array(a_tok, 0, 30, 8)
    sa = sa_a.to(DEV)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    desc = MatchDescriptors(i64([0, 40, 40, 0, 0]), t32([40, 11, 11, 40, 40]).to(DEV),
                            t32([30, 0, 0, 30, 0]).to(DEV), t32([0, 1, 1, 1, 2, 2]).to(DEV),
                            i64([0, 0]), t32([sa_a.numel()] * 2).to(DEV), 1, 42)
    q = torch.stack([a_tok[:6], b_tok[:6], t32([0, 0, 0, 0, 2, 1]), a_tok[-6:],
                     a_tok[10:16]]).to(DEV)
    lengths = t32([6, 6, 2, 6, 6]).to(DEV)
    got = [suffix_match(tokens, sa, desc, q, lengths, max_depth=8, max_positions=4,
                        use_triton=u) for u in (False, True)]
    assert_same(*got)
    for b, corpus in enumerate([a_tok, b_tok, b_tok, a_tok, a_tok]):
        L = int(lengths[b])
        exp = match_reference(corpus.tolist(), q[b, 6 - L:].tolist(), 8, 4)
        assert (int(got[0].length[b]), int(got[0].count[b]),
                [p for p in got[0].positions[b].tolist() if p >= 0]) == exp, b


@pytest.mark.parametrize("max_depth", [2, 3])
def test_key_hints_of_queries_that_hold_separators(max_depth):
    """The torch path's key hints code END and every separator alike (0): a range of one
    or two key tokens is exact only for real tokens. A query whose last or second-to-last
    token is a separator (a direct call: the arena's own match refuses them) matched every
    separator and the corpus start there (count 3 for one occurrence, before the fix).
    Torch path with and without the hints == kernel == brute force."""
    corpus = [0, 5, -1, 0, 7, -2, 0, 9, -1, 0, 5, -3, 5, -1]
    ar = IndexArena(IndexConfig(max_depth=max_depth, tail_tokens=1), DEV)
    cid = ar.new_corpus()
    for t in corpus:  # one token at a time: every position indexed in a level
        ar.append(cid, t32([t]).to(DEV))
    desc = ar.descriptors([cid])
    queries = [[-1, 0], [0, -1], [-2, 0], [5, -1], [9, -1], [-1, 5], [-3, 5], [0, 5],
               [-1, -1], [7, -2]]
    for qs in queries:
        q, lengths = t32([qs]).to(DEV), t32([len(qs)]).to(DEV)
        kw = dict(max_depth=max_depth, max_positions=4)
        got = [suffix_match(ar.tokens, ar.sa, desc, q, lengths, use_triton=False, **kw),
               suffix_match(ar.tokens, ar.sa, desc, q, lengths, use_triton=False,
                            sa_key=ar.sa_key, **kw),
               suffix_match(ar.tokens, ar.sa, desc, q, lengths, use_triton=True, **kw)]
        assert_same(got[0], got[1])
        assert_same(got[0], got[2])
        exp = match_reference(corpus, qs, max_depth, 4)
        assert (int(got[1].length[0]), int(got[1].count[0]),
                [p for p in got[1].positions[0].tolist() if p >= 0]) == exp, qs


@pytest.mark.parametrize("P", [0, 2, 8])
def test_tail_blocks_that_raise_the_best_length_drop_the_shorter_hits(P):
    """The kernel reads the tail once, keeping the hits of the longest match so far: short
    matches in the first blocks (and in a level), a longer one only in a later block (then
    shorter ones after it), so the hits held must be dropped when a block raises the
    length. Kernel == torch == brute force."""
    g = torch.Generator().manual_seed(5)
    filler = torch.randint(10, 13, (250,), generator=g, dtype=torch.int32)
    text = filler.clone()
    query = [7, 8, 9]
    for at in (5, 140, 170):      # "9" (length 1) in a level and the first tail blocks
        text[at] = 9
    text[228:231] = t32(query)    # the whole query, in the tail's 4th block of 32
    text[245] = 9                 # and a short one after it
    for tail_tokens, chunks in ((1000, (250,)), (128, (130, 120))):  # all tail / level + tail
        ar = IndexArena(IndexConfig(max_depth=8, tail_tokens=tail_tokens), DEV)
        cid = ar.new_corpus()
        for i, k in zip((0, chunks[0]), chunks):
            ar.append(cid, text[i:i + k].to(DEV))
        desc = ar.descriptors([cid])
        assert int(desc.num_tokens[0] - desc.tail_start[0]) > 96  # several tail blocks
        q, lengths = t32(query).view(1, 3).to(DEV), t32([3]).to(DEV)
        got = [suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=8, max_positions=P,
                            use_triton=u) for u in (False, True)]
        assert_same(*got)
        exp = match_reference(text.tolist(), query, 8, P)
        assert (int(got[1].length[0]), int(got[1].count[0]),
                [p for p in got[1].positions[0].tolist() if p >= 0]) == exp
        assert exp[0] == 3 and exp[1] == 1


@pytest.mark.parametrize("fan", [1, 4, 32])
def test_searches_of_any_fan_out_equal_the_torch_path(fan):
    """Levels of thousands of entries (the corpora above stay under 300 tokens: one or two
    rounds of a 32-way search): the kernel's ``FAN``-ary searches (``FAN = 1`` the binary
    search) take several rounds there, on keys that tie for long stretches (a 2-token and a
    periodic vocabulary); every field equals the torch path's whatever the fan-out."""
    from agspec_gpu.kernels.suffix_match_triton import suffix_match_triton

    g = torch.Generator().manual_seed(fan)
    ar = IndexArena(IndexConfig(max_depth=16, tail_tokens=64), DEV)
    texts = [torch.randint(0, 2, (6000,), generator=g, dtype=torch.int32),
             torch.arange(5000, dtype=torch.int32) % 7 + (torch.arange(5000) % 97 == 0),
             torch.randint(0, 50, (4000,), generator=g, dtype=torch.int32)]
    cids = []
    for t in texts:
        cids.append(ar.new_corpus())
        for i in range(0, t.numel(), 1500):  # one large level per corpus, then smaller ones
            ar.append(cids[-1], t[i:i + 1500].to(DEV))
    desc0 = ar.descriptors(cids)
    assert int(desc0.level_sa_len.max()) >= 4000  # ceil(log_33(4001)) = 3 rounds
    rows, q, lengths = [], torch.full((15, 20), PAD, dtype=torch.int32), []
    for b in range(15):
        c, t = b % 3, texts[b % 3]
        n = (0, 1, 3, 9, 20)[b % 5]
        end = int(torch.randint(n, t.numel() + 1, (1,), generator=g))
        seg = t[end - n:end] if b % 4 else torch.randint(0, 3, (n,), generator=g,
                                                         dtype=torch.int32)
        if n:
            q[b, 20 - n:] = seg
        rows.append(cids[c])
        lengths.append(n)
    desc = ar.descriptors(rows)
    q, lengths = q.to(DEV), t32(lengths).to(DEV)
    for max_scan in (None, 3) if fan == 32 else (None,):
        ref = suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=16, max_positions=6,
                           max_scan=max_scan, use_triton=False)
        got = suffix_match_triton(ar.tokens, ar.sa, desc, q, lengths, max_depth=16,
                                  max_positions=6, max_scan=max_scan, fan=fan)
        assert_same(ref, got)
        assert int(ref.count.max()) > 1000  # ranges that span many pivots
    with pytest.raises(ValueError, match="fan"):
        suffix_match_triton(ar.tokens, ar.sa, desc, q, lengths, max_depth=16,
                            max_positions=6, fan=3)


def test_launcher_rejects_bad_descriptors():
    ar, ids = arena(4, 3)
    desc = ar.descriptors([ids["random"]])
    bad = MatchDescriptors(desc.tok_base.to(torch.int32), desc.num_tokens, desc.tail_start,
                           desc.level_indptr, desc.level_sa_base, desc.level_sa_len,
                           desc.max_levels, desc.max_tail)
    q, lengths = t32([1, 2]).view(1, 2).to(DEV), t32([2]).to(DEV)
    with pytest.raises(ValueError, match="tok_base"):
        suffix_match(ar.tokens, ar.sa, bad, q, lengths, max_depth=4, max_positions=2,
                     use_triton=True)
    with pytest.raises(ValueError, match="max_positions"):
        suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=4, max_positions=-1,
                     use_triton=True)
    # scalars that are no ints, arrays of another rank, a level key of another length:
    # named, where they once failed inside a path (or ran, on a 2-D sa)
    for kw, name in ((dict(max_depth=2.5), "max_depth"), (dict(max_depth=True), "max_depth"),
                     (dict(max_positions=2.0), "max_positions"),
                     (dict(max_scan=1.5), "max_scan")):
        with pytest.raises(ValueError, match=name):
            suffix_match(ar.tokens, ar.sa, desc, q, lengths, **{"max_depth": 4,
                                                               "max_positions": 2, **kw})
    for name, args in (("tokens", (ar.tokens.view(-1, 2), ar.sa)),
                       ("sa", (ar.tokens, ar.sa.view(-1, 2)))):
        with pytest.raises(ValueError, match=f"{name} must be 1-D"):
            suffix_match(*args, desc, q, lengths, max_depth=4, max_positions=2)
    for name, args in (("sa", (ar.tokens, ar.sa.to("meta"), desc, q, lengths)),
                       ("queries", (ar.tokens, ar.sa, desc, q.to("meta"), lengths)),
                       ("lengths", (ar.tokens, ar.sa, desc, q, lengths.to("meta"))),
                       ("desc.num_tokens", (ar.tokens, ar.sa, dataclasses.replace(
                           desc, num_tokens=desc.num_tokens.to("meta")), q, lengths))):
        with pytest.raises(ValueError, match=f"^{name} is on meta"):
            suffix_match(*args, max_depth=4, max_positions=2, use_triton=True)
    assert desc.level_key is not None and desc.level_key.numel() >= 1
    short = dataclasses.replace(desc, level_key=desc.level_key[:-1])
    with pytest.raises(ValueError, match="desc.level_key"):
        suffix_match(ar.tokens, ar.sa, short, q, lengths, max_depth=4, max_positions=2,
                     sa_key=torch.zeros_like(ar.sa, dtype=torch.int64))


# ------------------------------------------------------------------------- the drafter's launch
def src_arena(max_depth: int, tail_tokens: int, texts: dict[str, list[int]]):
    """``texts`` in one arena, appended in chunks of 7 with a source code per chunk (so
    windows cross source changes): ``(arena, ids)``."""
    ar = IndexArena(IndexConfig(max_depth=max_depth, tail_tokens=tail_tokens), DEV,
                    initial_tokens=64)
    ids = {}
    for i, (name, toks) in enumerate(texts.items()):
        cid = ids[name] = ar.new_corpus(16)
        for j in range(0, len(toks), 7):
            ar.append(cid, t32(toks[j:j + 7]).to(DEV), src=(i + j // 7) % 5)
    return ar, ids


def window_definition(ar: IndexArena, desc: MatchDescriptors, positions: torch.Tensor, W: int):
    """The windows and their sources, entry by entry, from the arena's buffers."""
    tokens, src = ar.tokens.tolist(), ar.src.tolist()
    B, P = positions.shape
    win = [[[-1] * W for _ in range(P)] for _ in range(B)]
    wsrc = [[[-1] * W for _ in range(P)] for _ in range(B)]
    for b in range(B):
        base, n = int(desc.tok_base[b]), int(desc.num_tokens[b])
        for i, c in enumerate(positions[b].tolist()):
            for j in range(W):
                if c >= 0 and c + j < n:
                    win[b][i][j], wsrc[b][i][j] = tokens[base + c + j], src[base + c + j]
    return win, wsrc


def drafter_launch(ar, cids, table, lengths, rows, caps, P, W, use_triton, max_scan=None):
    """The match as the drafter launches it: queries read from a shared table by row."""
    return suffix_match(ar.tokens, ar.sa, ar.descriptors(cids), table.to(DEV), lengths.to(DEV),
                        max_depth=ar.config.max_depth, max_positions=P, max_scan=max_scan,
                        use_triton=use_triton, query_rows=rows.to(DEV),
                        max_lengths=None if caps is None else caps.to(DEV), window=W,
                        src=ar.src if W else None)


@pytest.mark.parametrize("max_depth,tail_tokens,P,W", [(4, 3, 3, 5), (16, 1, 8, 32),
                                                      (64, 16, 1, 1), (8, 100, 8, 8),
                                                      (16, 7, 0, 4)])
def test_query_rows_caps_and_windows_equal_the_separate_steps(max_depth, tail_tokens, P, W):
    """Queries read from a table by row (repeated rows, rows without a query, lengths
    capped per table row) and the windows after each position, in the match's launch:
    kernel == torch path == the match of the gathered queries, and the windows equal the
    definition (real cl100k text, repeated tokens, periods, separators)."""
    tok = load_tokenizer("cl100k")
    texts = {"code": tok.encode("def f(x):\n    return x + 1\n" * 3),
             "diff": tok.encode("$ git diff src/loss.py\n-    return a\n+    return b\n"),
             "one": tok.encode("x"), "repeat": [5] * 40, "period3": [1, 2, 3] * 15,
             "seps": [1, -1, 2, -3, 3, 4, 1, -1, 2, 3, 4, 1, 2]}
    ar, ids = src_arena(max_depth, tail_tokens, texts)
    names = list(texts)
    L = max_depth + 3
    table = torch.full((5, L), PAD, dtype=torch.int32)  # a ring of 5 slots, right-aligned
    table_len = torch.zeros(5, dtype=torch.int32)
    for q in range(5):
        t = texts[names[q]]
        n = min(len(t), L - 2 * q)  # (the first row: the whole query)
        if n:
            table[q, L - n:] = t32(t[len(t) - n:]).clamp(min=0)
        table_len[q] = n
    caps = t32([L, 1, 0, 3, L + 4])
    # 4 corpora per request (its own text first), rows of absent corpora have no query (-1)
    rows, labels = [], []
    for b in range(12):
        rows.append(b // 4 if b % 4 != 3 or b < 4 else -1)
        labels.append(names[b // 4] if b % 4 == 0 else names[(b * 5) % len(names)])
    cids = [ids[name] for name in labels]
    rows = torch.tensor(rows, dtype=torch.int64)
    want_q, want_len = table[rows.clamp(min=0)], torch.where(
        rows >= 0, torch.minimum(table_len, caps)[rows.clamp(min=0)], 0).to(torch.int32)
    ref, _ = run_both(ar, cids, want_q, want_len, P)
    got = [drafter_launch(ar, cids, table, table_len, rows, caps, P, W, u)
           for u in (False, True)]
    for m in got:
        assert_same(ref, m, labels)
        assert m.windows.dtype == torch.int32 and m.window_sources.dtype == torch.int8
        assert tuple(m.windows.shape) == tuple(m.window_sources.shape) == (12, P, W)
        assert (m.windows.tolist(), m.window_sources.tolist()) == \
            window_definition(ar, ar.descriptors(cids), m.positions.cpu(), W)
    assert int(ref.length.max()) > 1 and (ref.length[rows < 0] == 0).all()


@pytest.mark.parametrize("W", [1, 6])
def test_windows_at_corpus_ends_without_queries_and_of_empty_batches(W):
    """Windows that run past the corpus end (a one-token and an empty corpus), rows with no
    query at all (an empty table), and no rows: kernel == torch == the definition."""
    ar, ids = src_arena(4, 2, {"one": [7], "empty": [], "pair": [7, 7, 7, 7]})
    table, lengths = t32([3, 7, 7, 7]).view(1, 4), t32([4])
    for cids, rows in (([ids["one"], ids["pair"], ids["empty"]], [0, 0, 0]),
                       ([ids["pair"]], [-1]), ([], [])):
        rows = torch.tensor(rows, dtype=torch.int64)
        got = [drafter_launch(ar, cids, table, lengths, rows, None, 3, W, u)
               for u in (False, True)]
        assert_same(*got)
        for m in got:
            assert m.windows.shape == (len(cids), 3, W)
            assert (m.windows.tolist(), m.window_sources.tolist()) == \
                window_definition(ar, ar.descriptors(cids), m.positions.cpu(), W)
    empty = torch.zeros(0, 4, dtype=torch.int32, device=DEV)  # the arena's device
    got = [suffix_match(ar.tokens, ar.sa, ar.descriptors([ids["pair"]] * 2), empty,
                        torch.zeros(0, dtype=torch.int32, device=DEV), max_depth=4,
                        max_positions=2, query_rows=torch.tensor([-1, -1], device=DEV),
                        window=W, src=ar.src,
                        use_triton=u) for u in (False, True)]
    assert_same(*got)
    assert (got[1].length == 0).all() and (got[1].windows == -1).all()


def test_launcher_rejects_bad_query_rows_caps_and_windows():
    ar, ids = arena(4, 3)
    desc = ar.descriptors([ids["random"], ids["one"]])
    table, lengths = t32([1, 2]).view(1, 2).to(DEV), t32([2]).to(DEV)
    rows = torch.tensor([0, -1], device=DEV)
    good = dict(query_rows=rows, max_lengths=lengths, window=3, src=ar.src)
    for name, bad in (("query_rows", rows.int()), ("query_rows", rows[:1]),
                      ("max_lengths", lengths.long()), ("max_lengths", lengths.repeat(2)),
                      ("window", -1), ("src", None), ("src", ar.src[:-1]),
                      ("src", ar.src.int())):
        for u in (False, True):
            with pytest.raises(ValueError, match=name):
                suffix_match(ar.tokens, ar.sa, desc, table, lengths, max_depth=4,
                             max_positions=2, use_triton=u, **{**good, name: bad})



def new_out(B: int, P: int, K: int, W: int, fill: int = 77) -> MatchResult:
    """A caller's output buffers, filled with garbage (the match writes every entry)."""
    def new(*shape, dtype=torch.int64):
        return torch.full(shape, fill, dtype=dtype, device=DEV)
    return MatchResult(new(B, dtype=torch.int32), new(B), new(B, P), new(B, K), new(B, K),
                       new(B, P, W, dtype=torch.int32) if W else None,
                       new(B, P, W, dtype=torch.int8) if W else None)


@pytest.mark.parametrize("W", [0, 5])
def test_match_into_the_callers_buffers(W):
    """``out=``: the result lands in the caller's tensors (returned), equal to a new
    result on both paths, level columns wider than the rows' levels written 0, and the
    same buffers reused by a second match of other rows (a drafter's step after step)."""
    ar, ids = src_arena(8, 3, {"period3": [1, 2, 3] * 20, "one": [4], "repeat": [5] * 30,
                               "empty": []})
    table = t32([0, 1, 2, 3, 1, 2, 3, 1]).view(2, 4)
    lengths = t32([4, 2])
    for u in (False, True):
        for cids, rows in (([ids["period3"], ids["repeat"], ids["one"]], [0, 1, -1]),
                           ([ids["empty"], ids["period3"], ids["period3"]], [1, 0, 0])):
            rows = torch.tensor(rows, dtype=torch.int64)
            ref = drafter_launch(ar, cids, table, lengths, rows, None, 3, W, u)
            K = ref.sa_lo.shape[1]
            out = new_out(3, 3, K + 2, W)
            got = suffix_match(ar.tokens, ar.sa, ar.descriptors(cids), table.to(DEV),
                               lengths.to(DEV), max_depth=8, max_positions=3,
                               use_triton=u, query_rows=rows.to(DEV), window=W,
                               src=ar.src if W else None, out=out)
            assert got is out
            wide = MatchResult(ref.length, ref.count, ref.positions,
                               torch.nn.functional.pad(ref.sa_lo, (0, 2)),
                               torch.nn.functional.pad(ref.sa_hi, (0, 2)),
                               ref.windows, ref.window_sources)
            assert_same(wide, got)
            if W:
                assert torch.equal(got.windows, ref.windows)
                assert torch.equal(got.window_sources, ref.window_sources)


def test_launcher_rejects_bad_output_buffers():
    """Every ``out`` tensor of the wrong dtype, shape (too few level columns included) or
    layout, and windows given without a window (or missing with one), is named."""
    ar, ids = arena(4, 3)
    desc = ar.descriptors([ids["random"], ids["one"]])
    table, lengths = t32([1, 2]).view(1, 2).to(DEV), t32([2]).to(DEV)
    kw = dict(max_depth=4, max_positions=2, query_rows=torch.tensor([0, -1], device=DEV),
              window=3, src=ar.src)
    K = max(desc.max_levels, 1)
    good = new_out(2, 2, K, 3)
    cases = [("out.length", dict(length=good.length.long())),
             ("out.count", dict(count=good.count[:1])),
             ("out.positions", dict(positions=good.positions.t())),
             ("out.sa_lo", dict(sa_lo=good.sa_lo[:, :K - 1] if K > 1 else good.sa_lo[:1])),
             ("out.sa_hi", dict(sa_hi=torch.zeros(2, K + 1, dtype=torch.int64, device=DEV))),
             ("out.windows", dict(windows=good.windows[:, :, :2])),
             ("out.window_sources", dict(window_sources=good.windows)),
             ("out: windows", dict(windows=None))]
    for name, change in cases:
        bad = MatchResult(**{**vars(good), **change})
        for u in (False, True):
            with pytest.raises(ValueError, match=name):
                suffix_match(ar.tokens, ar.sa, desc, table, lengths, use_triton=u, out=bad,
                             **kw)
    with pytest.raises(ValueError, match="out: windows"):
        suffix_match(ar.tokens, ar.sa, desc, table, lengths, out=good,
                     **{**kw, "window": 0, "src": None})

# ------------------------------------------------------------------------------ sm_90 compile
_SIGNATURE = dict(
    tokens_ptr="*i32", src_ptr="*i8", sa_ptr="*i32", tok_base_ptr="*i64", num_tokens_ptr="*i32",
    tail_start_ptr="*i32", level_indptr_ptr="*i32", level_base_ptr="*i64", level_len_ptr="*i32",
    queries_ptr="*i32", lengths_ptr="*i32", max_lengths_ptr="*i32", query_rows_ptr="*i64",
    length_ptr="*i32", count_ptr="*i64", positions_ptr="*i64", sa_lo_ptr="*i64",
    sa_hi_ptr="*i64", win_ptr="*i32", win_src_ptr="*i8", L="i32", max_levels="i32",
    max_depth="i32", max_scan="i32")


def test_compiles_for_sm90():
    """``triton.compile`` to a cubin for sm_90 (in a child process without the interpreter,
    see ``kernel_compile.py``, which also fails on register spills) for depths 64 and 32 (the
    store's), depth 1, ``P = 0`` and the binary search (``FAN = 1``); the drafter's launch
    (queries from its ring, windows of its depth 32) at the store's depths; the widest
    tiles :func:`triton_tiles_fit` admits (64 positions, 64-token windows; 8 positions,
    512-token windows) without a spill."""
    specs = []
    for max_depth, P, fan, W, rows in ((64, 8, None, 0, False), (32, 8, None, 0, False),
                                       (1, 1, None, 0, False), (16, 0, None, 0, False),
                                       (32, 8, 1, 0, False), (64, 8, None, 32, True),
                                       (32, 8, None, 32, True), (16, 4, None, 1, True),
                                       (32, 64, None, 64, True), (32, 8, None, 512, True)):
        const = dict(P=P, W=W, BLOCK_W=max(1, 1 << (W - 1).bit_length()) if W else 1,
                     QUERY_ROWS=rows, WINDOWS=bool(W and P), **block_sizes(max_depth, P, fan))
        specs.append((_suffix_match_kernel, dict(_SIGNATURE, **{k: "constexpr" for k in const}),
                      const, LAUNCH_OPTIONS))
    compile_all_for_sm90(specs)


def test_positions_past_the_kernels_tiles_take_the_torch_path():
    """The kernel merges positions in a ``[BLOCK_P, BLOCK_P]`` tile: past 64 positions
    (2**12 elements: 128 positions spill registers on sm_90, 512 had not compiled after 4 min)
    ``suffix_match`` runs the torch path whatever ``use_triton`` says, and the Triton
    launcher refuses them naming the arguments."""
    from agspec_gpu.kernels.suffix_match import triton_tiles_fit
    from agspec_gpu.kernels.suffix_match_triton import suffix_match_triton

    assert triton_tiles_fit(64, 33) and not triton_tiles_fit(65, 1)
    assert triton_tiles_fit(8, 512) and not triton_tiles_fit(8, 513)
    ar, ids = arena(4, 3)
    cids = [ids["repeat"], ids["period2"]]  # dozens of occurrences each (then -1 padding)
    desc = ar.descriptors(cids)
    q, lengths = t32([[3, 3], [0, 1]]).to(DEV), t32([2, 2]).to(DEV)
    got, want = (suffix_match(ar.tokens, ar.sa, desc, q, lengths, max_depth=4,
                              max_positions=65, use_triton=u) for u in (True, False))
    assert_same(want, got)
    assert got.positions.shape == (len(cids), 65)
    with pytest.raises(ValueError, match="max_positions, window"):
        suffix_match_triton(ar.tokens, ar.sa, desc, q, lengths, max_depth=4,
                            max_positions=65)
