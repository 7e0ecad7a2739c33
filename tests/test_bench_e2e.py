"""The end-to-end benchmark and its replay-target loop, on CPU with a tiny model.

* the benchmark's ``--device cpu --tiny`` smoke run completes and its JSON has every field
  for every method row (the figures themselves mean nothing on a CPU);
* the replay-target loop counts like the replay evaluator: same sessions, same drafters, the
  same ``tau`` (and the oracle's), whatever the model does;
* after every step each request's paged KV equals a plain prefill of exactly the tokens the
  trajectory says it holds (prefill, tree verification writes, compaction of the accepted
  path and the padded plain-decode step all put the right KV in the right slots).
"""

import csv
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agspec_gpu.cost_model import CostModel
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import HostWriter
from agspec_gpu.replay_target import (
    DecodeGraphs, MetadataPool, OracleProposer, ReplayTargetConfig, _on_device, make_proposer,
    replayed_tokens, run_replay_target,
)
from agspec_gpu.runners.paged import PagedLlamaRunner
from agspec_gpu.runners.verify_graphs import VerifyGraphs
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_e2e  # noqa: E402  (bench/ is not a package)

DEV = Path("/work/shared/data/trajectories/dev")
ROW_FIELDS = ("method", "batch_size", "tokens_per_s", "speedup", "tau", "draft_ms_per_step",
              "verify_ms_per_step", "peak_mem_gb", "modelled_replay_speedup",
              "modelled_verify_ms_per_step", "jit_compiles", "jit_s")


def data_args() -> list[str]:
    """Real sessions: the dev trajectories, else this repository's own git history."""
    if DEV.is_dir():
        return [str(DEV)]
    if (ROOT / ".git").exists():
        return ["--git", str(ROOT)]
    pytest.skip("no trajectories and no git history to build sessions from")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("cl100k")


@pytest.fixture(scope="module")
def short_corpus(tok):
    """Real sessions cut after their first short assistant message (whole sessions would
    replay thousands of steps on a CPU)."""
    if not DEV.is_dir():
        pytest.skip("needs the dev trajectories")
    picked = []
    for s in bench_e2e.round_robin_by_agent(load_paths(DEV, limit=None)):
        msgs = s.messages
        first = next((i for i, m in enumerate(msgs) if m.role == "assistant"), None)
        if first is None or first == 0:
            continue
        if 4 <= len(tok.encode(msgs[first].content)) <= 48:
            picked.append(dataclasses.replace(s, messages=msgs[:first + 1]))
        if len(picked) == 4:
            break
    if len(picked) < 4:
        pytest.skip("not enough short sessions")
    return tokenize_sessions(picked, tok, capture_files=True)


