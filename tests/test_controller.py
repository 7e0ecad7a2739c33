"""The adaptive draft-length controller, the batch budget, role profiling and the cost model.

Every rule of `agspec_gpu.controller` against a hand-computed or brute-force reference:

* ``k_t = min(C_role, max(1, floor(S_t * L_match)))``, or ``static_k``;
* ``S_t * alpha`` on full acceptance, ``S_t * beta`` on rejection, clamped to ``[s_min, s_max]``,
  no update when a fully accepted draft was cut by the cap, none for requests without a draft;
* ``n* = argmax_n (B + cumsum(p)[n-1]) / cost(B + n)``, ties to the smaller ``n``, and a
  steeper cost never yields a larger ``n*``.
"""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agspec_gpu.controller import (
    BUILTIN_ROLES,
    ControllerConfig,
    RoleProfile,
    batch_budget,
    caps_from_curve,
    cost_table,
    draft_depth,
    load_profiles,
    profile_roles,
    update_scale,
)
from agspec_gpu.cost_model import BatchCostModels, CostModel, StepTokenCounts

CFG = ControllerConfig(alpha=1.5, beta=0.5, s_min=0.25, s_max=4.0)


def f32(xs):
    return torch.tensor(xs, dtype=torch.float32)


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


# ---------------------------------------------------------------- draft depth
# scales are dyadic so that S * L is exact in float32 and floor() has one right answer
@pytest.mark.parametrize("scale, match_len, cap, expected", [
    (1.0, 5, 32, 5),       # k = L when S = 1
    (0.5, 5, 32, 2),       # floor(2.5)
    (0.25, 3, 32, 1),      # floor(0.75) = 0 -> at least 1
    (2.0, 0, 32, 1),       # no match still gives k = 1 (max(1, 0))
    (4.0, 10, 24, 24),     # capped by the role
    (1.5, 7, 12, 10),      # floor(10.5)
    (1.75, 8, 14, 14),     # 14 = cap exactly
    (3.0, 1, 1, 1),        # cap 1
])
def test_draft_depth_golden(scale, match_len, cap, expected):
    k = draft_depth(f32([scale]), i32([match_len]), i32([cap]), CFG)
    assert k.dtype == torch.int32
    assert k.tolist() == [expected]


def test_draft_depth_matches_formula_on_a_batch():
    g = torch.Generator().manual_seed(0)
    B = 257
    scale = torch.randint(1, 17, (B,), generator=g).float() / 4  # 0.25 .. 4.0, dyadic
    match_len = torch.randint(0, 65, (B,), generator=g, dtype=torch.int32)
    cap = torch.randint(1, 33, (B,), generator=g, dtype=torch.int32)
    k = draft_depth(scale, match_len, cap, CFG)
    expected = [min(c, max(1, math.floor(s * m)))
                for s, m, c in zip(scale.tolist(), match_len.tolist(), cap.tolist())]
    assert k.tolist() == expected
    assert k.shape == (B,)


def test_static_k_ignores_scale_and_match():
    cfg = ControllerConfig(static_k=8)
    k = draft_depth(f32([0.25, 1.0, 4.0]), i32([0, 3, 50]), i32([32, 32, 32]), cfg)
    assert k.tolist() == [8, 8, 8]
    assert k.dtype == torch.int32


def test_draft_depth_empty_batch():
    assert draft_depth(f32([]), i32([]), i32([]), CFG).shape == (0,)


# ---------------------------------------------------------------- scale update
def test_full_acceptance_expands_by_alpha():
    new = update_scale(f32([1.0, 0.5]), i32([4, 6]), i32([4, 6]), i32([32, 32]), CFG)
    assert new.tolist() == [1.5, 0.75]


def test_accepting_more_than_drafted_counts_as_full():
    # `accepted >= drafted` (a bonus token miscounted as accepted must not read as rejection)
    assert update_scale(f32([1.0]), i32([3]), i32([4]), i32([32]), CFG).tolist() == [1.5]


def test_rejection_contracts_by_beta():
    new = update_scale(f32([1.0, 2.0, 4.0]), i32([4, 8, 5]), i32([0, 7, 2]),
                       i32([32, 32, 32]), CFG)
    assert new.tolist() == [0.5, 1.0, 2.0]


