"""Tree attention over a long context: FlashInfer's custom mask against the split (the
prefix unmasked, the tree apart, merged), as :mod:`agspec_gpu.attention` runs them.

The H100 run of 2026-12-05 (`bench/results/trace-e2e-agspec-B64-*.json.gz`) spent 25.9 ms of
a B = 64 verification step in FlashInfer's custom-mask batch prefill, 0.81 ms per layer
for 1.07 GB of KV (4,096 tokens per request): 1.3 TB/s of the H100's 3.35. FlashInfer's
custom mask is a known slow path (its bits are read per score: flashinfer-ai/flashinfer#724),
and only a tree's own ``1 + n`` columns need it. So, per B, with the Llama-3-8B attention
shape and ``--nodes`` draft nodes per request after ``--context`` tokens:

- ``custom``: ``FlashInferPagedAttention`` (one batch prefill, packed custom mask);
- ``split``: ``FlashInferPagedAttention(split=True)``: an unmasked batch prefill over the
  prefix pages returning its log-sum-exps, then the tree kernel
  (``kernels/tree_attention.py``), which attends each row to its tree and merges;
- ``prefix_only`` and ``tree_kernel``: the split's two parts alone.

On CUDA each is timed (median, ``triton.testing.do_bench``) and the split's output compared
with the custom one (bf16); on CPU both run in torch (fp32) and only the difference is
reported: nothing is timed as a GPU claim.

Usage::

    python bench/bench_tree_attention.py --device cuda          # B = 1, 16, 64, 4,096 tokens
    python bench/bench_tree_attention.py --device cpu --context 100 --batch-sizes 1,3

Writes ``<out>.json`` (default ``bench/results/tree_attention-<date>-<dev>``): per B the
microseconds of each, the split's max abs difference from ``custom``, and the KV bytes per
call.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from agspec_gpu.attention import make_attention_backend
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.kernels.tree_attention import tree_attention
from agspec_gpu.tree import host_sizes, plan_tree
from bench_layer_kernels import timer, write_results  # bench/, the script's folder
from bench_verify_kernels import trees
from devices import cpu_threads, pick_device

PAGE = 16


def run_batch(B: int, args, dev: torch.device) -> dict:
    rng = np.random.default_rng(B)
    H, Hkv, D = args.qo_heads, args.kv_heads, args.head_dim
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = args.nodes
    prefix = [args.context] * B
    per_req = -(-(args.context + 1 + n) // PAGE)
    page_table = rng.permutation(B * per_req).reshape(B, per_req).astype(np.int32)
    cache = torch.randn(B * per_req, 2, PAGE, Hkv, D, dtype=dtype, device=dev)
    draft = DraftBatch.from_lists(trees(rng, B, n, 1000), dev)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    meta = plan_tree(draft, i32([1] * B), i32(prefix), torch.from_numpy(page_table).to(dev),
                     PAGE, host=host_sizes([n] * B, prefix, PAGE), prefix_pages=True)
    Q = meta.capacity_q
    q = torch.randn(Q, H, D, dtype=dtype, device=dev)
    custom = make_attention_backend(dev, H, Hkv, D, PAGE, dtype=dtype)
    split = make_attention_backend(dev, H, Hkv, D, PAGE, dtype=dtype, split=True)
    custom.plan(meta)  # a backend built without split runs the custom mask of any plan
    split.plan(meta)
    want = custom.run(q, cache).clone()
    got = split.run(q, cache).clone()
    row = {"batch_size": B, "context": args.context, "nodes": n,
           "kv_gb_per_call": B * args.context * Hkv * D * 2 * cache.element_size() / 1e9,
           "max_abs_diff": float((got.float() - want.float()).abs().max())}
    if dev.type == "cuda":
        out = torch.empty_like(q)
        o_prefix = torch.empty_like(q)
        lse = torch.empty(Q, H, dtype=torch.float32, device=dev)
        p = meta.maybe_prefix
        t = timer(dev, args.repeats)
        row["custom_us"] = t(lambda: custom.run(q, cache, out=out))
        row["split_us"] = t(lambda: split.run(q, cache, out=out))
        row["prefix_only_us"] = t(lambda: split._prefix_wrapper.run(
            q, cache, out=o_prefix, lse=lse, return_lse=True))
        row["tree_kernel_us"] = t(lambda: tree_attention(
            q, cache, meta.kv_slots, meta.qo_indptr, meta.ancestor_bits, p.prefix_lens,
            o_prefix, lse, num_tree=B, sm_scale=1 / math.sqrt(D), out=out))
        row["speedup"] = row["custom_us"] / row["split_us"]
        row["custom_tb_s"] = row["kv_gb_per_call"] / row["custom_us"] * 1e-3
        row["split_tb_s"] = row["kv_gb_per_call"] / row["split_us"] * 1e-3
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=4096, help="tokens of KV before the root")
    ap.add_argument("--nodes", type=int, default=4, help="draft nodes per request")
    ap.add_argument("--qo-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50, help="ms per timing (CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    cpu_threads(dev)
    rows = []
    for B in (int(x) for x in args.batch_sizes.split(",")):
        r = run_batch(B, args, dev)
        rows.append(r)
        timing = "" if "custom_us" not in r else (
            f"custom {r['custom_us']:9.1f} us ({r['custom_tb_s']:.2f} TB/s)  split "
            f"{r['split_us']:9.1f} us ({r['split_tb_s']:.2f} TB/s)  {r['speedup']:.2f}x  "
            f"(prefix {r['prefix_only_us']:.1f} us, tree kernel {r['tree_kernel_us']:.1f} us)  ")
        print(f"B={B:<4d} {timing}max |split - custom| {r['max_abs_diff']:.2e}", flush=True)
        # after every batch size: a run its time limit cuts keeps the rows it finished
        write_results("tree_attention", args, dev,
                      torch.bfloat16 if dev.type == "cuda" else torch.float32, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