def tiny_runner(max_batch: int, context: int, room: int = 128, std: float = 0.1):
    # room: the message so far plus a draft of the drafter's static max_nodes (64) + root
    config = bench_e2e.make_config("tiny")
    ps = 4
    per_seq = -(-(context + room) // ps)
    runner = PagedLlamaRunner(config, bench_e2e.RandomWeights(config, torch.device("cpu"),
                                                              torch.float32, std=std),
                              num_pages=(max_batch + 2) * per_seq, page_size=ps,
                              max_seqs=max_batch + 2, max_pages_per_seq=per_seq)
    return runner, MetadataPool(max_batch, 64, per_seq, ps, "cpu")


def test_tiny_fills_only_the_options_not_given():
    """--tiny's small defaults fill the options left out; a value given stays, the full
    run's default included (--max-steps 0: every step, not --tiny's 12)."""
    tiny = bench_e2e.parse_args(["x", "--tiny"])
    assert (tiny.max_steps, tiny.messages_per_session, tiny.context, tiny.batch_sizes,
            tiny.sessions) == (12, 2, 256, "1,2", 3)
    given = bench_e2e.parse_args(["x", "--tiny", "--max-steps", "0", "--messages-per-session",
                                  "0", "--context", "4096", "--batch-sizes", "1,16,64"])
    assert (given.max_steps, given.messages_per_session, given.context,
            given.batch_sizes) == (0, 0, 4096, "1,16,64")
    full = bench_e2e.parse_args(["x"])
    assert (full.max_steps, full.context, full.batch_sizes, full.sessions) == \
        (0, 4096, "1,16,64", None)


def test_cpu_smoke_run_writes_every_field(tmp_path):
    out = tmp_path / "e2e.json"
    rc = bench_e2e.main([*data_args(), "--device", "cpu", "--tiny", "--results-dir",
                         str(tmp_path), "--out", str(out), "--profile"])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("gpu", "model", "protocol", "rows", "decode_bandwidth_gbps",
                "decode_bandwidth_fraction", "peak_bandwidth_gbps", "decode_cuda_graphs",
                "verify_cuda_graphs",
                "cost_model", "goals"):
        assert key in report, key
    assert report["gpu"] == "cpu" and report["model"] == "tiny"
    assert report["tree_attention"] == "split"  # the default: the prefix apart from the tree
    assert "teacher forcing" in report["protocol"]
    methods = {r["method"] for r in report["rows"]}
    assert {"none", "pld-hf", "agspec", "agspec-nobudget", "oracle"} <= methods
    assert {r["batch_size"] for r in report["rows"]} == {1, 2}
    for row in report["rows"]:
        for f in ROW_FIELDS:  # (peak GPU memory: none on a CPU, null, not 0)
            assert f in row and (row[f] is not None) != (f == "peak_mem_gb"), (row["method"], f)
        assert row["tokens_per_s"] > 0 and row["tau"] >= 1.0
        assert row["jit_compiles"] == 0  # the torch paths: nothing for Triton to compile
        # the work between requests counted as decode time too: slower, never faster
        assert 0 < row["tokens_per_s_with_messages"] <= row["tokens_per_s"]
        # every drafter phase, hidden behind the device or not (propose ahead within the
        # queued part)
        assert 0 <= row["propose_ahead_ms_per_step"] <= row["drafter_queued_ms_per_step"]
        assert row["drafter_total_ms_per_step"] == pytest.approx(sum(row[k] for k in (
            "draft_ms_per_step", "drafter_commit_ms_per_step", "drafter_queued_ms_per_step",
            "drafter_message_ms_per_step")))
        # the full-batch steps are a subset of the run's (every step at B = 1)
        assert 0 <= row["full_batch_step_share"] <= 1
        if row["batch_size"] == 1:
            assert row["full_batch_step_share"] == 1
            assert row["full_batch_tokens_per_s"] == pytest.approx(row["tokens_per_s"])
            # every step full: the full-batch price is the run's. Both are throughput
            # ratios: --tiny's --max-steps cuts every lane at the same steps, not tokens
            assert row["modelled_full_batch_speedup"] == pytest.approx(
                row["modelled_replay_speedup"])
        if row["method"] == "none":
            assert row["speedup"] == pytest.approx(1.0) and row["tau"] == pytest.approx(1.0)
            assert row["speedup_with_messages"] == pytest.approx(1.0)
            assert row["full_batch_speedup"] == pytest.approx(1.0)
            assert row["modelled_full_batch_speedup"] == pytest.approx(1.0)
            assert row["modelled_replay_speedup"] == pytest.approx(1.0)
    assert set(report["goals"]["full_batch_modelled_agspec_speedup_over_suffix_speedup"]) \
        == {"1", "2"}
    for b in (1, 2):  # the goals read the step-by-step figure
        agspec = next(r for r in report["rows"] if r["method"] == "agspec" and r["batch_size"] == b)
        assert report["goals"]["agspec_measured_over_modelled"][str(b)] == pytest.approx(
            agspec["speedup"] / agspec["modelled_replay_speedup"])
        assert report["goals"]["agspec_verify_measured_over_modelled"][str(b)] == pytest.approx(
            agspec["verify_ms_per_step"] / agspec["modelled_verify_ms_per_step"])
        # the drafter's share counts its commit (host time, within commit ms) and its work
        # between requests (outside the steps) beside propose
        # (and queues most of it, at a step with a draft, before the step's wait for the
        # device: on a CPU, where nothing overlaps, both parts lie within commit ms)
        assert agspec["drafter_commit_ms_per_step"] > 0
        assert (agspec["drafter_queued_ms_per_step"] > 0) == \
            (agspec["plain_step_share"] < 1)
        assert agspec["drafter_commit_ms_per_step"] + agspec[
            "drafter_queued_ms_per_step"] <= agspec["commit_ms_per_step"]
        assert agspec["drafter_message_ms_per_step"] > 0
        # its host time by part, at most the whole (which waits for the device too); a
        # request cut by --max-steps is closed and freed after the loop, not in it
        parts = agspec["message_host_ms_per_step_by_part"]
        assert {"open", "feed"} <= set(parts) <= {"open", "feed", "close", "kv_free"}
        assert min(parts.values()) > 0
        assert sum(parts.values()) <= agspec["drafter_message_ms_per_step"] * 1.0001
        # (the queued part where the step's wait found the device done: on a CPU nearly
        # all, a read there waits for nothing)
        assert 0 <= agspec["drafter_queued_exposed_ms_per_step"] <= \
            agspec["drafter_queued_ms_per_step"]
        assert (agspec["drafter_queued_exposed_ms_per_step"] > 0) == \
            (agspec["drafter_queued_ms_per_step"] > 0)
        assert agspec["draft_share_of_step"] == pytest.approx(
            (agspec["draft_ms_per_step"] + agspec["drafter_commit_ms_per_step"]
             + agspec["drafter_queued_exposed_ms_per_step"]
             + agspec["drafter_message_ms_per_step"]) / agspec["step_ms"])
    with out.with_suffix(".csv").open(newline="") as fh:
        csv_rows = list(csv.DictReader(fh))
    assert list(csv_rows[0])[:2] == ["method", "batch_size"]
    assert len(csv_rows) == len(report["rows"])  # a nested field as JSON, readable back
    assert json.loads(csv_rows[0]["message_host_ms_per_step_by_part"]) == \
        report["rows"][0]["message_host_ms_per_step_by_part"]
    (cost_file,) = tmp_path.glob("cost-tiny-cpu-*.json")  # (dated: a new one keeps the old)
    cost = json.loads(cost_file.read_text())
    assert {"1", "2"} <= set(cost["by_batch_size"]) and len(cost["points"]) >= 2
    assert report["trace"] and Path(report["trace"]).stat().st_size > 0
    trace = json.loads(Path(report["trace"]).read_text())
    names = {e.get("name") for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)}
    # the loop's phases, as torch.profiler ranges (NVTX ranges do not reach the trace)
    assert {"e2e.propose", "e2e.verify", "e2e.commit", "e2e.drafter_commit"} <= names
    # the plain decode step's time by kind: on a CPU, aten ops; the matmuls are there
    kernels = report["decode_kernels"]
    assert kernels["by_kind"]["matmul"]["ms"] > 0 and kernels["calls"] > 0
    assert kernels["busy_ms"] == pytest.approx(sum(k["ms"] for k in kernels["by_kind"].values()))
    assert kernels["top"] and kernels["top"][0]["ms"] >= kernels["top"][-1]["ms"]


