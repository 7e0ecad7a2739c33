"""The one-launch level build (``kernels/suffix_array.py``: ``context_array`` and
``_context_array_kernel``) against the torch path (``build_context_array``) and a sorted-key
reference, on small windows under the interpreter (its ``tl.sort`` takes seconds at the
production block of 1024); the arena building its levels through it; its argument checks;
its sm_90 compiles (the production blocks, no spills) and one compile per block."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from agspec_gpu import index as index_mod
from agspec_gpu.index import IndexArena, IndexConfig
from agspec_gpu.kernels import suffix_array as sa_mod
from agspec_gpu.kernels.suffix_array import (MAX_BLOCK, _context_array_kernel,
                                             build_context_array, context_array,
                                             num_context_positions)
from kernel_compile import (NoLaunch, compile_all_for_sm90, num_compiles,
                            recorded_specializations)
from test_index import context_reference, pack, rows_of, stdlib_tokens, t32

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _small_block(lo: int, hi: int, depth: int) -> int | None:
    """The smallest block the window of ``[lo, hi)`` fits (the interpreter's sorts are slow
    at the production 1024); on a GPU the production blocks (None), compiled once."""
    if DEV.type == "cuda":
        return None
    W = hi - 1 - max(0, max(lo, 1) - depth)
    return max(2, 1 << max(W - 1, 1).bit_length())


def _kernel(tokens: list[int], lo: int, hi: int, depth: int, block: int | None = None
            ) -> list[int]:
    t = t32(tokens).to(DEV)
    num = num_context_positions([i for i, x in enumerate(tokens) if x < 0], lo, hi)
    out = torch.full((num,), -7, dtype=torch.int32, device=DEV)
    got = context_array(t, lo, hi, depth, num_selected=num, out=out, use_triton=True,
                        block=block if block else _small_block(lo, hi, depth))
    assert got.data_ptr() == out.data_ptr()
    return got.tolist()


def _check(tokens: list[int], lo: int, hi: int, depth: int, block: int | None = None) -> None:
    want = context_reference(tokens, lo, hi, depth)
    torch_path = build_context_array(t32(tokens), lo, hi, depth).tolist()
    assert torch_path == want
    assert _kernel(tokens, lo, hi, depth, block) == want, (lo, hi, depth)
    # the launcher's torch path (it raised for an empty range at 0 once)
    num = len(want)
    assert context_array(t32(tokens).to(DEV), lo, hi, depth, num_selected=num,
                         use_triton=False).tolist() == want, (lo, hi, depth)


@pytest.mark.parametrize("tokens,lo,hi", [
    ([], 0, 0),  # empty
    ([3, 4, 5], 0, 0),  # an empty range at the text's start
    ([5], 0, 1),  # one token: position 0 has no context
    ([5, 6], 0, 2),  # one position
    ([5, 6], 1, 2),
    ([5, 6, 7], 2, 2),  # an empty range inside the text
    ([-1, 4, -1, 4, -1], 0, 5),  # separators only between single tokens: nothing selected
    ([-1, -1, -1], 0, 3),
    ([7] * 40, 0, 40),  # one repeated token: every context ties to its length
    ([7] * 40, 13, 31),  # ... from inside the text (the window starts before lo)
    ([1, 2, 3] * 17, 0, 51),  # periodic
    ([1, 2] * 20 + [-1] + [1, 2] * 20, 0, 81),  # periodic across a separator
    ([3, -2, 3, -1, 3, 3, -1, 3], 0, 8),  # separators of two values: below tokens, ordered
    ([2 ** 31 - 1, 0, 2 ** 31 - 1, 0, 5], 0, 5),  # the largest and smallest token ids
])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 9, 10, 28, 64])
def test_edge_texts(tokens, lo, hi, depth):
    _check(tokens, lo, hi, depth)


def test_random_texts_depths_and_ranges():
    """Vocabularies of 2 (long ties), 3, 50 and real code tokens, separators now and then,
    ranges anywhere (the window reads ``depth`` tokens before ``lo``), depths around the
    rounds' edges (1, 3, 9, 27 and one past each) and the index's 64 and 65."""
    rng = random.Random(5)
    code = stdlib_tokens(400)
    for trial in range(24):
        n = rng.randint(1, 120)
        kind = trial % 4
        if kind == 3:
            a = rng.randrange(len(code) - n)
            toks = code[a:a + n]
        else:
            toks = [rng.randrange((2, 3, 50)[kind]) for _ in range(n)]
        if trial % 3 == 0:
            toks = [-1 if rng.random() < 0.06 else x for x in toks]
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        depth = (1, 2, 3, 4, 9, 10, 27, 28, 64, 65)[trial % 10]
        _check(toks, lo, hi, depth)


@pytest.mark.parametrize("block", [64, 128])
def test_a_larger_block_than_the_window(block):
    """Padding elements (past the window) sort after every real one and select nothing."""
    toks = stdlib_tokens(40)
    _check(toks, 3, 40, 16, block=block)


def test_the_production_block():
    """The default block (1024, the smaller of the two compiled) on a window of real code:
    one case, the interpreter's sort of 1024 elements takes seconds."""
    toks = stdlib_tokens(700)
    toks[::41] = [-1] * len(toks[::41])
    t = t32(toks).to(DEV)
    num = num_context_positions([i for i, x in enumerate(toks) if x < 0], 100, 690)
    got = context_array(t, 100, 690, 64, num_selected=num, use_triton=True)
    assert got.tolist() == context_reference(toks, 100, 690, 64)