def test_scale_is_clamped():
    up = update_scale(f32([3.0]), i32([4]), i32([4]), i32([32]), CFG)  # 4.5 -> 4.0
    down = update_scale(f32([0.3]), i32([4]), i32([1]), i32([32]), CFG)  # 0.15 -> 0.25
    assert up.tolist() == [CFG.s_max]
    assert down.tolist() == [CFG.s_min]


def test_full_acceptance_cut_by_the_cap_leaves_scale_unchanged():
    # the draft reached the cap: the cap, not S, limited it, so S must not grow
    new = update_scale(f32([1.0, 1.0]), i32([12, 11]), i32([12, 11]), i32([12, 12]), CFG)
    assert new.tolist() == [1.0, 1.5]  # depth 12 == cap: skip; depth 11 < cap: expand


def test_rejection_at_the_cap_still_contracts():
    new = update_scale(f32([1.0]), i32([12]), i32([3]), i32([12]), CFG)
    assert new.tolist() == [0.5]


def test_requests_without_a_draft_keep_their_scale():
    scale = f32([0.25, 1.0, 1.75, 4.0])
    new = update_scale(scale, i32([0, 0, 0, 0]), i32([0, 0, 0, 0]), i32([32] * 4), CFG)
    assert torch.equal(new, scale)


def test_update_scale_mixed_batch():
    scale = f32([1.0, 1.0, 1.0, 1.0, 2.0])
    depth = i32([5, 5, 0, 8, 8])
    acc = i32([5, 2, 0, 8, 0])
    cap = i32([32, 32, 32, 8, 8])
    assert update_scale(scale, depth, acc, cap, CFG).tolist() == [1.5, 0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("kwargs", [dict(alpha=0.9), dict(beta=0.0), dict(beta=1.5),
                                    dict(s_min=0.0), dict(s_min=2.0, s_max=1.0),
                                    dict(static_k=0),
                                    # past the float32 state: inf, 0 or a wrapped int later
                                    dict(alpha=1e39, s_max=float("inf")),
                                    dict(s_min=1e39, s_max=1e39), dict(s_min=1e-46),
                                    dict(static_k=2 ** 31)])
def test_controller_config_validation(kwargs):
    with pytest.raises(ValueError):
        ControllerConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(draft_cap=0), dict(initial_scale=0.0),
                                    dict(initial_scale=1e300), dict(draft_cap=2 ** 31)])
def test_role_profile_validation(kwargs):
    with pytest.raises(ValueError):
        RoleProfile("r", **kwargs)


def test_an_unbounded_scale_still_contracts():
    """``s_max=inf``: the scale grows by alpha at every full acceptance, but stops at
    float32's largest, so a rejection contracts it again (at inf it could not)."""
    cfg = ControllerConfig(alpha=1e3, beta=0.5, s_min=1.0, s_max=float("inf"))
    scale = f32([1e37])
    scale = update_scale(scale, i32([4]), i32([4]), i32([32]), cfg)
    assert scale.isfinite().all() and scale.item() == torch.finfo(torch.float32).max
    scale = update_scale(scale, i32([4]), i32([1]), i32([32]), cfg)
    assert scale.item() == pytest.approx(torch.finfo(torch.float32).max / 2, rel=1e-6)


# ---------------------------------------------------------------- batch budget
def brute_force_nstar(scores: list[float], B: int, cost: CostModel) -> tuple[int, list[float]]:
    """Reference: the smallest n maximising (B + sum(scores[:n])) / cost(B + n)."""
    vals = [(B + sum(scores[:n])) / cost.step_ms(B + n) for n in range(len(scores) + 1)]
    best = max(vals)
    return next(n for n, v in enumerate(vals) if v >= best * (1 - 1e-12)), vals


LINEAR = CostModel(((1, 1.0), (2, 1.5), (1000, 500.0)))  # cost(m) = 0.5 + 0.5 m


def test_batch_budget_golden():
    # B = 1: n=0 -> 1/1; n=1 -> 1.9/1.5 = 1.27; n=2 -> 2.7/2 = 1.35; n=3 -> 2.9/2.5 = 1.16
    n = batch_budget(torch.tensor([0.9, 0.8, 0.2, 0.1]), 1, LINEAR)
    assert n.dim() == 0 and n.dtype == torch.int64
    assert int(n) == 2


def test_batch_budget_all_zero_scores_gives_zero():
    for B in (0, 1, 7, 300):
        for cost in (CostModel.default(), LINEAR):
            assert int(batch_budget(torch.zeros(50), B, cost)) == 0