def test_a_failing_profiler_costs_the_trace_only(tmp_path, monkeypatch, capsys):
    """The profiled run is a diagnostic: a profiler that raises (CUPTI, the export) leaves
    the timed runs and their rows (it ended the whole run before any row was saved)."""
    class Broken(bench_e2e._StepProfiler):
        def hook(self, step, kv=None):
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(bench_e2e, "_StepProfiler", Broken)
    out = tmp_path / "e2e.json"
    assert bench_e2e.main([*data_args(), "--device", "cpu", "--tiny", "--batch-sizes", "1",
                           "--methods", "none,agspec", "--results-dir", str(tmp_path),
                           "--out", str(out), "--profile"]) == 0
    report = json.loads(out.read_text())
    assert report["trace"] is None and {r["method"] for r in report["rows"]} == {"none", "agspec"}
    assert "CUPTI_ERROR_NOT_INITIALIZED" in capsys.readouterr().out


def test_triton_compiles_counts_and_chains_the_hooks():
    """The counter of compiles in a timed run: counts each compile Triton reports through
    its hooks, still calls hooks set before it (and passes on their answer: True skips a
    compile), and restores them on exit."""
    import triton
    from types import SimpleNamespace

    from triton_compiles import TritonCompiles

    rt = triton.knobs.runtime
    before_test = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    calls = []
    rt.jit_cache_hook = lambda **kw: calls.append(("before", kw["fn"].name)) or False
    rt.jit_post_compile_hook = lambda **kw: calls.append(("after", kw["fn"].name))
    saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    try:
        with TritonCompiles() as jit:
            for name in ("_a_kernel", "_b_kernel"):  # what JITFunction._do_compile calls
                assert not rt.jit_cache_hook(fn=SimpleNamespace(name=name))
                rt.jit_post_compile_hook(fn=SimpleNamespace(name=name))
        assert (jit.count, jit.kernels) == (2, ["_a_kernel", "_b_kernel"])
        assert jit.seconds >= 0.0
        assert calls == [("before", "_a_kernel"), ("after", "_a_kernel"),
                         ("before", "_b_kernel"), ("after", "_b_kernel")]
        assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == saved
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = before_test


