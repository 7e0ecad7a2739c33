"""The bench/ scripts without a test of their own, on CPU at toy sizes: each completes and
writes every field it promises (the CPU figures themselves say nothing of a GPU's).

* ``bench_verify_kernels``: a row per operation and batch size, acceptance on the flat and the
  padded layouts agreeing (the script asserts it);
* ``bench_decoder_step``: speculative and plain steps for each batch size;
* ``bench_layer_kernels``, ``bench_match``: a row per kernel (torch only on a CPU), per size,
  batch and method; ``bench_drafter_step``: a row per batch size (eager on a CPU);
* ``bench_host_staging``: a row per case and batch size, old and new timed;
* ``bench_launch_overhead``: a row per launch and batch size, the kernels stubbed (and put
  back after). The device script runs all of them on the H200.
* ``bench_drafter_host``: a row per batch size, the drafter's match and graph steps stubbed
  (and its match put back after).
* ``gap_by_match``: per dev file, rows by match length whose step shares add up to one;
  ``bench_drafter``: the matrix's rows beside plain decoding and the oracle bound;
  ``bench_frontier``: every family's points (agspec, SuffixDecoding, both PLDs, none) beside
  the oracle bound, which is above the agspec and PLD points.
* ``bench_tree_attention``: the split backend (prefix unmasked, the tree kernel merging the
  tree) equals the custom-mask backend, at page-aligned and unaligned prefixes.
* ``bench_message_ops``: a row per boundary call and level build, the kernel's fewer.
* ``bench_suffix_array``: a row per window (the torch path on a CPU: the kernel's compare
  with it runs on a GPU).
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_decoder_step  # noqa: E402  (bench/ is not a package)
import bench_drafter  # noqa: E402
import bench_drafter_host  # noqa: E402
import bench_drafter_step  # noqa: E402
import bench_frontier  # noqa: E402
import gap_by_match  # noqa: E402
import bench_host_staging  # noqa: E402
import bench_launch_overhead  # noqa: E402
import bench_layer_kernels  # noqa: E402
import bench_match  # noqa: E402
import bench_message_ops  # noqa: E402
import bench_suffix_array  # noqa: E402
import bench_tree_attention  # noqa: E402
import bench_verify_kernels  # noqa: E402


def test_bench_verify_kernels_smoke(tmp_path):
    out = tmp_path / "vk"
    assert bench_verify_kernels.main([
        "--device", "cpu", "--batch-sizes", "1,3", "--nodes", "5", "--accept", "2",
        "--context", "37", "--vocab", "101", "--layers", "2", "--repeats", "1",
        "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    ops = ("plan", "accept-flat", "accept-padded", "kv_compact")
    assert [(r["op"], r["batch_size"]) for r in rows] == [(o, b) for b in (1, 3) for o in ops]
    assert all(r["torch_us"] > 0 and r["triton_us"] is None for r in rows)
    # the argmax follows each chain for 2 nodes (no random row outbids the planted 100.0)
    assert all(r["mean_accepted"] == 2.0 for r in rows if r["op"].startswith("accept"))


def test_bench_decoder_step_smoke(tmp_path):
    out = tmp_path / "ds"
    assert bench_decoder_step.main([
        "--device", "cpu", "--batch-sizes", "1,2", "--layers", "1", "--hidden", "128",
        "--prompt-tokens", "120", "--warmup", "1", "--steps", "2", "--profile-steps", "1",
        "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["batch_size"], r["speculate"]) for r in rows] == [
        (1, True), (1, False), (2, True), (2, False)]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["cpu_ops_per_step"] > 0
        # a plain step emits one token per request, a speculative one at least one
        assert r["tokens_per_request_step"] >= 1.0
        assert r["speculate"] or r["tokens_per_request_step"] == 1.0


def test_bench_layer_kernels_and_match_smoke(tmp_path):
    assert bench_layer_kernels.main([
        "--device", "cpu", "--rows", "4", "--hidden", "256", "--heads", "4,2",
        "--head-dim", "64", "--intermediate", "512", "--repeats", "2",
        "--out", str(tmp_path / "lk")]) == 0
    rows = json.loads((tmp_path / "lk.json").read_text())["results"]
    assert {r["op"] for r in rows} == {"add_rms_norm", "rope_qk", "rope_append", "silu_mul"}
    # kernels are counted on a GPU only (torch.profiler's device activities)
    assert all(r["torch_us"] > 0 and r["torch_kernels"] is None and r["triton_kernels"] is None
               for r in rows)
    assert bench_match.main([
        "--device", "cpu", "--sizes", "32K", "--batch", "1,4", "--repeats", "2",
        "--max-depth", "32", "--no-unfold", "--no-suffix-decoding",
        "--out", str(tmp_path / "m")]) == 0
    rows = json.loads((tmp_path / "m.json").read_text())["results"]
    assert {(r["batch"], r["method"]) for r in rows} >= {(1, "agspec"), (4, "agspec")}
    assert all(r["median_ms"] > 0 and r["size"] == 32768 for r in rows)


def test_bench_host_staging_smoke(tmp_path):
    assert bench_host_staging.main(["--device", "cpu", "--batch-sizes", "1,3", "--steps", "8",
                                    "--out", str(tmp_path / "hs")]) == 0
    rows = json.loads((tmp_path / "hs.json").read_text())["results"]
    assert {(r["case"], r["batch_size"]) for r in rows} == {
        (c, b) for c in ("match_lists", "observe_lists", "page_alloc", "match_grid")
        for b in (1, 3)}
    assert all(r[k] > 0 for r in rows for k in ("old_host_us", "new_host_us",
                                                 "old_synced_us", "new_synced_us"))


def test_bench_launch_overhead_smoke(tmp_path):
    from agspec_gpu.kernels import suffix_match_triton

    kernel = suffix_match_triton._suffix_match_kernel
    assert bench_launch_overhead.main(["--device", "cpu", "--batch-sizes", "1,2", "--rounds",
                                       "2", "--calls", "3", "--out", str(tmp_path / "lo")]) == 0
    rows = json.loads((tmp_path / "lo.json").read_text())["results"]
    assert {(r["launch"], r["batch_size"]) for r in rows} == {
        (c, b) for c in ("suffix_match", "greedy_tree_accept", "plan_tree", "kv_compact")
        for b in (1, 2)}
    assert all(r["host_us"] > 0 and r["kernel"].startswith("no-op") for r in rows)
    assert suffix_match_triton._suffix_match_kernel is kernel  # the kernels are put back


@pytest.mark.skipif(not Path(bench_drafter_step.DEV).is_dir(), reason="no dev trajectories")
def test_bench_drafter_step_smoke(tmp_path, monkeypatch):
    out = tmp_path / "dstep"
    monkeypatch.setattr(sys, "argv", [
        "bench_drafter_step.py", "--device", "cpu", "--sessions", "1",
        "--max-target-tokens", "40", "--batch-sizes", "1", "2", "--warmup-steps", "2",
        "--out", str(out)])
    bench_drafter_step.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["variant"], r["batch_size"]) for r in rows] == [("eager", 1), ("eager", 2)]
    for r in rows:
        assert r["steps"] > 0 and r["propose_ms_median"] > 0 and r["commit_ms_median"] > 0
        assert r["tau"] >= 1.0 and r["cpu_ops_per_step"] > 0


@pytest.mark.skipif(not Path(bench_drafter_step.DEV).is_dir(), reason="no dev trajectories")
def test_bench_drafter_host_smoke(tmp_path):
    import agspec_gpu.drafter as drafter_mod

    match = drafter_mod.suffix_match
    assert bench_drafter_host.main(["--batch-sizes", "1,2", "--steps", "8", "--prompt-tokens",
                                    "100", "--out", str(tmp_path / "dh")]) == 0
    rows = json.loads((tmp_path / "dh.json").read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["steps"] == 8 and all(r[f"{k}_us_{s}"] > 0 for k in ("propose", "commit", "step")
                                       for s in ("median", "mean"))
    assert drafter_mod.suffix_match is match  # put back


COST = Path(__file__).resolve().parents[1] / "bench/results/" \
    "cost-llama3-8b-h100-80gb-hbm3-20261205.json"  # a GPU's calibrated staircase


@pytest.mark.skipif(not Path(bench_drafter_step.DEV).is_dir(), reason="no dev trajectories")
def test_gap_by_match_smoke(tmp_path, monkeypatch):
    out = tmp_path / "gap.json"
    cost = COST
    monkeypatch.setattr(sys, "argv", ["gap_by_match.py", "--sessions", "2",
                                      "--max-target-tokens", "200", "--batch-size", "2",
                                      "--cost-model", str(cost), "--json", str(out)])
    costs = []  # the cost model each drafter steers its batch budget by

    class Recorded(gap_by_match.Drafter):
        def __init__(self, *a, cost=None, **k):
            costs.append(cost)
            super().__init__(*a, cost=cost, **k)

    monkeypatch.setattr(gap_by_match, "Drafter", Recorded)
    reports = []  # the replay's own tau, which the script's must equal (no bonus past the end)

    def run_replay(*a, **k):
        reports.append(gap_by_match.run_replay.__wrapped__(*a, **k))
        return reports[-1]

    run_replay.__wrapped__ = gap_by_match.run_replay
    monkeypatch.setattr(gap_by_match, "run_replay", run_replay)
    gap_by_match.main()
    want = gap_by_match.BatchCostModels.from_json(cost)
    assert len(costs) == 3 and all(c == want for c in costs)
    assert want.curve_for(2) != gap_by_match.CostModel.default()
    files = json.loads(out.read_text())["files"]
    assert len(files) == 3
    for f, report in zip(files.values(), reports):
        (row,) = [r for r in report.rows if r["drafter"] == "agspec" and r["agent"] == "all"]
        assert f["tau"] == pytest.approx(row["tau"])
        assert f["steps"] > 0 and f["tau"] >= 1.0 and f["oracle_tau_same_steps"] >= f["tau"]
        assert sum(r["step_share"] for r in f["rows"]) == pytest.approx(1.0)
        assert all(r["depth"] <= r["drafted"] + 1e-9 for r in f["rows"])


@pytest.mark.skipif(not Path(bench_drafter_step.DEV).is_dir(), reason="no dev trajectories")
def test_bench_drafter_smoke(tmp_path, monkeypatch):
    out = tmp_path / "bd.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_drafter.py", "--sessions", "1", "--max-target-tokens", "60", "--batch-sizes",
        "2", "--variants", '[("none", None), ("controller-tree-budget", {})]',
        "--cost-model", str(COST), "--json", str(out)])
    costs = []  # what each drafter's budget steers by

    class Recorded(bench_drafter.Drafter):
        def __init__(self, *a, cost=None, **k):
            costs.append(cost)
            super().__init__(*a, cost=cost, **k)

    monkeypatch.setattr(bench_drafter, "Drafter", Recorded)
    bench_drafter.main()
    from agspec_gpu.cost_model import BatchCostModels, CostModel

    want = BatchCostModels.from_json(COST).curve_for(2)
    assert costs == [want] and want != CostModel.default()
    assert json.loads(out.read_text())["config"]["cost_model"] == want.to_json()
    rows = {r["drafter"]: r for r in json.loads(out.read_text())["results"]
            if r["agent"] == "all"}
    agspec, none = rows["controller-tree-budget"], rows["none"]
    assert none["modelled_replay_speedup"] == pytest.approx(1.0)
    assert agspec["oracle_tau"] >= agspec["tau"] > 1.0 and agspec["mean_batch"] <= 2
    assert agspec["modelled_replay_speedup"] > 0 and agspec["commit_us_per_step"] > 0



@pytest.mark.skipif(not Path(bench_drafter_step.DEV).is_dir(), reason="no dev trajectories")
def test_bench_frontier_smoke(tmp_path, monkeypatch):
    from agspec_gpu.baselines import suffix_decoding_available
    from agspec_gpu.tiers import build_global_corpus
    from agspec_gpu.tokenizer import load_tokenizer

    if not suffix_decoding_available():
        pytest.skip("arctic-inference is not installed")
    f = "aider__chat_history.jsonl.gz"  # the smallest dev file: its half 0 is the global tier
    glob, out = tmp_path / "g.agspec", tmp_path / "fr.json"
    build_global_corpus([], load_tokenizer("cl100k"), glob,
                        trajectories=[bench_frontier.DEV + f], half=0)
    monkeypatch.setattr(sys, "argv", [
        "bench_frontier.py", "--global", str(glob), "--half", "1", "--files", f,
        "--sessions", "2", "--max-target-tokens", "60", "--batch-size", "2",
        "--agspec-min-prob", "0.1", "--agspec-nobudget-min-prob", "--sd-min-token-prob",
        "0.1", "--sd-spec-factor", "1", "--pld-hf-tokens", "2", "10", "--pld-vllm-k", "5",
        "--pld-vllm-ngram", "1", "--json", str(out)])
    bench_frontier.main()
    (res,) = json.loads(out.read_text())["files"].values()
    rows = {r["point"]: r for r in res["rows"]}
    assert {p: r["family"] for p, r in rows.items()} == {
        "none": "none", "pld-hf-n2-k2": "pld-hf", "pld-hf-n2-k10": "pld-hf",
        "pld-vllm-n1-k5": "pld-vllm", "sd-f1-p0.1": "suffix-decoding",
        "sdw-f1-p0.1": "suffix-decoding-warm", "agspec-p0.1": "agspec"}
    assert rows["pld-vllm-n1-k5"]["settings"] == {"prompt_lookup_min": 1,
                                                  "prompt_lookup_max": 1, "k": 5}
    none = rows["none"]
    assert none["tau"] == 1.0 and none["acceptance_rate"] is None
    assert none["modelled_replay_speedup"] == pytest.approx(1.0)
    for p in ("pld-hf-n2-k2", "pld-hf-n2-k10", "pld-vllm-n1-k5"):
        k = rows[p]["settings"].get("num_output_tokens", rows[p]["settings"].get("k"))
        assert rows[p]["tau"] > 1.0 and 0 < rows[p]["drafted_per_step"] <= k
        assert 0 <= rows[p]["acceptance_rate"] <= 1
    # one oracle pass over agspec's corpora, beside every row; it bounds the drafters whose
    # drafts come from those corpora (agspec; PLD: the session's own text), not
    # SuffixDecoding, whose cache holds other sessions' responses
    oracle = res["oracle_tau"]
    assert oracle > 1.0 and all(r["oracle_tau"] == oracle for r in rows.values())
    for r in rows.values():
        assert r["tau_over_oracle"] == pytest.approx(r["tau"] / oracle)
        if not r["family"].startswith("suffix-decoding"):
            assert oracle >= r["tau"], r["point"]
    # each point held against the baselines' best at a precision no higher than its own
    for r in rows.values():
        if r["family"] in ("agspec", "pld-hf", "pld-vllm") and r["acceptance_rate"]:
            for fam, key in (("suffix-decoding", "sd"), ("suffix-decoding-warm", "sd_warm")):
                ok = [b["tau"] for b in rows.values() if b["family"] == fam
                      and b["acceptance_rate"] is not None
                      and b["acceptance_rate"] <= r["acceptance_rate"]]
                assert r[f"{key}_best_tau_at_rate"] == (max(ok) if ok else None)
    assert bench_frontier.best_at_most([(0.1, 1.3), (0.3, 1.2), (0.05, 1.6)], 0.2) == 1.6
    assert bench_frontier.best_at_most([(0.1, 1.3)], 0.05) is None


def test_bench_tree_attention_smoke(tmp_path):
    for context in (48, 37):  # a prefix ending on a page boundary, and inside a page
        out = tmp_path / f"ta{context}"
        assert bench_tree_attention.main(["--device", "cpu", "--context", str(context),
                                          "--batch-sizes", "1,3", "--nodes", "6",
                                          "--qo-heads", "4", "--kv-heads", "2",
                                          "--head-dim", "16", "--out", str(out)]) == 0
        rows = json.loads(out.with_suffix(".json").read_text())["results"]
        assert [r["batch_size"] for r in rows] == [1, 3]
        assert all(r["max_abs_diff"] < 1e-5 for r in rows), rows



def test_bench_suffix_array_smoke(tmp_path):
    out = tmp_path / "sa"
    assert bench_suffix_array.main(["--device", "cpu", "--windows", "50,300", "--repeats",
                                    "2", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["window"], r["path"]) for r in rows] == [(50, "torch"), (300, "torch")]
    assert all(r["host_us"] > 0 and r["activities"] > 0 and r["device_us"] is None
               for r in rows)


def test_bench_message_ops_smoke(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the dev files' default path is the repository's
    out = tmp_path / "mo"
    assert bench_message_ops.main(["--sessions", "3", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    by = {(r["call"], r["level_build"]): r["launches_per_call"] for r in rows}
    for call in ("open_session", "extend", "close_session"):
        assert 0 < by[(call, "kernel")] <= by[(call, "torch")], call
    assert by[("open_session", "kernel")] < by[("open_session", "torch")]