def test_batch_budget_empty_scores_and_max_tokens():
    assert int(batch_budget(torch.zeros(0), 4, CostModel.default())) == 0
    flat = CostModel(((1, 1.0), (4096, 1.0)))  # free tokens: take every positive score
    assert int(batch_budget(torch.full((10,), 0.5), 2, flat)) == 10
    assert int(batch_budget(torch.full((10,), 0.5), 2, flat, max_tokens=3)) == 3


def test_batch_budget_ties_go_to_the_smaller_n():
    # with a flat cost every extra zero-probability node ties: keep the smaller n
    flat = CostModel(((1, 2.0), (4096, 2.0)))
    assert int(batch_budget(torch.tensor([1.0, 1.0, 0.0, 0.0]), 3, flat)) == 2


def test_batch_budget_matches_brute_force_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        M = int(torch.randint(0, 40, (1,), generator=g))
        B = int(torch.randint(1, 300, (1,), generator=g))
        scores = torch.sort(torch.rand(M, generator=g, dtype=torch.float64),
                            descending=True).values
        cost = CostModel.default() if trial % 2 else LINEAR
        got = int(batch_budget(scores, B, cost))
        ref, vals = brute_force_nstar(scores.tolist(), B, cost)
        # equal objective (within rounding) and never a larger n than the first maximiser
        assert vals[got] >= max(vals) * (1 - 1e-12), (trial, got, ref)
        assert got == ref, (trial, got, ref, vals)


def linear_cost(intercept: float, slope: float) -> CostModel:
    return CostModel(((1, intercept), (4096, intercept + slope * 4095)))


@settings(max_examples=150, deadline=None)
@given(scores=st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=0, max_size=48),
       B=st.integers(1, 256),
       intercept=st.floats(0.5, 50.0),
       slope1=st.floats(0.0, 2.0),
       extra=st.floats(1e-3, 5.0))
def test_batch_budget_steeper_cost_never_takes_more(scores, B, intercept, slope1, extra):
    s = torch.tensor(sorted(scores, reverse=True), dtype=torch.float64)
    c1, c2 = linear_cost(intercept, slope1), linear_cost(intercept, slope1 + extra)
    n1, n2 = int(batch_budget(s, B, c1)), int(batch_budget(s, B, c2))
    if n2 > n1:  # allowed only as a floating-point tie of the objective under c2
        _, vals = brute_force_nstar(s.tolist(), B, c2)
        assert vals[n1] >= vals[n2] * (1 - 1e-12), (n1, n2)


def test_batch_budget_shrinks_as_the_batch_grows():
    # the documented purpose: large batches verify fewer draft tokens per request
    scores = torch.full((4096,), 0.3)
    n_small = int(batch_budget(scores[:64], 1, CostModel.default()))
    n_large = int(batch_budget(scores[:64 * 64], 512, CostModel.default()))
    assert n_small == 64  # memory-bound: every 0.3 token is worth verifying
    assert n_large < 64 * 64 / 4


# ---------------------------------------------------------------- role profiling
@pytest.mark.parametrize("curve, theta, cap", [
    ([0.9, 0.8, 0.6, 0.4, 0.2], 0.5, 3),
    ([0.9, 0.8, 0.6, 0.4, 0.2], 0.1, 5),
    ([0.3, 0.2], 0.5, 1),          # nothing reaches theta: at least 1
    ([], 0.5, 1),
    ([0.9, 0.1, 0.8, 0.05], 0.5, 3),  # max k with P_acc(k) >= theta, not the first drop
    ([0.5, 0.5], 0.5, 2),          # >= theta counts
])
def test_caps_from_curve(curve, theta, cap):
    assert caps_from_curve(curve, theta) == cap