@pytest.mark.parametrize("batch_size", [3])
def test_tau_equals_the_replay_evaluators(short_corpus, tok, batch_size):
    """Acceptance is the trajectory's, so the loop's tau is the replay evaluator's."""
    runner, pool = tiny_runner(batch_size, context=48)
    graphs = DecodeGraphs(runner, [1, 2, 4])
    names = ["none", "pld-hf", "agspec"]
    cost = CostModel.default()  # the replay's default, which priced its modelled_ms
    replay = run_replay(short_corpus, names, tok, ReplayConfig(batch_size=batch_size))
    want = {r["drafter"]: r for r in replay.rows if r["agent"] == "all"}
    for name in names + ["oracle"]:
        proposer = make_proposer(name, tok, "cpu", batch_size)
        # the replay evaluator admits sessions in the corpus order (agspec's batch budget
        # depends on which requests share a step)
        cfg = ReplayTargetConfig(batch_size=batch_size, context_tokens=48,
                                 max_message_tokens=None, order="given")
        got = run_replay_target(runner, short_corpus, proposer, cfg, pool=pool, graphs=graphs)
        tau = want["agspec"]["oracle_tau"] if name == "oracle" else want[name]["tau"]
        assert got.tau == pytest.approx(tau), name
        if name != "oracle":  # the same steps, so the replay's modelled time step by step
            assert got.step_tokens.num_steps == got.steps
            assert got.step_tokens.modelled_ms(cost) == pytest.approx(
                want[name]["modelled_ms"]), name
        assert got.messages == want["none"]["messages"]
        assert runner.kv_cache.num_free_pages == runner.kv_cache.num_pages  # all freed


def test_a_run_that_raises_frees_its_requests_kv(short_corpus, tok):
    """A run that raised mid-way (the e2e's profiling run goes on past one) left its
    requests' KV in the runner's shared pool: the next run's requests reuse their ids, and
    a fuller pool would have refused them. Now the pool is as the run found it."""
    runner, pool = tiny_runner(3, context=48)
    graphs = DecodeGraphs(runner, [1, 2, 4])
    cache = runner.kv_cache
    cfg = ReplayTargetConfig(batch_size=3, context_tokens=48, max_message_tokens=None)

    def fail_at_step_3(step, kv):
        if step == 3:
            assert cache.num_free_pages < cache.num_pages  # requests hold KV here
            raise RuntimeError("injected: step 3")

    with pytest.raises(RuntimeError, match="injected"):
        run_replay_target(runner, short_corpus, make_proposer("agspec", tok, "cpu", 3), cfg,
                          pool=pool, graphs=graphs, step_hook=fail_at_step_3)
    assert cache.num_free_pages == cache.num_pages
    res = run_replay_target(runner, short_corpus, make_proposer("agspec", tok, "cpu", 3), cfg,
                            pool=pool, graphs=graphs)
    assert res.steps > 3 and cache.num_free_pages == cache.num_pages


