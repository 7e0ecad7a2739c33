"""The batch-budget kernel (``kernels/batch_budget.py``) against its torch path and against a
brute force over the objective; and its sm_90 compile."""

import random

import pytest
import torch

from agspec_gpu.controller import batch_budget, cost_table
from agspec_gpu.cost_model import CostModel
from agspec_gpu.kernels.batch_budget import (_budget_keep_kernel, budget_keep,
                                             budget_keep_torch, num_warps)
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90

LINEAR = CostModel(((1, 1.0), (2, 1.5), (1000, 500.0)))  # cost(m) = 0.5 + 0.5 m
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rows(scores: list[list[float]], N: int) -> torch.Tensor:
    """Best-first score rows padded with -2 (no node)."""
    return torch.tensor([sorted(r, reverse=True) + [-2.0] * (N - len(r)) for r in scores],
                        dtype=torch.float32).view(len(scores), N)


def both(ranked, keep, num_requests, table):
    """The torch path and the kernel (with ``num_requests`` as an int and as a tensor; on the
    GPU where there is one); the result on the CPU."""
    ranked, keep, table = ranked.to(DEV), keep.to(DEV), table.to(DEV)
    want = budget_keep(ranked, keep, num_requests, table, use_triton=False)
    for n in (num_requests, torch.tensor(num_requests, device=DEV)):
        got = budget_keep(ranked, keep, n, table, use_triton=True)
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    return want.cpu()


def brute_force(ranked, keep, B, cost: CostModel, base: int | None = None) -> list[int]:
    """Keep per request: the smallest n maximising (B + top-n sum) / cost(B + n) (or
    cost(base + n)), exactly n nodes: the batch's in (score descending, best-first rank,
    request) order (sums in float64; the kernel's, in 2**-32 units, choose the same n on
    these tests' scores)."""
    nodes = sorted((-float(v), j, b) for b, r in enumerate(ranked.tolist())
                   for j, v in enumerate(r) if v > -1.5 and j < int(keep[b]))
    flat = [-v for v, _, _ in nodes] + [0.0] * (ranked.numel() - len(nodes))
    at = B if base is None else base
    vals = [(B + sum(flat[:n])) / cost.step_ms(at + n) for n in range(ranked.numel() + 1)]
    nstar = vals.index(max(vals))
    out = [0] * ranked.shape[0]
    for _, _, b in nodes[:nstar]:
        out[b] += 1
    return out


def test_golden_cut():
    """B = 2 roots, linear cost: the scores 0.9, 0.8 pay, 0.2 and below do not."""
    ranked = rows([[0.9, 0.2], [0.8, 0.1, 0.05]], 4)
    keep = torch.tensor([2, 3])
    table = cost_table(LINEAR, "cpu", 64)
    assert both(ranked, keep, 2, table).tolist() == brute_force(ranked, keep, 2, LINEAR)
    flat = CostModel(((1, 1.0), (4096, 1.0)))  # free tokens: every positive score
    assert both(ranked, keep, 2, cost_table(flat, "cpu", 64)).tolist() == [2, 3]
    assert both(ranked, torch.tensor([1, 0]), 2, cost_table(flat, "cpu", 64)).tolist() == [1, 0]


def test_no_nodes_equal_scores_and_one_request():
    table = cost_table(CostModel.default(), "cpu", 4096)
    assert both(rows([[], []], 3), torch.tensor([0, 0]), 2, table).tolist() == [0, 0]
    ranked = rows([[0.5] * 6, [0.5] * 6], 6)  # ties everywhere: by rank, then request
    keep = torch.tensor([6, 4])
    got = both(ranked, keep, 2, table)
    assert got.tolist() == brute_force(ranked, keep, 2, CostModel.default())
    one = rows([[1.0]], 1)
    assert both(one, torch.tensor([1]), 1, table).tolist() == [1]
    empty = budget_keep(rows([], 4), torch.zeros(0, dtype=torch.int64), 0, table,
                        use_triton=True)
    assert empty.shape == (0,)


def test_random_batches_agree_with_the_brute_force():
    rng = random.Random(0)
    for trial in range(12):
        B, N = rng.randint(1, 9), rng.randint(1, 16)
        ranked = rows([[rng.choice([1.0, 0.99, 0.5, 0.25, rng.random(), rng.random() ** 4])
                        for _ in range(rng.randint(0, N))] for _ in range(B)], N)
        keep = torch.tensor([rng.randint(0, N) for _ in range(B)])
        cost = CostModel.default() if trial % 2 else LINEAR
        table = cost_table(cost, "cpu", B + B * N + 2)
        assert both(ranked, keep, B, table).tolist() == brute_force(ranked, keep, B, cost)


