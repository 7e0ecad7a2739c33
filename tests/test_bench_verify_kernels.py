"""``bench/bench_verify_kernels.py`` on CPU at toy sizes: it completes, acceptance on the flat
and the padded layouts agrees (the script asserts it), and its JSON has a row per operation
and batch size (the CPU figures themselves say nothing of a GPU's)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_verify_kernels  # noqa: E402  (bench/ is not a package)


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