@pytest.fixture(scope="module")
def multi_corpus(tok):
    """Six real sessions, the k-th cut after its ``k % 3 + 1``-th assistant message:
    sessions of one to three requests."""
    if not DEV.is_dir():
        pytest.skip("needs the dev trajectories")
    picked = []
    for s in bench_e2e.round_robin_by_agent(load_paths(DEV, limit=None)):
        ends = [i for i, m in enumerate(s.messages) if m.role == "assistant" and i > 0]
        if len(ends) >= 3:
            cut = ends[len(picked) % 3]
            picked.append(dataclasses.replace(s, messages=s.messages[:cut + 1]))
        if len(picked) == 6:
            break
    return tokenize_sessions(picked, tok, capture_files=True)


@pytest.mark.parametrize("order", ["longest-first", "given"])
def test_sessions_enter_longest_first_and_replay_exactly_their_tokens(multi_corpus, tok, order):
    """``order``: sessions enter the batch by the target tokens the run replays of each
    (``replayed_tokens``, ties in corpus order) or in the corpus order; either way the run
    emits exactly those tokens, and the drafter's work between requests is timed."""
    runner, pool = tiny_runner(2, context=40)
    cfg = ReplayTargetConfig(batch_size=2, context_tokens=40, max_message_tokens=4,
                             messages_per_session=2, order=order)
    sessions = [s for s in multi_corpus.sessions if s.target_messages]
    size = {s.sid: replayed_tokens(s, cfg) for s in sessions}
    assert len(set(size.values())) > 1 and max(size.values()) <= 8
    want = sorted(size, key=lambda sid: -size[sid]) if order == "longest-first" else list(size)
    for name in ("none", "agspec"):
        seen: list[str] = []

        def hook(step, kv):
            for kv_id, _ in kv:
                sid = kv_id.split("#")[0]
                if sid not in seen:
                    seen.append(sid)

        res = run_replay_target(runner, multi_corpus, make_proposer(name, tok, "cpu", 2), cfg,
                                pool=pool, step_hook=hook)
        assert seen == want, name
        assert res.tokens == sum(size.values()), name
        assert res.sessions == len(sessions), name
        assert res.messages == sum(min(len(s.target_messages), 2) for s in sessions), name
        assert res.message_s > 0, name
    with pytest.raises(ValueError, match="order"):
        ReplayTargetConfig(batch_size=2, order="shortest-first")


class DecoyOracle(OracleProposer):
    """The oracle's chain behind a decoy: node 0 is a wrong first token, the true chain is
    nodes 1, 2, ..., so every accepted path sits one slot off and must be compacted."""

    def propose(self, sids, contexts, truth):
        d = super().propose(sids, contexts, truth)
        decoy = torch.from_numpy((truth(1, 0)[:, 0] + 1) % 100_000)[:, None]
        shifted = torch.where(d.parents >= 0, d.parents + 1, d.parents)
        return DraftBatch(torch.cat([decoy.int(), d.token_ids], 1),
                          torch.cat([torch.full_like(decoy.int(), -1), shifted], 1),
                          d.num_draft_tokens + 1)


def make_test_proposer(name, tok, batch_size):
    if name != "decoy":
        return make_proposer(name, tok, "cpu", batch_size)
    base = make_proposer("oracle", tok, "cpu", batch_size)
    return DecoyOracle("decoy", base.drafter, base.store, base.k, "cpu")


@pytest.mark.parametrize("method,padded", [("agspec", False), ("pld-hf", False),
                                           ("decoy", False), ("agspec", True),
                                           ("decoy", True)])