def test_a_window_over_the_block_takes_the_torch_path(monkeypatch):
    """More than MAX_BLOCK window positions: the torch path, even when the kernel is asked
    for, with the same result."""
    monkeypatch.setattr(sa_mod, "_context_array_kernel", NoLaunch())
    rng = random.Random(3)
    toks = [rng.randrange(6) for _ in range(MAX_BLOCK + 80)]
    lo, hi = 10, MAX_BLOCK + 80
    got = context_array(t32(toks), lo, hi, 16, use_triton=True,
                        num_selected=num_context_positions([], lo, hi))
    assert got.tolist() == build_context_array(t32(toks), lo, hi, 16).tolist()
    # and a range with nothing selected launches nothing either
    assert context_array(t32([-1] * 8), 0, 8, 4, num_selected=0, use_triton=True).numel() == 0


def test_bad_arguments():
    t = t32([1, 2, 3, 4])
    with pytest.raises(ValueError, match="tokens"):
        context_array(t.long(), 0, 4, 4, num_selected=3)
    with pytest.raises(ValueError, match="bad range"):
        context_array(t, 0, 5, 4, num_selected=3)
    with pytest.raises(ValueError, match="depth"):
        context_array(t, 0, 4, 0, num_selected=3)
    for num in (-1, 4, 2.0, True, None):
        with pytest.raises(ValueError, match="num_selected"):
            context_array(t, 0, 4, 4, num_selected=num)
    with pytest.raises(ValueError, match="out"):
        context_array(t, 0, 4, 4, num_selected=3, out=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        context_array(t, 0, 4, 4, num_selected=3, out=torch.zeros(3, dtype=torch.int64))
    for block in (2, 3, 6, 2 * MAX_BLOCK, True):  # the window holds 3
        with pytest.raises(ValueError, match="block"):
            context_array(t, 0, 4, 4, num_selected=3, use_triton=True, block=block)
    with pytest.raises(ValueError, match="work"):
        context_array(t, 0, 4, 4, num_selected=3, use_triton=True, block=4,
                      work=torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="work"):
        context_array(t, 0, 4, 4, num_selected=3, use_triton=True, block=4,
                      work=torch.zeros(8, dtype=torch.int32))
    meta = dict(device="meta")
    with pytest.raises(ValueError, match="^out: expected device cpu, got meta"):
        context_array(t, 0, 4, 4, num_selected=3, out=torch.zeros(3, dtype=torch.int32, **meta))
    with pytest.raises(ValueError, match="^work: expected device cpu, got meta"):
        context_array(t, 0, 4, 4, num_selected=3, use_triton=True, block=4,
                      work=torch.zeros(8, dtype=torch.int64, **meta))


def test_the_arena_builds_its_levels_through_the_kernel(monkeypatch):
    """Appends of every size to an arena whose levels the kernel builds (a small block
    each, under the interpreter), merges included: its suffix array and matches equal an
    arena built by the torch path."""
    built = []

    def kernel_build(seg, lo, hi, depth, **kw):
        built.append(hi - lo)
        return context_array(seg, lo, hi, depth, use_triton=True,
                             block=_small_block(lo, hi, depth), **kw)

    corpus = stdlib_tokens(300)
    corpus[::37] = [-1] * len(corpus[::37])
    rng = random.Random(11)
    chunks, pos = [], 0
    while pos < len(corpus):
        chunks.append(rng.choice([1, 2, 5, 30]))
        pos += chunks[-1]

    def fill(arena: IndexArena) -> int:
        cid, pos = arena.new_corpus(), 0
        for k in chunks:
            arena.append(cid, t32(corpus[pos:pos + k]))
            pos += k
        return cid

    config = IndexConfig(max_depth=12, tail_tokens=16)
    want = IndexArena(config)
    want_cid = fill(want)
    monkeypatch.setattr(index_mod, "context_array", kernel_build)
    got = IndexArena(config)
    got_cid = fill(got)
    assert len(built) >= 8 and max(built) > 64  # flushes and merges
    levels = lambda a, cid: [(lv.pos_lo, lv.pos_hi) for lv in a._corpora[cid].levels]  # noqa: E731
    assert levels(got, got_cid) == levels(want, want_cid)
    assert torch.equal(got.sa[:got._sa_top], want.sa[:want._sa_top])
    queries = [[t for t in corpus[a:a + 5] if t >= 0] for a in range(0, 290, 23)]
    q, lens = pack(queries)
    assert rows_of(got.match(q, lens, [got_cid] * len(queries), max_positions=4), 4) == \
        rows_of(want.match(q, lens, [want_cid] * len(queries), max_positions=4), 4)


def test_a_failed_build_gives_its_entries_back(monkeypatch):
    """A level build that raises leaves the suffix-array buffer's top where it was (its
    entries were allocated first, to be written in place), and the arena usable."""
    arena = IndexArena(IndexConfig(max_depth=8, tail_tokens=16))
    cid = arena.new_corpus()
    arena.append(cid, t32(stdlib_tokens(40)))
    top, sa = arena._sa_top, arena.sa.clone()

    def fail(*args, **kwargs):
        raise RuntimeError("build failed")

    monkeypatch.setattr(index_mod, "context_array", fail)
    with pytest.raises(RuntimeError, match="build failed"):
        arena.append(cid, t32(stdlib_tokens(80)[40:]))
    assert arena._sa_top == top and torch.equal(arena.sa[:sa.numel()], sa)
    monkeypatch.undo()
    arena.append(cid, t32(stdlib_tokens(100)[80:]))  # the tail's next flush builds again
    assert arena.num_levels(cid) >= 1


def test_one_compile_per_block():
    """Ranges, windows and selections of any size share a block's compile, and so do
    tokens and outputs at any offset (the arena passes views of its buffers)."""
    rng = random.Random(2)
    toks = [rng.randrange(9) for _ in range(60)]

    def at_offset(lo: int, hi: int, shift: int) -> None:
        t = torch.zeros(shift + len(toks), dtype=torch.int32, device=DEV)
        t[shift:] = t32(toks).to(DEV)
        num = num_context_positions([], lo, hi)
        out = torch.zeros(shift + num, dtype=torch.int32, device=DEV)
        context_array(t[shift:], lo, hi, 8, num_selected=num, out=out[shift:],
                      use_triton=True, block=64)
        assert out[shift:].tolist() == context_reference(toks, lo, hi, 8)

    launches = [functools.partial(_kernel, toks, lo, hi, 8, block=64)
                for lo, hi in ((0, 60), (1, 17), (5, 48), (16, 33), (30, 31))]
    launches += [functools.partial(at_offset, 2, 50, shift) for shift in (1, 3, 4)]
    with recorded_specializations(_context_array_kernel) as seen:
        for launch in launches:
            launch()
    assert num_compiles(_context_array_kernel, seen["_context_array_kernel"]) == 1


def test_kernel_compiles_for_sm90():
    """The two production blocks at the corpora's depth (``TierConfig.max_depth``, 32) and
    the large one at an ``IndexConfig``'s default depth (64), without register spills."""
    sig = dict(tokens_ptr="*i32", out_ptr="*i32", work_ptr="*i64", lo="i32", hi="i32",
               W="i32", num_selected="i32", DEPTH="constexpr", BLOCK="constexpr",
               IB="constexpr")
    usage = compile_all_for_sm90([
        (_context_array_kernel, sig, dict(DEPTH=d, BLOCK=b, IB=b.bit_length() - 1),
         dict(num_warps=w)) for d, b, w in ((32, 1024, 4), (32, MAX_BLOCK, 8),
                                            (64, MAX_BLOCK, 8))])
    assert len(usage) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [600, MAX_BLOCK + 600], ids=["kernel", "torch"])