def test_profile_roles_writes_and_loads_json(tmp_path):
    cost = CostModel(((1, 10.0), (33, 13.2), (1000, 100.0)))
    theta = (13.2 - 10.0) / 32 / 10.0  # 0.01 per extra token
    curves = {"coder": [0.9 ** k for k in range(1, 65)],  # 0.9^k >= 0.01 -> k <= 43
              "planner": [0.5 ** k for k in range(1, 33)]}  # 0.5^k >= 0.01 -> k <= 6
    out = tmp_path / "roles.json"
    profiles = profile_roles(curves, cost, out)
    assert profiles == {"coder": RoleProfile("coder", 43), "planner": RoleProfile("planner", 6)}
    obj = json.loads(out.read_text())
    assert obj["theta"] == pytest.approx(theta)
    assert obj["cost_model"] == cost.to_json()
    assert obj["roles"]["coder"]["draft_cap"] == 43
    assert obj["roles"]["planner"]["p_acc"] == curves["planner"]
    # merged over built-in roles: caps from the file, initial scales from the base
    base = {"default": RoleProfile("default", 32, 4.0), "coder": RoleProfile("coder", 32, 2.0)}
    merged = load_profiles(out, base)
    assert merged == {"default": RoleProfile("default", 32, 4.0),
                      "coder": RoleProfile("coder", 43, 2.0),
                      "planner": RoleProfile("planner", 6, 4.0)}
    bad = tmp_path / "bad.json"
    bad.write_text('{"roles": {"coder": {}}}')
    with pytest.raises(ValueError, match="not an agspec-gpu profile"):
        load_profiles(bad)
    assert load_profiles(out) == profiles


def test_profile_roles_default_cost_and_no_file(tmp_path):
    profiles = profile_roles({"reviewer": [1.0] * 16 + [0.0] * 16})
    assert profiles["reviewer"].draft_cap == 16
    assert not list(tmp_path.iterdir())


def test_builtin_roles_are_valid_profiles():
    for name, p in BUILTIN_ROLES.items():
        assert p.name == name and p.draft_cap >= 1


# ---------------------------------------------------------------- cost model
@pytest.mark.parametrize("points", [
    ((1, 1.0),),                      # fewer than two points
    ((4, 1.0), (2, 2.0)),             # not ascending
    ((2, 1.0), (2, 2.0)),             # duplicate
    ((0, 1.0), (2, 2.0)),             # below 1 token
    ((1, 1.0), (2, 0.0)),             # non-positive time
    ((1, -1.0), (2, 2.0)),
])
def test_cost_model_validation(points):
    with pytest.raises(ValueError, match="points"):
        CostModel(points)


def test_cost_model_interpolates_and_extrapolates():
    c = CostModel(((1, 2.0), (11, 4.0), (21, 24.0)))
    assert c.step_ms(1) == 2.0 and c.step_ms(11) == 4.0 and c.step_ms(21) == 24.0
    assert c.step_ms(6) == pytest.approx(3.0)
    assert c.step_ms(16) == pytest.approx(14.0)
    assert c.step_ms(31) == pytest.approx(44.0)     # past the last point: last segment
    assert c.step_ms(0.5) == 2.0 and c.step_ms(-1000) == 2.0  # before the first: its time
    # a measured curve starting at B = 16 requests with a jump to verification: a mean batch
    # of 10.6 requests costs the first point, not an extrapolation of the jump (was ~0)
    h200_b16 = CostModel(((16, 10.6), (17, 20.95), (528, 41.25)))
    assert h200_b16.step_ms(10.6) == 10.6 and h200_b16.step_ms(14.4) == 10.6


def test_cost_model_staircase_prices_a_bucket_by_its_edge():
    """``steps``: a padded bucket's every count costs its right edge (the first point at or
    past it); past the last point the last segment is extrapolated, before the first the
    first point's time, as interpolated."""
    c = CostModel(((1, 2.0), (11, 4.0), (21, 24.0)), steps=True)
    assert [c.step_ms(n) for n in (1, 2, 10, 11, 12, 20.5, 21)] == [2.0, 4.0, 4.0, 4.0, 24.0,
                                                                   24.0, 24.0]
    assert c.step_ms(31) == pytest.approx(44.0) and c.step_ms(0) == 2.0
    with pytest.raises(ValueError, match="steps"):
        CostModel(((1, 2.0), (11, 4.0)), steps=1)
    with pytest.raises(ValueError, match="steps"):
        CostModel.from_json({"points": [[1, 2.0], [11, 4.0]], "steps": "yes"})
    # the batch budget fills the bucket it pays for (tokens before its edge are free): it
    # stops at an edge, or where the draft runs out; interpolated, the same points let it
    # stop inside a bucket it pays for whole
    stairs = CostModel(((4, 2.0), (12, 3.0), (28, 4.0), (60, 6.0)), steps=True)
    ramp = CostModel(stairs.points)
    g = torch.Generator().manual_seed(0)
    inside = 0
    for _ in range(200):
        M = int(torch.randint(1, 60, (), generator=g))
        scores = torch.rand(M, generator=g, dtype=torch.float64).sort(descending=True).values
        n = int(batch_budget(scores, 4, stairs))
        assert n in (0, M) or 4 + n in (12, 28, 60), (n, M)
        n_ramp = int(batch_budget(scores, 4, ramp))
        inside += n_ramp not in (0, M) and 4 + n_ramp not in (12, 28, 60)
    assert inside > 20  # what the staircase fixes