def test_padded_batch_prices_the_real_requests_only():
    """A padded step (num_requests < rows): padding rows have no nodes; the budget is
    priced for the real requests, as the unpadded step of those requests is."""
    table = cost_table(CostModel.default(), "cpu", 4096)
    real = rows([[0.9, 0.7, 0.3], [0.6]], 4)
    keep = torch.tensor([3, 1])
    padded = torch.cat([real, rows([[], []], 4)])
    a = both(real, keep, 2, table)
    b = both(padded, torch.cat([keep, torch.zeros(2, dtype=torch.int64)]), 2, table)
    assert torch.equal(b[:2], a) and b[2:].tolist() == [0, 0]
    assert torch.equal(a, budget_keep_torch(real, keep, 2, table))


def test_rejects_bad_inputs():
    table = cost_table(LINEAR, "cpu", 16)
    good = dict(ranked=rows([[0.5]], 2), keep_n=torch.tensor([1]), num_requests=1, table=table)
    for name, bad in (("ranked", rows([[0.5]], 2).double()), ("ranked", torch.zeros(3)),
                      ("keep_n", torch.tensor([1], dtype=torch.int32)),
                      ("table", table.float()), ("table", torch.zeros(0, dtype=torch.float64)),
                      ("num_requests", -1), ("num_requests", 1.5),
                      ("num_requests", 2 ** 40),
                      ("num_requests", torch.tensor(1, dtype=torch.int32))):
        with pytest.raises(ValueError, match=name):
            budget_keep(**{**good, name: bad}, use_triton=True)


def test_rejects_a_tensor_on_another_device():
    good = dict(ranked=rows([[0.5]], 2), keep_n=torch.tensor([1]),
                num_requests=torch.tensor(1), table=cost_table(LINEAR, "cpu", 16))
    for name in ("keep_n", "table", "num_requests"):
        with pytest.raises(ValueError, match=f"^{name}: on meta"):
            budget_keep(**{**good, name: good[name].to("meta")}, use_triton=True)


def test_the_controllers_batch_budget_names_its_bad_counts():
    scores = torch.tensor([0.9, 0.8, 0.2, 0.1])
    for name, kw in (("max_tokens", dict(max_tokens=-1)), ("max_tokens", dict(max_tokens=1.0)),
                     ("num_requests", dict(num_requests=-1)),
                     ("num_requests", dict(num_requests=2 ** 40))):
        with pytest.raises(ValueError, match=name):
            batch_budget(scores, **{"num_requests": 1, **kw}, cost=LINEAR)
    assert int(batch_budget(scores, 1, LINEAR, max_tokens=0)) == 0


def test_a_negative_request_count_tensor_counts_as_none():
    """(the kernel read the table before its start)"""
    table = cost_table(LINEAR, "cpu", 16).to(DEV)
    ranked, keep = rows([[0.9, 0.8, 0.2]], 3).to(DEV), torch.tensor([3], device=DEV)
    want = budget_keep(ranked, keep, 0, table, use_triton=False)
    for use_triton in (False, True):
        got = budget_keep(ranked, keep, torch.tensor(-1, device=DEV), table,
                          use_triton=use_triton)
        assert torch.equal(got, want), (use_triton, got, want)


def test_a_staircase_is_read_from_its_own_base_at_any_batch():
    """``table_base``: a staircase measured at 8 requests (edges at 8 + 4, 8 + 12 rows) prices
    n nodes at ``table[8 + n]`` whatever the batch: at 3 roots the kernel, the torch path and
    a brute force over that pricing agree, and the cut is an edge in draft nodes (4 or 12),
    where reading ``table[3 + n]`` would cut elsewhere."""
    stairs = CostModel(((8, 2.0), (12, 3.0), (20, 4.0), (40, 9.0)), steps=True, requests=8)
    table = cost_table(stairs, "cpu", 64)
    g = torch.Generator().manual_seed(1)
    cuts = set()
    for i in range(20):
        ranked = torch.rand(3, 6, generator=g).sort(dim=1, descending=True).values
        keep = torch.randint(0, 7, (3,), generator=g)
        ranked, keep_d, table_d = ranked.to(DEV), keep.to(DEV), table.to(DEV)
        want = budget_keep(ranked, keep_d, 3, table_d, table_base=8, use_triton=False)
        n = 3 if i % 2 else torch.tensor(3, device=DEV)  # the roots as an int or on device
        got = budget_keep(ranked, keep_d, n, table_d, table_base=8, use_triton=True)
        assert torch.equal(got, want), (got, want)
        assert want.cpu().tolist() == brute_force(ranked.cpu(), keep, 3, stairs, base=8)
        nstar = int(want.sum())
        assert nstar in (0, 4, 12, int(keep.sum())), nstar
        cuts.add(nstar)
    assert {4, 12} <= cuts, cuts
    with pytest.raises(ValueError, match="table_base"):
        budget_keep(rows([[0.5]], 1), torch.ones(1, dtype=torch.int64), 1, table, table_base=-1)