def test_a_level_build_waits_for_nothing_on_cuda(tokens):
    """An append that flushes the tail into a level (merging the one before) reads nothing
    back from the GPU, through the kernel (a window up to MAX_BLOCK) or the torch path:
    under ``set_sync_debug_mode("error")`` any wait raises. Its levels equal a CPU
    arena's."""
    toks = stdlib_tokens(tokens)
    seps = [i for i, x in enumerate(toks) if x < 0]
    half = tokens // 2
    parts = [(toks[:half], [s for s in seps if s < half]),
             (toks[half:], [s - half for s in seps if s >= half])]
    config = IndexConfig(max_depth=64, tail_tokens=256)
    arenas = [IndexArena(config, "cuda"), IndexArena(config, "cpu")]
    cids = [a.new_corpus(2 * tokens) for a in arenas]
    for arena, cid in zip(arenas, cids):
        arena.append(cid, t32(parts[0][0]).to(arena.device), separators=parts[0][1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        arenas[0].append(cids[0], t32(parts[1][0]).cuda(), separators=parts[1][1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    arenas[1].append(cids[1], t32(parts[1][0]), separators=parts[1][1])
    got, want = (a._corpora[c].levels for a, c in zip(arenas, cids))
    assert [(x.pos_lo, x.pos_hi) for x in got] == [(x.pos_lo, x.pos_hi) for x in want]
    assert got and got[-1].pos_hi - got[-1].pos_lo > 256  # a flush that merged
    for g, w in zip(got, want):
        assert torch.equal(arenas[0].sa[g.sa_base:g.sa_base + g.sa_len].cpu(),
                           arenas[1].sa[w.sa_base:w.sa_base + w.sa_len])
