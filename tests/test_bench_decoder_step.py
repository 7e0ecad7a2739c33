"""``bench/bench_decoder_step.py`` on CPU at toy sizes: it completes, speculative and plain
steps for each batch size, every field there (the CPU figures say nothing of a GPU's)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_decoder_step  # noqa: E402  (bench/ is not a package)


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
