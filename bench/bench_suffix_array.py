"""One level build of the index: the one-launch Triton kernel against the torch path.

A session corpus builds a level every ``tail_tokens`` (256) appended tokens, inside a decode
step's commit, and at every message boundary whose new text fills its tail (a tool output,
a file), merging the newer levels as it goes (windows of ~320 to a few thousand positions).
In torch a build is ~70 launches; ``context_array`` runs one (``kernels/suffix_array.py``)
for windows of up to ``MAX_BLOCK`` positions.

Per window size (real code tokens, ``[0, w)`` at the corpora's depth, ``TierConfig.max_depth``
= 32, unless ``--depth``): the host time of
one call (what the launches cost the CPU, the device not waited for), the device time (CUDA
events around the call), and the GPU activities one call runs (kernels, copies, fills,
from torch.profiler), median over ``--repeats``; the paths' outputs are compared. A window
of at most 512 positions (a tail flush's) also runs the kernel at block 512
(``triton-512``): the library sorts it at 1024, its smaller compile, and this says whether a
third compile would pay. On a CPU only the torch path runs (the kernel needs a GPU; its
interpreter is a test tool).

Usage::

    python bench/bench_suffix_array.py [--device cuda] [--windows 320,1024,2048,4000]

Prints a table; writes ``PREFIX.json`` (default
``bench/results/suffix_array-<date>-<cpu or the GPU's short name>.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agspec_gpu.kernels.suffix_array import MAX_BLOCK, context_array, num_context_positions
from agspec_gpu.tiers import TierConfig
from bench_index_build import load_code_tokens
from bench_layer_kernels import write_results
from devices import pick_device


def _activities(fn, dev: torch.device) -> int:
    """GPU activities (kernels, memcpys, memsets) of one call; on a CPU, its ops."""
    kind = torch.profiler.ProfilerActivity.CUDA if dev.type == "cuda" else \
        torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[kind]) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    want = torch.autograd.DeviceType.CUDA if dev.type == "cuda" else \
        torch.autograd.DeviceType.CPU
    return sum(1 for e in prof.events() if e.device_type == want)


def time_build(fn, dev: torch.device, repeats: int) -> dict:
    cuda = dev.type == "cuda"
    for _ in range(3):  # warm-up (the kernel's compile)
        fn()
    host, device = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(dev)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        if cuda:
            ev[1].record()
            torch.cuda.synchronize(dev)
            device.append(ev[0].elapsed_time(ev[1]) / 1e3)
    return {"host_us": 1e6 * statistics.median(host),
            "device_us": 1e6 * statistics.median(device) if device else None,
            "activities": _activities(fn, dev)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--windows", default="320,1024,2048,4000")
    ap.add_argument("--depth", type=int, default=TierConfig().max_depth)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None, help="output prefix (.json)")
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    torch.set_num_threads(1)
    windows = [int(w) for w in args.windows.split(",") if w]
    if max(windows) > MAX_BLOCK:
        raise SystemExit(f"--windows: at most MAX_BLOCK={MAX_BLOCK} (larger ones take the "
                         f"torch path either way)")
    code, _ = load_code_tokens(max(windows) + 1, verbose=False)
    # (name, use_triton, block): the production blocks, and for a window that fits one a
    # smaller block, 512 (one more compile: is a tail flush's sort worth it?)
    paths = [("torch", False, None)]
    if dev.type == "cuda":
        paths.append(("triton", True, None))
    rows = []
    for w in windows:
        toks = torch.from_numpy(code[:w + 1].copy()).to(dev, torch.int32)
        seps = torch.nonzero(toks < 0).flatten().tolist()
        num = num_context_positions(seps, 0, w + 1)
        work = torch.empty(2 * MAX_BLOCK, dtype=torch.int64, device=dev)
        outs = {}
        small = [("triton-512", True, 512)] if dev.type == "cuda" and w <= 512 else []
        for path, use_triton, block in paths + small:
            out = torch.empty(num, dtype=torch.int32, device=dev)

            def build(out=out, use_triton=use_triton, block=block):
                return context_array(toks, 0, w + 1, args.depth, num_selected=num, out=out,
                                     work=work, use_triton=use_triton, block=block)

            r = time_build(build, dev, args.repeats)
            outs[path] = out.cpu()
            rows.append({"window": w, "path": path, **r})
        for path, got in outs.items():
            if not torch.equal(got, outs["torch"]):
                raise SystemExit(f"window {w}: {path}'s suffix array differs from torch's")
        # after every window: a run cut by its time limit keeps the windows it finished
        write_results("suffix_array", args, dev, torch.int32, rows)
    print(f"level build at depth {args.depth} on {dev} (median of {args.repeats})")
    print(f"{'window':>7} {'path':>11} {'host us':>9} {'device us':>10} {'activities':>11}")
    for r in rows:
        dv = "-" if r["device_us"] is None else f"{r['device_us']:.1f}"
        print(f"{r['window']:>7} {r['path']:>11} {r['host_us']:>9.1f} {dv:>10} "
              f"{r['activities']:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