def test_kv_cache_holds_exactly_the_replayed_prefix(short_corpus, tok, method, padded):
    """The KV of every replayed prefix equals a fresh prefill of it, after each step: with
    exact-size verification steps, and with VerifyGraphs' padded buckets (padding requests
    and the sink must leave the real sequences' KV alone)."""
    runner, pool = tiny_runner(3, context=40)
    graphs = DecodeGraphs(runner, [1, 2, 4])  # 3 requests: a padded plain-decode step
    verify = VerifyGraphs(runner, [1, 2, 4], pool.max_nodes) if padded else None
    cache = runner.kv_cache
    checked = []

    def kv_of(seq_id: str, n: int) -> torch.Tensor:
        slots = torch.arange(n)
        pages = cache.page_table([seq_id])[0, slots // cache.page_size].long()
        return cache.data[:, pages, :, slots % cache.page_size]  # [L, n, 2, H_kv, D]

    def check(step: int, kv: list[tuple[str, np.ndarray]]) -> None:
        for seq_id, tokens in kv:
            if len(tokens) < 2:
                continue
            runner.prefill(["__ref"], [tokens.tolist()])
            torch.testing.assert_close(kv_of(seq_id, len(tokens)), kv_of("__ref", len(tokens)),
                                       atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"step {step}, {seq_id}: {m}")
            cache.free("__ref")
            checked.append(len(tokens))

    proposer = make_test_proposer(method, tok, 3)
    cfg = ReplayTargetConfig(batch_size=3, context_tokens=40, max_message_tokens=None,
                             max_steps=10)
    res = run_replay_target(runner, short_corpus, proposer, cfg, pool=pool, graphs=graphs,
                            verify_graphs=verify, step_hook=check)
    assert res.steps == 10 and len(checked) >= 10
    if method != "pld-hf":  # drafts were accepted and compacted, not only plain steps
        assert res.accepted > 0


def test_host_drafts_reach_the_device_in_one_staged_copy(monkeypatch):
    """The replay loop moves a host drafter's tree (PLD, SuffixDecoding) to the verifier's
    device through the step's ``HostWriter``: the same trees (ragged, empty, padded), one
    write of the three tensors; a draft already there is passed as is. On the CPU the
    writer's device is set to another's so that the staging runs (on a GPU:
    ``tests/test_gpu.py``)."""
    draft = DraftBatch.from_lists([[(5, -1), (7, 0), (9, -1)], [], [(3, -1)]])
    writer = HostWriter(1 << 10, "cpu")
    assert _on_device(draft, writer) is draft
    monkeypatch.setattr(writer, "device", torch.device("meta"))
    writes = []
    write = writer.write
    monkeypatch.setattr(writer, "write", lambda *g: writes.append(len(g)) or write(*g))
    moved = _on_device(draft, writer)
    assert writes == [3]
    for f in ("token_ids", "parents", "num_draft_tokens"):
        a, b = getattr(moved, f), getattr(draft, f)
        assert a.dtype == torch.int32 and torch.equal(a, b), f


def test_metadata_pool_trims_rows_and_rejects_oversized_steps():
    pool = MetadataPool(4, 8, 5, 16, "cpu")
    assert pool.rows(5).capacity_q == 8 and pool.rows(16).capacity_q == 16
    assert pool.rows(36).capacity_q == 36  # the whole pool: 4 * (8 + 1)
    assert pool.rows(3) is pool.rows(8)  # one object per capacity: the planner keeps its views
    with pytest.raises(ValueError, match="exceeds"):
        pool.rows(37)


def test_random_weights_are_deterministic_and_lazy():
    config = bench_e2e.make_config("tiny")
    w = bench_e2e.RandomWeights(config, torch.device("cpu"), torch.float32, seed=3)
    a, b = w["model.layers.1.mlp.up_proj.weight"], w["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(a, b) and a.shape == (128, 64)
    assert torch.equal(w["model.norm.weight"], torch.ones(64))
    assert not torch.equal(a, w["model.layers.0.mlp.up_proj.weight"])
    assert "model.layers.0.self_attn.q_proj.bias" not in w  # Llama: no attention bias
    qwen = bench_e2e.make_config("qwen2.5-coder-7b")
    names = set(bench_e2e.RandomWeights(qwen, torch.device("cpu"), torch.bfloat16))
    assert "model.layers.27.self_attn.v_proj.bias" in names and len(names) == 3 + 28 * 12


def test_calibration_context_is_the_replayed_steps_and_decode_bytes_copies_nothing(tmp_path):
    """The cost model is calibrated at the KV length the replayed tokens are decoded at
    (each message's start, capped at --context, then its own tokens), not at the cap; the decode byte count reads the runner's
    weights where they are (``dataclasses.astuple`` cloned every tensor: 15 GB at 8B)."""
    from agspec_gpu.trajectories import Message, Session

    tok = load_tokenizer("cl100k")
    msgs = (Message("user", "word " * 40), Message("assistant", "a b c"),
            Message("tool", "word " * 200), Message("assistant", "d e f"))
    corpus = tokenize_sessions([Session("s", "mini-swe-agent", "", "t", msgs)], tok)
    s = corpus.sessions[0]
    starts = [int(s.bounds[i]) for i in s.target_messages]
    sizes = [int(s.bounds[i + 1] - s.bounds[i]) for i in s.target_messages]

    def mean(caps, cut=None):  # every decoded token's KV length, by brute force
        kv = [c + j for c, n in zip(caps, sizes) for j in range(min(n, cut or n))]
        return round(sum(kv) / len(kv))

    assert sizes[0] > 1 and bench_e2e.replay_context_tokens(corpus, 1, 10_000) == \
        round(starts[0] + (sizes[0] - 1) / 2)
    assert bench_e2e.replay_context_tokens(corpus, None, 10_000) == mean(starts)
    assert bench_e2e.replay_context_tokens(corpus, None, 100) == mean(
        [min(x, 100) for x in starts])
    assert bench_e2e.replay_context_tokens(corpus, None, 100, 1) == round(
        (min(starts[0], 100) + 100) / 2)
    runner, _ = tiny_runner(2, 16)
    fields = [runner.lm_head, runner.final_norm] + [
        getattr(layer, f.name) for layer in runner.layers for f in dataclasses.fields(layer)]
    weights = sum(x.numel() * x.element_size() for x in fields if x is not None)
    assert bench_e2e.decode_bytes(runner, 0) == weights > 0
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    import unittest.mock as mock
    with mock.patch.object(dataclasses, "astuple", side_effect=AssertionError("copies")):
        assert bench_e2e.decode_bytes(runner, 10, batch=2) > weights
    assert before is None or torch.cuda.memory_allocated() == before
    (tmp_path / "x.json").write_text("old")
    bench_e2e.write_atomic(tmp_path / "x.json", "new")
    assert (tmp_path / "x.json").read_text() == "new"
    assert not (tmp_path / "x.json.tmp").exists()


def test_batch_cost_models_round_trip_each_curve_whole(tmp_path):
    """``to_json`` / ``from_json`` keep every curve's points, source, staircase and
    requests (a mix of an eager curve and staircases); a malformed file is a ValueError
    naming it, not an AttributeError."""
    from agspec_gpu.cost_model import BatchCostModels, CostModel

    cost = BatchCostModels((
        (1, CostModel(((1, 5.0), (9, 6.0)), "eager at 1")),
        (8, CostModel(((8, 7.0), (16, 9.0)), "graphs at 8", steps=True, requests=8)),
        (16, CostModel(((16, 8.0), (24, 9.5)), "graphs, no requests", steps=True))))
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(cost.to_json()))
    assert BatchCostModels.from_json(path) == cost
    assert BatchCostModels.from_json(cost.to_json()) == cost
    for bad in ({"by_batch_size": [1, 2]}, {"curves": {"1": {"points": "x"}}}, {}, []):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"cost model {path}"):
            BatchCostModels.from_json(path)