def test_a_staircase_prices_draft_tokens_from_its_measured_batch():
    """``requests``: measured at B = 8 requests, a staircase prices a step of ``b`` requests
    and ``n`` draft tokens at ``8 + n`` (a graph bucket's edges are draft counts); without
    ``num_requests``, or interpolated, at the step's own token count. The replay's step
    counts price each step so where they know its requests."""
    c = CostModel(((8, 2.0), (12, 3.0), (20, 4.0)), steps=True, requests=8)
    assert c.table_base() == 8 and CostModel(c.points, requests=8).table_base() is None
    assert c.step_ms(3 + 4, num_requests=3) == 3.0  # 8 + 4: the first bucket's edge
    assert c.step_ms(3 + 5, num_requests=3) == 4.0  # 8 + 5: the next bucket
    assert c.step_ms(3, num_requests=3) == 2.0 and c.step_ms(7) == 2.0
    counts = StepTokenCounts()
    counts.add(3 + 5, 3)
    counts.add(13)  # no requests: priced at 13 tokens
    assert counts.modelled_ms(c) == pytest.approx(4.0 + 4.0)
    other = StepTokenCounts()
    other.add(2 + 4, 2)
    counts.merge(other)
    assert counts.num_steps == 3 and counts.modelled_ms(c) == pytest.approx(11.0)
    assert counts.modelled_ms(CostModel(c.points)) == pytest.approx(2.0 + 3.125 + 2.0)
    with pytest.raises(ValueError, match="num_requests"):
        counts.add(3, 4)
    with pytest.raises(ValueError, match="requests"):
        CostModel(c.points, requests=-1)
    assert CostModel.from_json(c.to_json()) == c


def test_batch_cost_models_price_a_step_at_its_graph_bucket():
    """Curves measured at 1, 4 and 16 requests: a step of ``b`` requests is priced by the
    smallest measured batch ``>= b`` (the graph bucket it runs in), the largest past them
    and where the requests are unknown; a staircase there prices its draft tokens from
    that bucket's batch."""
    one = CostModel(((1, 1.0), (9, 2.0)), steps=True, requests=1)
    four = CostModel(((4, 3.0), (12, 5.0)), steps=True, requests=4)
    sixteen = CostModel(((16, 10.0), (24, 20.0)), steps=True, requests=16)
    prices = BatchCostModels(((1, one), (4, four), (16, sixteen)))
    assert prices.curve_for(1) is one and prices.curve_for(2) is four
    assert prices.curve_for(4) is four and prices.curve_for(5) is sixteen
    assert prices.curve_for(40) is sixteen and prices.curve_for(None) is sixteen
    assert prices.step_ms(3, num_requests=3) == 3.0  # plain, bucket 4
    assert prices.step_ms(3 + 8, num_requests=3) == 5.0  # 8 drafts: 4 + 8, its edge
    assert prices.step_ms(9 + 8, num_requests=9) == 20.0  # bucket 16: 16 + 8
    counts = StepTokenCounts()
    for t, r in ((1, 1), (3, 3), (3 + 8, 3), (9 + 8, 9), (16, 16)):
        counts.add(t, r)
    assert counts.modelled_ms(prices) == pytest.approx(1.0 + 3.0 + 5.0 + 20.0 + 10.0)
    # one curve for every batch: the old pricing, a drain step at the full batch's price
    assert counts.modelled_ms(BatchCostModels(((16, sixteen),))) == pytest.approx(
        counts.modelled_ms(sixteen)) == pytest.approx(10.0 + 10.0 + 20.0 + 20.0 + 10.0)
    for bad in ((), ((4, four), (1, one)), ((1, one), (1, four)), ((0, one),),
                ((True, one),), ((1, "x"),)):
        with pytest.raises(ValueError, match="curves"):
            BatchCostModels(bad)


def test_cost_model_default_is_monotone():
    c = CostModel.default()
    ts = [c.step_ms(n) for n in range(1, 4097, 7)]
    assert all(a <= b for a, b in zip(ts, ts[1:]))


