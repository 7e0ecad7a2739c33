"""Tree attention over a long context: one custom-mask prefill against the context and the
tree attended apart and merged.

The H100 run of 2026-12-05 (`bench/results/trace-e2e-agspec-B64-*.json.gz`) spent 25.9 ms of
a B = 64 verification step in FlashInfer's custom-mask batch prefill, 0.81 ms per layer
for 1.07 GB of KV (4,096 tokens per request): 1.3 TB/s of the H100's 3.35. FlashInfer's
custom mask is a known slow path (its bits are read per score, uncoalesced:
flashinfer-ai/flashinfer#724), and only a tree's last ``1 + n`` columns need it: every row
sees the whole prefix. So:

- ``custom``: what :class:`~agspec_gpu.attention.FlashInferPagedAttention` runs, one
  ``BatchPrefillWithPagedKVCacheWrapper`` plan over ``prefix + 1 + n`` columns with the
  packed mask;
- ``split``: the prefix without a mask (non-causal, the same paged cache, its pages up to
  the prefix) and the tree over the pages that hold its slots with the mask (the columns of
  the first page that precede the root masked off), then the two outputs merged by their
  log-sum-exps (base 2, FlashInfer's) in torch: a few elementwise kernels, counted in the
  split's time, where a runner would fuse them. Both parts use the prebuilt fa2 paged
  module; the tree's mask is packed on the host (FlashInfer's own packing and its
  ``merge_state`` would each JIT-compile another module on the device).

On CUDA both run FlashInfer (bf16) and the split's output is compared with the custom one;
on CPU both run in torch (fp32: the split's page and mask slicing against the reference
backend) and nothing is timed as a GPU claim.

Usage::

    python bench/bench_tree_attention.py --device cuda          # B = 1, 16, 64, 4,096 tokens
    python bench/bench_tree_attention.py --device cpu --context 100 --batch-sizes 1,3

Writes ``<out>.json`` (default ``bench/results/tree_attention-<date>-<dev>``): per B the
microseconds of each (medians), the split's max abs difference from ``custom``, and the KV
bytes per call.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from agspec_gpu.attention import TorchPagedAttention, make_attention_backend
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.tree import host_sizes, plan_tree, unpack_mask
from bench_layer_kernels import timer, write_results  # bench/, the script's folder
from bench_verify_kernels import trees

PAGE = 16


def split_plan(meta, page_table: np.ndarray, prefix: list[int], qo: list[int]):
    """Host lists of the two parts: per request the prefix's pages and length, and the
    pages holding the tree's slots, the tree part's KV length (from its first page's start)
    and its mask ``bool [qo, kv_t]`` (the columns before the root False)."""
    full = unpack_mask(meta).cpu()
    pre_pages, pre_len, tree_pages, tree_len, masks = [], [], [], [], []
    for b, (p, q) in enumerate(zip(prefix, qo)):
        pre_pages.append(page_table[b, :-(-p // PAGE)].tolist())
        pre_len.append(p)
        first = p // PAGE
        tree_pages.append(page_table[b, first:-(-(p + q) // PAGE)].tolist())
        start = first * PAGE
        tree_len.append(p + q - start)
        m = full[b, :q, start:p + q].clone()
        m[:, :p - start] = False
        masks.append(m)
    return pre_pages, pre_len, tree_pages, tree_len, masks


def paged_args(pages: list[list[int]], lens: list[int], dev):
    """``(kv_indptr, kv_indices, kv_last_page_len)`` int32 of per-request page lists."""
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    last = [n - (len(p) - 1) * PAGE for p, n in zip(pages, lens)]
    flat = [x for p in pages for x in p]
    return (torch.tensor(indptr, device=dev), torch.tensor(flat, dtype=torch.int32, device=dev),
            torch.tensor(last, dtype=torch.int32, device=dev))


def attend_torch(q, cache, rows, pages, lens, masks, scale):
    """``(out [Q, H, D], lse [Q, H])`` fp32, natural log: each request's ``rows`` over the
    first ``lens[b]`` slots of its ``pages`` (``masks[b] bool [rows, lens]`` or None: all)."""
    Q, H, D = q.shape
    Hkv = cache.shape[3]
    out = torch.zeros(Q, H, D)
    lse = torch.full((Q, H), -math.inf)
    flat = cache.permute(0, 2, 1, 3, 4).reshape(-1, 2, Hkv, D)  # slot page * PAGE + offset
    for b, (r0, r1) in enumerate(rows):
        slots = torch.tensor([p * PAGE + i for p in pages[b] for i in range(PAGE)][:lens[b]],
                             dtype=torch.long)
        k = flat[slots, 0].float().repeat_interleave(H // Hkv, 1)  # [K, H, D]
        v = flat[slots, 1].float().repeat_interleave(H // Hkv, 1)
        s = torch.einsum("rhd,khd->hrk", q[r0:r1].float(), k) * scale
        if masks is not None:
            s = s.masked_fill(~masks[b][None], -math.inf)
        lse[r0:r1] = torch.logsumexp(s, -1).T
        out[r0:r1] = torch.einsum("hrk,khd->rhd", torch.softmax(s, -1), v)
    return out, lse


def merge_torch(o1, s1, o2, s2, base2: bool = False):
    """Attention over two KV segments from each one's output and log-sum-exp (natural, or
    base 2 with ``base2``: FlashInfer's), in ``o1``'s dtype."""
    if base2:
        s = torch.logaddexp2(s1, s2)
        w1, w2 = torch.exp2(s1 - s), torch.exp2(s2 - s)
    else:
        s = torch.logaddexp(s1, s2)
        w1, w2 = (s1 - s).exp(), (s2 - s).exp()
    return (o1.float() * w1[..., None] + o2.float() * w2[..., None]).to(o1.dtype)


def packed_mask(masks: list[torch.Tensor], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 bits, int32 byte offsets [B + 1])``: each request's row-major mask packed
    little-endian and padded to a byte, concatenated (FlashInfer's layout)."""
    segs = [np.packbits(m.numpy().reshape(-1), bitorder="little") for m in masks]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in segs])]).astype(np.int32)
    return (torch.from_numpy(np.concatenate(segs)).to(dev), torch.from_numpy(offsets).to(dev))


