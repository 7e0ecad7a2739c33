"""The arena-append kernel (``kernels/arena_append.py``) against its torch path and a
row-by-row reference, with and without the kept lengths it grows (``totals``); its argument
checks and its sm_90 compiles."""

import random

import pytest
import torch

from agspec_gpu.kernels.arena_append import _arena_append_kernel, arena_append
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(rows: list[list[int]], counts: list[int], gaps: list[int], T: int):
    """Runs laid out one after another with ``gaps[b]`` free positions before row ``b``."""
    starts, at = [], 0
    for g, n in zip(gaps, counts):
        at += g
        starts.append(at)
        at += n
    assert at <= T
    M = max((len(r) for r in rows), default=0)
    return (torch.tensor(rows, dtype=torch.int32).view(len(rows), M),
            torch.tensor(starts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))


def _check(rows, starts, counts, T: int, code: int):
    """Both paths on an arena of ``T`` sentinel tokens equal the row-by-row reference;
    with ``totals`` (a strided view, as the drafter's kept lengths are) they also add the
    counts there, and only there."""
    want_tok = torch.full((T,), -7, dtype=torch.int32)
    want_src = torch.full((T,), 5, dtype=torch.int8)
    for r, s, n in zip(rows.tolist(), starts.tolist(), counts.tolist()):
        want_tok[s:s + n] = torch.tensor(r[:n], dtype=torch.int32)
        want_src[s:s + n] = code
    B = rows.shape[0]
    base = torch.arange(3 * B, dtype=torch.int32) * 1000 + 5
    want_base = base.clone()
    want_base[::3] += counts
    for use_triton in (False, True):
        for with_totals in (False, True):
            tok, src = want_tok.new_full((T,), -7).to(DEV), want_src.new_full((T,), 5).to(DEV)
            kept = base.to(DEV, copy=True)
            arena_append(tok, src, rows.to(DEV), starts.to(DEV), counts.to(DEV), code=code,
                         totals=kept[::3] if with_totals else None, use_triton=use_triton)
            assert torch.equal(tok.cpu(), want_tok), use_triton
            assert torch.equal(src.cpu(), want_src), use_triton
            assert torch.equal(kept.cpu(), want_base if with_totals else base), use_triton


def test_edge_shapes():
    _check(*_case([], [], [], 8)[:3], T=8, code=0)  # no rows
    _check(*_case([[], []], [0, 0], [0, 0], 4)[:3], T=4, code=0)  # rows of width 0
    _check(*_case([[3]], [1], [0], 1)[:3], T=1, code=-1)  # one token filling the arena
    _check(*_case([[3, 4, 5]], [0], [2], 4)[:3], T=4, code=1)  # a row appending nothing
    _check(*_case([[9] * 5, [9] * 5], [5, 5], [0, 0], 10)[:3], T=10, code=127)  # adjacent


def test_random_rows_adversarial_tokens():
    rng = random.Random(0)
    for trial in range(40):
        B = rng.choice([1, 2, 3, 8, 17])
        M = rng.choice([1, 2, 33, 64, 65, 130])  # within, at and past a round's 64 columns
        kind = trial % 4
        rows = [[(rng.randrange(100_000) if kind == 0 else 7 if kind == 1  # repeated
                  else j % 3 if kind == 2 else -1 if j % 5 == 0 else j)  # periodic, separators
                 for j in range(M)] for _ in range(B)]
        counts = [rng.choice([0, M, rng.randint(0, M)]) for _ in range(B)]
        gaps = [rng.randint(0, 4) for _ in range(B)]
        T = sum(counts) + sum(gaps) + rng.randint(0, 5)
        rows_t, starts, counts_t = _case(rows, counts, gaps, T)
        order = list(range(B))  # runs in any order in the arena
        rng.shuffle(order)
        _check(rows_t[order].contiguous(), starts[order], counts_t[order], T,
               code=rng.choice([-1, 0, 2, 3]))


def test_rejects_bad_inputs():
    good = dict(arena=torch.zeros(8, dtype=torch.int32), src=torch.zeros(8, dtype=torch.int8),
                rows=torch.zeros(2, 3, dtype=torch.int32),
                starts=torch.tensor([0, 3]), counts=torch.tensor([3, 2]))
    for name, bad in (("arena", torch.zeros(8, dtype=torch.int64)),
                      ("src", torch.zeros(7, dtype=torch.int8)),
                      ("rows", torch.zeros(2, 3, dtype=torch.int64)),
                      ("rows", torch.zeros(3, 2, dtype=torch.int32).t()),  # not contiguous
                      ("starts", torch.tensor([0, 3, 5])),
                      ("counts", torch.tensor([3, 2], dtype=torch.int32)),
                      ("totals", torch.zeros(2, dtype=torch.int64)),
                      ("totals", torch.zeros(3, dtype=torch.int32)),
                      ("totals", torch.zeros(1, dtype=torch.int32).expand(2))):  # one cell
        with pytest.raises(ValueError, match=name):
            arena_append(**{**good, name: bad}, code=0, use_triton=True)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="totals"):
            arena_append(**good, code=0, totals=torch.zeros(2, dtype=torch.int32,
                                                            device="cuda"))
    for code in (128, -129, 1.0, True):
        with pytest.raises(ValueError, match="code"):
            arena_append(**good, code=code, use_triton=True)


def test_rejects_a_tensor_on_another_device():
    good = dict(arena=torch.zeros(8, dtype=torch.int32), src=torch.zeros(8, dtype=torch.int8),
                rows=torch.zeros(2, 3, dtype=torch.int32),
                starts=torch.tensor([0, 3]), counts=torch.tensor([3, 2]),
                totals=torch.zeros(2, dtype=torch.int32))
    for name in ("src", "rows", "starts", "counts", "totals"):
        for use_triton in (True, False):
            with pytest.raises(ValueError, match=f"^{name}: .*meta"):
                arena_append(**{**good, name: good[name].to("meta")}, code=0,
                             use_triton=use_triton)


def test_one_compile_for_every_batch_and_width():
    def launch(B, M, totals):
        return lambda: arena_append(
            torch.zeros(B * M, dtype=torch.int32, device=DEV),
            torch.zeros(B * M, dtype=torch.int8, device=DEV),
            torch.ones(B, M, dtype=torch.int32, device=DEV),
            torch.arange(B, device=DEV) * M, torch.full((B,), M, device=DEV), code=B % 3,
            totals=torch.zeros(B, 1 + B % 4, dtype=torch.int32, device=DEV)[:, 0]
            if totals else None, use_triton=True)

    shapes = ((1, 1), (2, 3), (16, 33), (64, 4), (3, 130))
    launches = [launch(B, M, t) for B, M in shapes for t in (False, True)]
    assert assert_one_compile_per_config(_arena_append_kernel, launches) == 2


def test_kernel_compiles_for_sm90():
    sig = dict(rows_ptr="*i32", starts_ptr="*i64", counts_ptr="*i64", arena_ptr="*i32",
               src_ptr="*i8", totals_ptr="*i32", M="i32", code="i32", totals_stride="i32",
               HAS_TOTALS="constexpr", BLOCK_M="constexpr")
    compile_all_for_sm90([(_arena_append_kernel, sig, dict(HAS_TOTALS=t, BLOCK_M=64))
                          for t in (False, True)])