def test_cost_model_fields_take_numpy_ints_and_name_bad_types():
    """numpy ints (a calibration's batch sizes) are ints here as in every other config;
    points that are no pairs and a source that is no str are named."""
    import numpy as np

    from agspec_gpu.cost_model import BatchCostModels

    c = CostModel(((1, 1.0), (2, 2.0)), requests=np.int64(4), steps=True)
    assert type(c.requests) is int and c.table_base() == 4
    b = BatchCostModels(((np.int64(4), c),))
    assert type(b.curves[0][0]) is int and b.curve_for(3) == c
    for kw, name in ((dict(points=None), "points"), (dict(points=5), "points"),
                     (dict(points=((1, 2.0, 3), (2, 3.0, 4))), "points"),
                     (dict(source=None), "source")):
        with pytest.raises(ValueError, match=name):
            CostModel(**kw)


def test_cost_model_json_round_trip(tmp_path):
    c = CostModel(((1, 2.0), (64, 2.5), (512, 9.0)), source="measured")
    assert CostModel.from_json(c.to_json()) == c
    stairs = CostModel(c.points, "measured, padded buckets", steps=True)
    assert CostModel.from_json(stairs.to_json()) == stairs
    assert CostModel.from_json({"points": [list(p) for p in c.points]}).steps is False
    p = tmp_path / "cost.json"
    p.write_text(json.dumps(c.to_json()))
    assert CostModel.from_json(p) == c
    assert CostModel.from_json(str(p)) == c


def test_cost_files_with_bad_values_are_refused_naming_the_field(tmp_path):
    """Found by an audit: an infinite token count raised a bare OverflowError, a float or
    str one was truncated (a save and load then moved the curve), a bad curve of a
    calibration file named neither its batch nor its field, and "4" / "04" collapsed."""
    p = tmp_path / "cost.json"
    for points, match in [
        ("[[1, 1.0], [Infinity, 2.0]]", "num_tokens must be an int"),
        ("[[1, 1.0], [1e400, 2.0]]", "num_tokens must be an int"),
        ("[[1.7, 1.0], [2.9, 2.0]]", r"points\[0\]: num_tokens must be an int, got 1.7"),
        ('[["3", 1.0], ["5", 2.0]]', "num_tokens must be an int"),
        ("[[true, 1.0], [2, 2.0]]", "num_tokens must be an int"),
        ('[[1, "1.0"], [2, 2.0]]', r"points\[0\]: ms must be a number"),
    ]:
        p.write_text('{"points": %s}' % points)
        for load in (CostModel.from_json, BatchCostModels.from_json):
            with pytest.raises(ValueError, match=f"^cost model {p}: .*{match}"):
                load(p)
    with pytest.raises(ValueError, match="num_tokens must be an int"):
        CostModel(((1.5, 1.0), (2.5, 2.0)))
    c = CostModel(((np.int64(1), np.float32(1.0)), (np.int64(2), 2)))  # plain, and JSON
    assert json.loads(json.dumps(c.to_json()))["points"] == [[1, 1.0], [2, 2.0]]
    good = {"points": [[16, 1.0], [32, 2.0]]}
    for obj, match in [
        ({"curves": {"4": {"source": "x"}}}, r"curves\['4'\]: expected"),
        ({"by_batch_size": {"4": []}}, r"by_batch_size\['4'\]: .*two"),
        ({"by_batch_size": {"x": good["points"]}}, "by_batch_size: batch size 'x' is not an int"),
        ({"curves": {"4": good, "04": good}}, "curves: batch size 4 given twice"),
    ]:
        p.write_text(json.dumps(obj))
        with pytest.raises(ValueError, match=f"^cost model {p}: {match}"):
            BatchCostModels.from_json(p)


def test_replay_figures_price_a_staircase_from_its_base(tmp_path):
    """A staircase measured at 64 requests (the H100 file's B = 64 curve): the replay
    table's single-request and mean-batch figures price drafts from its base, as the
    step-by-step figure does (they read every count below 64 as a plain step: drafts free,
    ``speedup = tau``)."""
    from agspec_gpu.replay_stats import modelled_batch_speedup, modelled_speedup

    c = CostModel(((64, 10.0), (72, 12.0), (80, 14.0), (96, 16.0)), steps=True, requests=64)
    assert modelled_batch_speedup(1.5, 0.5, 40, c) == pytest.approx(1.5 * 10.0 / 16.0)
    assert modelled_speedup(1.5, 0.5, None, c) == pytest.approx(1.5 * 10.0 / 12.0)
    flat = CostModel(((1, 10.0), (100, 20.0)))  # interpolated curves: as before
    assert modelled_batch_speedup(1.5, 0.5, 40, flat) == pytest.approx(
        1.5 * flat.step_ms(40) / flat.step_ms(60))


