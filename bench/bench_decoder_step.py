"""What one ``SpecDecoder`` step of the paged runner costs the host: time, launches, syncs.

The model's forward is a CUDA graph on a GPU; what a step adds around it (the drafter's
halves, planning, acceptance, the commit, the decoder's bookkeeping) is host work between the
step's two reads of the device, while the GPU waits. This runs ``submit`` / ``step`` on a small
random Llama (``--layers`` layers of ``--hidden``, cl100k's vocabulary; its size is beside the
point: the host's work per step does not depend on it) with prompts cut from this package's
source (real code: the drafter finds matches; acceptance is not measured here), speculative
and with speculation off (plain decoding steps through the same loop), and reports per step:

* the median wall milliseconds (device synchronized at the end of each step);
* on a GPU, over ``--profile-steps`` steps after warm-up, the CUDA runtime calls the host
  made (kernel launches, graph launches, copies, synchronizations, by name) and the GPU's
  activities (kernels, copies, fills; graph replays' kernels included); on a CPU every
  ``aten::`` profiler event (nested, view and allocation ops included: more than the
  kernel-launching ops ``tests/op_count.py`` counts).

Usage::

    python bench/bench_decoder_step.py --device cuda [--batch-sizes 1,4,16] [--out PREFIX]

Prints a table; writes ``PREFIX.json`` (default
``bench/results/decoder_step-<date>-<cpu or the GPU's short name>.json``).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers

import agspec_gpu
from agspec_gpu import DecoderConfig, SpecDecoder
from agspec_gpu.host import synchronize
from agspec_gpu.tokenizer import load_tokenizer
from bench_layer_kernels import write_results  # bench/, the script's folder
from devices import pick_device


def model(vocab: int, args, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=args.hidden,
                                   intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1 << 17,
                                   initializer_range=0.1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dev, dtype).eval()


def run(dec: SpecDecoder, prompts: list[list[int]], B: int, speculate: bool, limit: int,
        args, dev: torch.device) -> dict:
    """``B`` requests stepped ``warmup + steps`` times (plus ``profile_steps`` profiled);
    ``limit``: more tokens than a request can emit in them."""
    sids = [dec.open_session(f"t{i}", "coder", prompts[i % len(prompts)]) for i in range(B)]
    for sid in sids:  # no request ends while it is measured (cancelled after)
        dec.submit(sid, max_new_tokens=limit, speculate=speculate, eos_id=None)
    dec.step()  # the join: prefill, one token each
    assert dec.running == sids, "the KV pool did not admit every request"
    start = dec.stats
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        dec.step()
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    cuda = dev.type == "cuda"
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CPU, act.CUDA] if cuda else [act.CPU]) as prof:
        for _ in range(args.profile_steps):
            dec.step()
        synchronize(dev)
    n = args.profile_steps
    events = list(prof.events())
    end = dec.stats  # tokens each request emitted per step, over the steps run here
    row = {"batch_size": B, "speculate": speculate,
           "ms_per_step": 1e3 * statistics.median(times[args.warmup:]),
           "tokens_per_request_step": (end["tokens"] - start["tokens"]) / B
           / max(end["steps"] - start["steps"], 1)}
    if cuda:
        # the runtime's and the driver's calls (Triton launches through cuLaunchKernel)
        runtime = collections.Counter(e.name for e in events if e.name.startswith("cu")
                                      and e.device_type == torch.autograd.DeviceType.CPU)
        row["runtime_calls_per_step"] = {k: v / n for k, v in runtime.most_common()}
        row["launches_per_step"] = sum(v for k, v in runtime.items()
                                       if "Launch" in k or "Memcpy" in k or "Memset" in k) / n
        row["syncs_per_step"] = sum(v for k, v in runtime.items() if "Synchronize" in k) / n
        row["gpu_activities_per_step"] = sum(
            1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / n
    else:
        ops = collections.Counter(e.name for e in events if e.name.startswith("aten::"))
        row["cpu_ops_per_step"] = sum(ops.values()) / n
    for sid in sids:
        dec.cancel(sid)
        dec.close_session(sid)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--layers", type=int, default=2)
    # 8 heads of 128 (head_dim 128: the FlashInfer modules the device script compiles)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = pick_device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = load_tokenizer("cl100k")
    src = Path(agspec_gpu.__file__).parent
    prompts = [tok.encode(p.read_text())[:args.prompt_tokens]
               for p in sorted(src.glob("*.py"))[:16]]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # KV for the most a request can hold: its prompt and every step accepting a whole draft
    # (its limit), the reserve of a step's draft that admission counts, a page of rounding
    cfg = DecoderConfig(runner="paged", max_batch=max(sizes))
    steps = args.warmup + args.steps + args.profile_steps + 2
    limit = steps * (1 + cfg.drafter.max_nodes)
    cfg = replace(cfg, kv_cache_tokens=max(sizes) * (
        args.prompt_tokens + limit + 1 + cfg.drafter.max_nodes + cfg.page_size))
    dec = SpecDecoder(model(tok.vocab_size, args, dev, dtype), tok, cfg)
    rows = []
    for B in sizes:
        for speculate in (True, False):
            r = run(dec, prompts, B, speculate, limit, args, dev)
            rows.append(r)
            counts = (f"launches {r['launches_per_step']:.1f}  syncs {r['syncs_per_step']:.1f}  "
                      f"GPU activities {r['gpu_activities_per_step']:.1f}"
                      if dev.type == "cuda" else f"torch ops {r['cpu_ops_per_step']:.1f}")
            print(f"B={B:<3} {'spec ' if speculate else 'plain'} {r['ms_per_step']:8.2f} ms/step"
                  f"  {r['tokens_per_request_step']:.2f} tokens/request  {counts} per step",
                  flush=True)
    write_results("decoder_step", args, dev, dtype, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