def test_a_saved_calibration_loads_every_batch_and_its_staircase(tmp_path):
    """``--cost-model``: every batch the file measured (the drain's buckets priced there),
    each requested batch (where none was measured, the curve of the smallest measured batch
    above it, else of the largest: not the top level's, a 1-request curve whose first draft
    token is nearly free at 16 requests), and a staircase
    from its own batch where the curves came through the verification graphs -- also in a
    file from before the ``steps`` field, which says so by ``verify_cuda_graphs``."""
    obj = {"points": [[1, 5.0], [9, 6.0]], "source": "test", "verify_cuda_graphs": True,
           "by_batch_size": {"1": [[1, 5.0], [9, 6.0]], "4": [[4, 7.0], [12, 9.0]]}}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(obj))
    got = bench_e2e.load_cost_models(path, [1, 2, 16])
    assert sorted(got) == [1, 2, 4, 16]
    assert got[4].steps and got[4].requests == 4 and got[4].points == ((4, 7.0), (12, 9.0))
    assert got[2] == got[4] and got[16] == got[4]  # none measured there: 4's (above, or
    # the largest), as a step of 2 or 16 requests is priced without them (size_for)
    assert got[4].step_ms(2 + 8, num_requests=2) == 9.0  # 4 + 8: the bucket's edge
    path.write_text(json.dumps({**obj, "verify_cuda_graphs": False}))
    assert not any(c.steps for c in bench_e2e.load_cost_models(path, [1]).values())
    path.write_text(json.dumps({**obj, "steps": False}))  # the field, where present, rules
    assert not bench_e2e.load_cost_models(path, [1])[4].steps


