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


class _ReplayedGraph:
    """A stand-in for a captured CUDA graph on the CPU: ``replay`` reruns the step into the
    outputs the capture returned (what a graph's replay does to its output buffers)."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        for o, n in zip(self.out, self.fn()):
            o.copy_(n)


def test_captured_buckets_keep_inputs_named_like_their_outputs(monkeypatch):
    """The drafter's commit has an input named ``out``: a bucket's captured outputs must not
    overwrite it (a GPU decoder's first speculative step raised AttributeError on the tuple
    that had taken the input's place). Capture is simulated, so this runs on the CPU."""
    import agspec_gpu.drafter_graphs as dg

    def fake_capture(fn, device, warmup, pool, stream):
        graph = _ReplayedGraph(fn)
        return graph, graph.out

    monkeypatch.setattr(dg, "capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)

    def step(x, out, w, num_requests):
        return _step(x, out, w, num_requests)

    pads = {"x": -1, "out": 0, "w": 7}
    like = {"x": torch.zeros(1, dtype=torch.int64), "out": torch.zeros(1, 4, dtype=torch.int32),
            "w": torch.zeros(1, 3, dtype=torch.int64)}
    g = StepGraphs(step, 4, torch.device("cpu"), pads, use_graphs=True)
    g.prepare([like])
    assert g.graph_error is None
    rng = random.Random(1)
    for _ in range(12):
        B, A = rng.randint(1, 4), rng.randint(0, 5)
        plan = g.plan(B, like, staged=("out",))
        cols = torch.randint(1, 100, (B, A), dtype=torch.int32)
        g.write_columns(plan, "out", cols)
        x, w = torch.randint(0, 100, (B,)), torch.randint(0, 100, (B, 3))
        ox, ocols, ow, n = g.run(plan, {"x": x, "w": w}, clone=rng.random() < 0.5)
        want = torch.zeros(B, 4, dtype=torch.int32)
        want[:, :min(A, 4)] = cols[:, :4]
        assert torch.equal(ox, x) and torch.equal(ocols, want) and torch.equal(ow, w)
        assert (n == B).all()


def test_inputs_may_not_take_a_buckets_own_keys():
    with pytest.raises(ValueError, match="pads: input names \\['graph'\\]"):
        StepGraphs(_step, 4, torch.device("cpu"), {"graph": 0, "x": 1})