def run_batch(B: int, args, dev: torch.device) -> dict:
    rng = np.random.default_rng(B)
    H, Hkv, D = args.qo_heads, args.kv_heads, args.head_dim
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = args.nodes
    prefix = [args.context] * B
    qo = [1 + n] * B
    per_req = -(-(args.context + 1 + n) // PAGE)
    page_table = rng.permutation(B * per_req).reshape(B, per_req).astype(np.int32)
    cache = torch.randn(B * per_req, 2, PAGE, Hkv, D, dtype=dtype, device=dev)
    draft = DraftBatch.from_lists(trees(rng, B, n, 1000), dev)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    meta = plan_tree(draft, i32([1] * B), i32(prefix), torch.from_numpy(page_table).to(dev),
                     PAGE, host=host_sizes([n] * B, prefix, PAGE))
    Q = meta.capacity_q
    q = torch.randn(Q, H, D, dtype=dtype, device=dev)
    scale = 1.0 / math.sqrt(D)
    rows = [(int(a), int(b)) for a, b in zip(meta.qo_indptr[:-1].tolist(),
                                             meta.qo_indptr[1:].tolist())]
    pre_pages, pre_len, tree_pages, tree_len, masks = split_plan(meta, page_table, prefix, qo)
    row = {"batch_size": B, "context": args.context, "nodes": n,
           "kv_gb_per_call": B * args.context * Hkv * D * 2 * cache.element_size() / 1e9}
    if dev.type == "cuda":
        import flashinfer

        ref = make_attention_backend(dev, H, Hkv, D, PAGE, dtype=dtype)
        ref.plan(meta)
        want = torch.empty_like(q)
        ref.run(q, cache, out=want)
        ws = [torch.zeros(256 << 20, dtype=torch.uint8, device=dev) for _ in range(2)]
        pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws[0], "NHD", backend="fa2")
        tree = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws[1], "NHD", backend="fa2")
        qo_indptr = meta.maybe_host.qo_indptr.to(dev)
        pre.plan(qo_indptr, *paged_args(pre_pages, pre_len, dev), H, Hkv, D, PAGE,
                 causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        bits, byte_indptr = packed_mask(masks, dev)
        tree.plan(qo_indptr, *paged_args(tree_pages, tree_len, dev), H, Hkv, D, PAGE,
                  packed_custom_mask=bits, sm_scale=scale, q_data_type=dtype,
                  kv_data_type=dtype)
        # as agspec_gpu.attention.flashinfer_plan: given only packed bits, plan() keeps
        # element offsets where the kernel reads byte offsets (flashinfer#2201)
        tree._mask_indptr_buf[:B + 1].copy_(byte_indptr)
        nq = rows[-1][1]
        outs = [torch.empty(nq, H, D, dtype=dtype, device=dev) for _ in range(2)]
        lses = [torch.empty(nq, H, dtype=torch.float32, device=dev) for _ in range(2)]

        def split():
            pre.run(q[:nq], cache, out=outs[0], lse=lses[0], return_lse=True)
            tree.run(q[:nq], cache, out=outs[1], lse=lses[1], return_lse=True)
            return merge_torch(outs[0], lses[0], outs[1], lses[1], base2=True)

        got = split()
        row["max_abs_diff"] = float((got.float() - want[:nq].float()).abs().max())
        t = timer(dev, args.repeats)
        row["custom_us"] = t(lambda: ref.run(q, cache, out=want))
        row["split_us"] = t(split)
        row["prefix_only_us"] = t(lambda: pre.run(q[:nq], cache, out=outs[0]))
        row["speedup"] = row["custom_us"] / row["split_us"]
        row["custom_tb_s"] = row["kv_gb_per_call"] / row["custom_us"] * 1e-3
        row["split_tb_s"] = row["kv_gb_per_call"] / row["split_us"] * 1e-3
    else:
        ref = TorchPagedAttention(H, Hkv, D, PAGE)
        ref.plan(meta)
        want = ref.run(q, cache)
        o1, s1 = attend_torch(q, cache, rows, pre_pages, pre_len, None, scale)
        o2, s2 = attend_torch(q, cache, rows, tree_pages, tree_len, masks, scale)
        got = merge_torch(o1, s1, o2, s2)
        nq = rows[-1][1]
        row["max_abs_diff"] = float((got[:nq] - want[:nq]).abs().max())
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=4096, help="tokens of KV before the root")
    ap.add_argument("--nodes", type=int, default=4, help="draft nodes per request")
    ap.add_argument("--qo-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50, help="ms per timing (CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    rows = []
    for B in (int(x) for x in args.batch_sizes.split(",")):
        r = run_batch(B, args, dev)
        rows.append(r)
        timing = "" if "custom_us" not in r else (
            f"custom {r['custom_us']:9.1f} us ({r['custom_tb_s']:.2f} TB/s)  split "
            f"{r['split_us']:9.1f} us ({r['split_tb_s']:.2f} TB/s)  {r['speedup']:.2f}x  "
            f"prefix alone {r['prefix_only_us']:.1f} us  ")
        print(f"B={B:<4d} {timing}max |split - custom| {r['max_abs_diff']:.2e}", flush=True)
        # after every batch size: a run its time limit cuts keeps the rows it finished
        write_results("tree_attention", args, dev,
                      torch.bfloat16 if dev.type == "cuda" else torch.float32, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