def test_a_batch_between_graph_buckets_is_priced_by_the_measured_curve():
    """A run at ``--batch-sizes 3,4`` calibrates the buckets 1, 2 and 4: a step of 3
    requests (padded to 4 on a GPU) is priced by 4's measured curve (it once got the
    built-in 8B estimate, which then steered agspec's budget at B = 3 too); the built-in
    estimate only where nothing was measured."""
    from agspec_gpu.cost_model import CostModel

    measured = {b: CostModel(((b, 100.0 + b), (b + 64, 200.0 + b)), f"measured at {b}",
                             steps=True, requests=b) for b in (1, 2, 4)}
    curves, prices = bench_e2e.step_prices(dict(measured), [3, 4])
    assert curves == measured
    assert prices.curve_for(3) == measured[4] and prices.step_ms(3 + 10, 3) == \
        measured[4].step_ms(3 + 10, num_requests=3)
    curves, prices = bench_e2e.step_prices({}, [3, 4])
    assert sorted(curves) == [3, 4] and prices.curve_for(3) == CostModel.default()


def test_warm_suffix_decoding_holds_the_other_halfs_responses(tmp_path):
    """The e2e's `suffix-decoding-warm` ran with an empty cache (the name was accepted and
    nothing filled it) while agspec drafted from the other half's global corpus: now it
    holds that half's responses, and without --half it is refused."""
    from agspec_gpu.baselines import suffix_decoding_available
    from agspec_gpu.replay_target import make_proposer
    from agspec_gpu.tiers import session_half

    if not suffix_decoding_available():
        pytest.skip("needs arctic-inference")
    aider = DEV / "aider__chat_history.jsonl.gz"
    if not aider.exists():
        pytest.skip("needs the dev trajectories")
    tok = load_tokenizer("cl100k")
    args = bench_e2e.parse_args([str(aider), "--half", "1"])
    warm = bench_e2e.other_half_responses(args, tok)
    half0 = [s for s in load_paths(aider, limit=None) if session_half(s.task_id) == 0]
    assert len(warm) == sum(m.role == "assistant" for s in half0 for m in s.messages) > 0
    with pytest.raises(ValueError, match="suffix-decoding-warm: no earlier traffic"):
        make_proposer("suffix-decoding-warm", tok, "cpu", 2)
    proposer = make_proposer("suffix-decoding-warm", tok, "cpu", 2, warm_responses=warm)
    assert proposer.drafter.cache_responses(()) == len(warm)  # (adds none: reports them)
    out = tmp_path / "e2e.json"
    assert bench_e2e.main([str(aider), "--device", "cpu", "--tiny", "--half", "1",
                           "--methods", "none,suffix-decoding,suffix-decoding-warm",
                           "--results-dir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["method"] for r in report["rows"]} == {"none", "suffix-decoding",
                                                     "suffix-decoding-warm"}
    assert "agspec_speedup_over_warm_suffix_speedup" in report["goals"]
    for methods in ("none,suffix-decoding-warm", ",".join(bench_e2e.DEFAULT_METHODS)):
        with pytest.raises(SystemExit, match="suffix-decoding-warm needs --half"):
            bench_e2e.main([str(aider), "--device", "cpu", "--tiny", "--methods", methods,
                            "--results-dir", str(tmp_path)])  # asked for: refused, not skipped
