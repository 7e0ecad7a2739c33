"""``StepGraphs``' plan / run split on a small step (eager here; the drafter's tests compare
its padded steps with unpadded ones): what a step sees is what it was given, whatever the
bucket's buffers held before."""

import random

import pytest
import torch

from agspec_gpu.drafter_graphs import StepGraphs

PADS = {"x": -1, "cols": 0, "w": 7}


def _step(x, cols, w, num_requests):
    """Echoes its inputs (padded to the bucket) and the request count it was given."""
    return x.clone(), cols.clone(), w.clone(), num_requests.expand(x.shape[0]).clone()


def _like(W: int) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(1, dtype=torch.int64), "cols": torch.zeros(1, W, dtype=torch.int32),
            "w": torch.zeros(1, 3, dtype=torch.int64)}


def test_padded_step_sees_its_inputs_then_padding():
    g = StepGraphs(_step, 8, torch.device("cpu"), PADS, use_graphs=False)
    rng = random.Random(0)
    plans = {}
    for _ in range(60):
        B, A = rng.randint(1, 8), rng.randint(0, 9)  # widths below, at and above W = 6
        plan = plans.setdefault(B, g.plan(B, _like(6), staged=("cols",)))
        assert plan.bucket_size == g.bucket(B) and set(plan.staged) == {"cols"}
        x = torch.randint(0, 100, (B,))
        w = torch.randint(0, 100, (B, 3))
        cols = torch.randint(1, 100, (B, A), dtype=torch.int32)
        g.write_columns(plan, "cols", cols)
        ox, ocols, ow, n = g.run(plan, {"x": x, "w": w}, clone=True)
        want = torch.zeros(B, 6, dtype=torch.int32)
        want[:, :min(A, 6)] = cols[:, :6]
        assert torch.equal(ox, x) and torch.equal(ow, w) and torch.equal(ocols, want)
        assert (n == B).all()
        S = plan.bucket_size  # the rows past B are padding, whatever a larger batch wrote
        buf = plan.buf
        assert (buf["x"][B:S] == -1).all() and (buf["w"][B:S] == 7).all()
        assert (buf["cols"][B:S] == 0).all()


def test_run_checks_inputs_against_the_plan():
    g = StepGraphs(_step, 4, torch.device("cpu"), PADS, use_graphs=False)
    plan = g.plan(2, _like(5), staged=("cols",))
    ok = {"x": torch.zeros(2, dtype=torch.int64), "w": torch.zeros(2, 3, dtype=torch.int64)}
    g.run(plan, ok)
    with pytest.raises(ValueError, match="w: expected torch.int64 \\[2, 3\\]"):
        g.run(plan, {**ok, "w": torch.zeros(1, 3, dtype=torch.int64)})  # would broadcast
    with pytest.raises(ValueError, match="x: expected torch.int64"):
        g.run(plan, {**ok, "x": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(ValueError, match="staged: 'y'"):
        g.plan(2, _like(5), staged=("y",))
    with pytest.raises(ValueError, match="exceed max_batch"):
        g.plan(5, _like(5))