def test_ties_at_the_cut_never_open_the_next_bucket():
    """A staircase's best cut sits on an edge; nodes tied with the cut's score are kept in
    (best-first rank, request) order up to it, never past it into a bucket the objective
    did not pay for. Repeated and all-equal scores, kernel against torch against the
    brute force."""
    stairs = CostModel(((4, 2.0), (8, 2.2), (12, 3.0), (20, 3.5), (36, 9.0)), steps=True,
                       requests=4)
    table = cost_table(stairs, "cpu", 256)
    cases = [  # (rows, keep): ties straddle the edges at 4, 8 and 16 draft nodes
        ([[0.9, 0.6, 0.6, 0.6], [0.6, 0.6, 0.6], [0.6, 0.6], []], [4, 3, 2, 0]),
        ([[0.7] * 6, [0.7] * 6, [0.7] * 6, [0.7] * 6], [6, 6, 6, 5]),
        ([[1.0, 0.5, 0.5], [1.0, 0.5, 0.5, 0.5, 0.5], [0.5], [0.5, 0.5]], [3, 5, 1, 2]),
        ([[0.3] * 8, [0.3] * 8, [0.3] * 8, [0.3] * 8], [8, 8, 8, 8]),
    ]
    for scores, keep in cases:
        ranked, keep = rows(scores, 8), torch.tensor(keep)
        want = brute_force(ranked, keep, 4, stairs, base=4)
        for n in (4, torch.tensor(4, device=DEV)):
            got = budget_keep(ranked.to(DEV), keep.to(DEV), n, table.to(DEV), table_base=4,
                              use_triton=True).cpu()
            assert got.tolist() == want, (scores, got, want)
        assert budget_keep_torch(ranked, keep, 4, table, 4).tolist() == want
        assert sum(want) in (0, 4, 8, 16, 32, int(keep.sum())), want
    # the second case: 23 nodes of 0.7, the best cut is 16 = 4 ranks of 4 requests
    assert brute_force(rows(cases[1][0], 8), torch.tensor(cases[1][1]), 4, stairs,
                       base=4) == [4, 4, 4, 4]


def test_a_falling_curve_is_flattened_and_no_nodes_keep_nothing():
    """``cost_table`` never falls (a noisy curve's dip would have the budget pay for tokens
    that score nothing and keep fewer); a batch without node columns keeps nothing."""
    falling = CostModel(((1, 1.0), (2, 2.0), (3, 1.0), (5, 1.5)), steps=True)
    table = cost_table(falling, "cpu", 8)
    raw = [falling.step_ms(n) for n in range(9)]  # 1, 1, 2, 1, 1.25, 1.5, ... 2.25
    assert raw[3] < raw[2] and table.tolist() == [max(raw[:n + 1]) for n in range(9)]
    ranked, keep = rows([[0.5, 0.0]], 2), torch.tensor([2])
    got = both(ranked, keep, 1, table)
    assert got.tolist() == [0] == brute_force(ranked, keep, 1, CostModel(
        tuple((n, float(table[n])) for n in range(1, 9)), steps=True))
    for use_triton in (False, True):
        none = budget_keep(torch.zeros(3, 0), torch.zeros(3, dtype=torch.int64), 3,
                           table, use_triton=use_triton)
        assert none.tolist() == [0, 0, 0]


def test_one_compile_per_batch_block():
    """The batch size and the request count are not specialized: batches within one
    power-of-two block share a compile."""
    table = cost_table(LINEAR, DEV, 64 * 9)

    def launch(B, n):
        ranked = rows([[0.5, 0.25]] * B, 8).to(DEV)
        keep = torch.full((B,), 2, dtype=torch.int64, device=DEV)
        return lambda: budget_keep(ranked, keep, n, table, use_triton=True)

    assert assert_one_compile_per_config(
        _budget_keep_kernel, [launch(B, n) for B, n in ((9, 1), (16, 16), (13, 9))]) == 1


def test_kernel_compiles_for_sm90():
    sig = dict(ranked_ptr="*fp32", keep_ptr="*i64", out_ptr="*i64", nreq_ptr="*i64",
               table_ptr="*fp64", nreq_val="i32", table_base="i32", B="i32", N="i32", T="i32",
               NREQ_FROM_PTR="constexpr", HAS_BASE="constexpr", BLOCK_B="constexpr",
               BLOCK_N="constexpr")
    # with the launcher's warps (one child process): no register spills up to 64 requests
    # x 64 nodes; at 128 requests 64 bytes at 32 warps (documented at num_warps), not more.
    # The large blocks read a staircase from its base (HAS_BASE), as under a GPU's cost model.
    usage = compile_all_for_sm90([
        (_budget_keep_kernel, sig, dict(NREQ_FROM_PTR=True, HAS_BASE=B != 16, BLOCK_B=B,
                                        BLOCK_N=N),
         dict(num_warps=num_warps(B * N))) for B, N in ((64, 64), (16, 16), (128, 64))] + [
        # the request count as an int (NREQ_FROM_PTR=False), with and without a base
        (_budget_keep_kernel, sig, dict(NREQ_FROM_PTR=False, HAS_BASE=base, BLOCK_B=64,
                                        BLOCK_N=64), dict(num_warps=num_warps(64 * 64)))
        for base in (False, True)], max_spill_bytes=96)
    assert [u["spill_bytes"] > 0 for u in usage] == [False, False, True, False, False], usage
