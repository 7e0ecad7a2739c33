"""The decoder-layer kernels (RMSNorm + residual, RoPE, RoPE + KV append, SiLU * up) against
their torch paths.

Shapes: a Llama-3-8B layer (hidden 4096; 32 query and 8 KV heads of 128) at ``--rows`` query
rows (a decode step of B requests has B rows; a verification step B * (1 + nodes)), MLP
width 14336. Per shape: median microseconds of the Triton kernel and of the torch path
(``triton.testing.do_bench`` on CUDA: CUDA-event timing of many launches; on CPU only the
torch path is timed, with ``time.perf_counter``), and the kernels each replaces (residual
add + RMSNorm: 9, RoPE of q and k: 10 plus the query's contiguous copy, RoPE of q and k with
the keys' and values' writes to the paged cache: 12, SiLU * up: 2). The decode step's gain
shows in ``bench/bench_e2e.py``'s bandwidth figure; this isolates the kernels.

Usage::

    python bench/bench_layer_kernels.py --device cuda              # 1, 16, 64, 1024 rows
    python bench/bench_layer_kernels.py --device cpu --rows 1,16   # torch path only

Prints a table; writes ``<out>.json`` (default ``bench/results/layer_kernels-<date>-<dev>``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from agspec_gpu.kernels.rms_norm import rms_norm
from agspec_gpu.kernels.rope import rope
from agspec_gpu.kernels.rope_append import rope_append
from agspec_gpu.kernels.silu_mul import silu_mul
from devices import cpu_threads, device_slug, pick_device

ROOT = Path(__file__).resolve().parents[1]


def timer(device: torch.device, repeats: int):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, rep=repeats, return_mode="median") * 1e3

    def cpu(fn):
        fn()
        times = []
        for _ in range(max(repeats // 10, 5)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6
    return cpu


def gpu_kernels(fn, device: torch.device) -> int | None:
    """The kernels (GPU activities) one ``fn()`` launches, counted by ``torch.profiler``;
    None off a GPU, where nothing launches."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled and warm
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def write_results(stem: str, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype,
                  rows: list[dict]) -> Path:
    """``{"config", "results"}`` as ``<args.out>.json`` (default
    ``bench/results/<stem>-<date>-<cpu or the GPU's slug>.json``: ``devices.device_slug``)."""
    gpu = dev.type == "cuda"
    out = Path(args.out) if args.out else \
        ROOT / "bench" / "results" / f"{stem}-{_dt.date.today():%Y%m%d}-{device_slug(dev)}"
    out = out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "dtype": str(dtype), "torch": torch.__version__,
              "machine": platform.machine(), "cpu_threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name(dev) if gpu else None}
    out.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--rows", default="1,16,64,1024")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", default="32,8", help="query,KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--repeats", type=int, default=100, help="on a GPU, ms of timing per measurement (triton's do_bench); on a CPU, "
                         "ten times the calls timed (at least 5)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    cpu_threads(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, Hkv = (int(x) for x in args.heads.split(","))
    D, N = args.head_dim, args.hidden
    bench = timer(dev, args.repeats)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for Q in (int(r) for r in args.rows.split(",")):
        x = torch.randn(Q, N, device=dev, generator=g).to(dtype)
        w = torch.randn(N, device=dev, generator=g).to(dtype)
        qkv = torch.randn(Q, (H + 2 * Hkv) * D, device=dev, generator=g).to(dtype)
        q = qkv[:, :H * D].view(Q, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].view(Q, Hkv, D)
        ang = torch.rand(Q, D, device=dev, generator=g) * 100
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        res = torch.randn(Q, N, device=dev, generator=g).to(dtype)
        gate_up = torch.randn(Q, 2 * args.intermediate, device=dev, generator=g).to(dtype)
        cache = torch.zeros(Q // 16 + 2, 2, 16, Hkv, D, device=dev, dtype=dtype)
        slot = torch.arange(Q, device=dev)
        page, offset = slot // 16, slot % 16
        cases = {  # name: fn(use_triton)
            "add_rms_norm": lambda t: rms_norm(x, w, 1e-5, residual=res, use_triton=t),
            "rope_qk": lambda t: (rope(q, cos, sin, use_triton=t),
                                  rope(k, cos, sin, use_triton=t)),
            "rope_append": lambda t: rope_append(qkv, cos, sin, page, offset, cache, H, Hkv,
                                                 use_triton=t),
            "silu_mul": lambda t: silu_mul(gate_up, use_triton=t),
        }
        for name, fn in cases.items():
            # kernels per call, counted on a GPU (None on a CPU)
            row = {"op": name, "rows": Q, "torch_us": bench(lambda: fn(False)),
                   "torch_kernels": gpu_kernels(lambda: fn(False), dev),
                   "triton_kernels": gpu_kernels(lambda: fn(True), dev)}
            row["triton_us"] = bench(lambda: fn(True)) if dev.type == "cuda" else None
            row["speedup"] = row["torch_us"] / row["triton_us"] if row["triton_us"] else None
            rows.append(row)
            tri = f"{row['triton_us']:9.1f}" if row["triton_us"] else "        -"
            sp = f"{row['speedup']:6.2f}x" if row["speedup"] else "      -"
            print(f"{name:12s} rows={Q:<5d} torch {row['torch_us']:9.1f} us  triton {tri} us  "
                  f"{sp}  ({row['torch_kernels']} kernels -> {row['triton_kernels']})",
                  flush=True)
    write_results("layer_kernels", args, dev, dtype, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