def test_curve_at_and_old_files_name_what_is_wrong(tmp_path):
    from agspec_gpu.cost_model import curve_at

    p = tmp_path / "cost.json"
    pts = [[1, 1.0], [2, 2.0]]
    p.write_text(json.dumps({"points": pts, "source": "top", "by_batch_size": {"1": pts, "4": pts},
                             "steps": "false"}))
    with pytest.raises(ValueError, match=f"^cost model {p}: .*steps"):
        BatchCostModels.from_json(p)  # a truthy string read as a staircase once
    p.write_text(json.dumps({"points": pts, "source": "top", "by_batch_size": {"1": pts,
                                                                               "4": pts}}))
    assert [c.source for _, c in BatchCostModels.from_json(p).curves] == \
        ["top (by_batch_size[1])", "top (by_batch_size[4])"]
    for bad in (0, 2.7, True, None):
        with pytest.raises(ValueError, match="^batch_size"):
            curve_at(p, bad)


def test_profiles_with_bad_caps_name_the_file(tmp_path):
    p = tmp_path / "roles.json"
    for roles, match in [({"coder": {"draft_cap": 0}}, "draft_cap must be in \\[1, 2\\*\\*31\\)"),
                         ({"coder": {"draft_cap": 3.7}}, "draft_cap"),
                         ({"coder": {"draft_cap": True}}, "draft_cap"),
                         ({"coder": {"draft_cap": "7"}}, "draft_cap"),
                         ({"": {"draft_cap": 4}}, "name")]:
        p.write_text(json.dumps({"roles": roles}))
        with pytest.raises(ValueError, match=f"^profiles {p}: .*{match}"):
            load_profiles(p)
    p.write_text('{"roles": {"coder": {"draft_cap": 1e400}}}')
    with pytest.raises(ValueError, match=f"^profiles {p}: .*draft_cap"):
        load_profiles(p)


def test_batch_budget_reads_a_staircase_past_its_base_in_a_short_table():
    """A caller's table of the documented B + M entries is short for a staircase measured at
    more requests (read at table_base + n): it was read past its end, clamped to the last
    entry (12 nodes kept where the objective keeps 8); now it is rebuilt."""
    stairs = CostModel(((8, 2.0), (12, 3.0), (16, 4.0), (24, 20.0)), steps=True, requests=8)
    scores = torch.full((12,), 0.5, dtype=torch.float64)
    want = int(batch_budget(scores, 3, stairs))
    assert want == 8  # (the objective priced at table_base + n, as the audit brute-forced)
    assert int(batch_budget(scores, 3, stairs, table=cost_table(stairs, "cpu", 15))) == want


def test_step_token_counts_price_each_step():
    c = CostModel(((1, 2.0), (11, 4.0), (21, 24.0)))
    a, b = StepTokenCounts(), StepTokenCounts()
    assert a.num_steps == 0 and a.modelled_ms(c) == 0.0
    for n in (1, 6, 6, 0):
        a.add(n)
    b.add(31)  # past a's histogram: merge grows it
    a.merge(b)
    assert a.num_steps == 5
    assert a.modelled_ms(c) == pytest.approx(2.0 + 3.0 + 3.0 + 2.0 + 44.0)
    # not the mean step's price: the curve is convex past 11 tokens
    assert a.modelled_ms(c) != pytest.approx(5 * c.step_ms((1 + 6 + 6 + 0 + 31) / 5))
    with pytest.raises(ValueError, match="num_tokens"):
        a.add(-1)
    assert a.num_steps == 5


def test_batch_budget_and_step_ms_agree():
    # batch_budget interpolates on the device; the objective must use the same curve
    c = CostModel(((1, 2.0), (11, 4.0), (21, 24.0)))
    for B in (1, 5, 15, 30):
        for M in (0, 3, 10, 25):
            s = torch.linspace(0.9, 0.1, M, dtype=torch.float64)
            ref, _ = brute_force_nstar(s.tolist(), B, c)
            assert int(batch_budget(s, B, c)) == ref, (B, M)
