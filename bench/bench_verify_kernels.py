"""What a verification step does besides the model's forward: planning (``kernels/tree_mask.py``),
greedy acceptance (``kernels/tree_accept.py`` after the argmax) and the KV commit
(``kernels/kv_compact.py``), each against its torch path (acceptance: on a CPU only,
where ``greedy_accept`` runs it; on a GPU it always runs the kernel).

Shapes: ``B`` requests (``--batch-sizes``) of ``--context`` tokens of KV, each with a draft
tree of ``--nodes`` nodes (a chain of half of them, the rest branching off it; the target's
argmax follows the chain for ``--accept`` nodes), a ``--vocab`` LM head (Llama-3: 128,256)
in bf16 on CUDA, fp32 on CPU; the KV commit on a Llama-3-8B cache (``--layers`` layers of
8 KV heads of 128, pages of 16).

``plan-pool`` (CUDA) plans the same step into a verification graph's buffers: the page table
as wide as a ``--pool-tokens`` KV pool (``SpecDecoder``'s paged runner: one row spans the
pool), capacities from ``padded_step_capacity``, a sink.

Acceptance is timed on the two logits layouts ``SpecDecoder`` has used: ``flat`` (the
verification's ``[total_q, V]`` rows with ``qo_indptr``, what ``PagedBatch.verify_rows``
returns) and ``padded`` (those rows first copied to ``[B, 1 + N, V]``, what the paged batch
handed to acceptance until 2026-12-02); on CUDA also the peak memory each allocates.

Usage::

    python bench/bench_verify_kernels.py --device cuda               # B = 1, 16, 64
    python bench/bench_verify_kernels.py --device cpu --layers 4     # torch paths only

Prints a table; writes ``<out>.json`` (default ``bench/results/verify_kernels-<date>-<dev>``).
Microseconds are medians (``triton.testing.do_bench`` on CUDA, ``time.perf_counter`` on CPU).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from agspec_gpu.accept import greedy_accept, pad_tree_logits, tree_qo_indptr
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.kernels.kv_compact import kv_compact
from agspec_gpu.tree import TreeMetadata, padded_step_capacity, plan_tree
from bench_layer_kernels import timer, write_results  # bench/, the script's folder
from devices import cpu_threads, pick_device

PAGE = 16


def trees(rng: np.random.Generator, batch: int, nodes: int, vocab: int) -> list[list]:
    """``batch`` trees of ``nodes`` nodes: a chain of ``nodes // 2``, then nodes branching off
    a random earlier node (parents precede children); tokens below ``vocab - 1``."""
    out = []
    for _ in range(batch):
        chain = max(nodes // 2, 1)
        parents = [i - 1 for i in range(min(chain, nodes))]
        parents += [int(rng.integers(-1, i)) for i in range(len(parents), nodes)]
        out.append([(int(t), p) for t, p in zip(rng.integers(0, vocab - 1, nodes), parents)])
    return out


def step_inputs(B: int, args, dev: torch.device, dtype: torch.dtype, seed: int = 0):
    """A batch's draft, roots, prefix lengths, page table and flat logits whose argmax
    accepts exactly the chain's first ``args.accept`` nodes (then token ``vocab - 1``, which
    no node carries)."""
    rng = np.random.default_rng(seed)
    draft = DraftBatch.from_lists(trees(rng, B, args.nodes, args.vocab), dev)
    qo = tree_qo_indptr(draft)
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(int(qo[-1]), args.vocab, device=dev, generator=g).to(dtype)
    tokens = draft.token_ids.long()
    accept = min(args.accept, args.nodes // 2)
    for d in range(accept):  # row d: node d - 1's (the root's at d = 0)
        logits[qo[:-1].long() + d, tokens[:, d]] = 100.0
    logits[qo[:-1].long() + accept, args.vocab - 1] = 100.0
    pages = -(-(args.context + 1 + args.nodes) // PAGE)
    prefix = torch.full((B,), args.context, dtype=torch.int32, device=dev)
    roots = torch.zeros(B, dtype=torch.int32, device=dev)
    # the tail pages of each request are its own, the rest one shared page (the commit
    # touches only the slots after the prefix; the planner reads every page id)
    table = torch.zeros(B, pages, dtype=torch.int32, device=dev)
    own = pages - args.context // PAGE
    table[:, -own:] = 1 + torch.arange(B * own, dtype=torch.int32, device=dev).view(B, own)
    return draft, roots, prefix, table, logits, qo, 1 + B * own


def peak_bytes(fn, dev: torch.device) -> int | None:
    """Peak memory ``fn`` allocates beyond what is allocated before it (CUDA only)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--nodes", type=int, default=16, help="draft nodes per request")
    ap.add_argument("--accept", type=int, default=4, help="chain nodes the argmax accepts")
    ap.add_argument("--context", type=int, default=4096, help="KV tokens per request")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--pool-tokens", type=int, default=1 << 20,
                    help="plan-pool (CUDA): a graph bucket's plan over a page table as wide "
                         "as a KV pool of this many tokens")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=100, help="on a GPU, ms of timing per measurement (triton's do_bench); on a CPU, "
                         "ten times the calls timed (at least 5)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    cpu_threads(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gpu = dev.type == "cuda"
    bench = timer(dev, args.repeats)
    rows = []

    def add(op: str, B: int, torch_us: float | None, triton_us: float | None, **extra) -> None:
        row = {"op": op, "batch_size": B, "torch_us": torch_us, "triton_us": triton_us,
               "speedup": torch_us / triton_us if torch_us and triton_us else None, **extra}
        rows.append(row)
        tor, tri = (f"{us:9.1f}" if us else "        -" for us in (torch_us, triton_us))
        more = "  ".join(f"{k} {v}" for k, v in extra.items() if v is not None)
        print(f"{op:15s} B={B:<4d} torch {tor} us  triton {tri} us  {more}", flush=True)

    for B in (int(b) for b in args.batch_sizes.split(",")):
        draft, roots, prefix, table, flat, qo, num_pages = step_inputs(B, args, dev, dtype)
        N = args.nodes
        out = TreeMetadata.empty(B, N + 1, table.shape[1], PAGE, dev)
        plan = {t: (lambda t=t: plan_tree(draft, roots, prefix, table, PAGE, out=out,
                                          use_triton=t)) for t in (False, True)}
        add("plan", B, bench(plan[False]), bench(plan[True]) if gpu else None)
        if gpu:  # a verify graph bucket's plan: a table as wide as the pool, a sink
            Q = B * (N + 1) + 1
            pool = -(-args.pool_tokens // PAGE)
            wide = torch.zeros(B, pool, dtype=torch.int32, device=dev)
            wide[:, :table.shape[1]] = table
            pages, mask_bytes = padded_step_capacity(B, N + 1, Q, pool, PAGE, pool, sink=True)
            out_pool = TreeMetadata.empty(B + 1, N + 1, pool, PAGE, dev, max_total_q=Q,
                                          max_total_pages=pages, max_mask_bytes=mask_bytes)
            add("plan-pool", B, None, bench(lambda: plan_tree(
                draft, roots, prefix, wide, PAGE, out=out_pool, sink_page=0, use_triton=True)),
                mask_mb=round(mask_bytes / 2**20, 1))

        def accept_flat():
            return greedy_accept(draft, flat, qo)

        def accept_padded():
            return greedy_accept(draft, pad_tree_logits(flat, qo, N))
        res = accept_flat()
        for f in ("num_accepted", "accepted_nodes", "output_ids", "num_output"):
            assert torch.equal(getattr(res, f), getattr(accept_padded(), f)), f
        # the library runs the walk's kernel on CUDA, its torch path elsewhere: the time
        # goes in the column of the path that ran
        for name, fn in (("accept-flat", accept_flat), ("accept-padded", accept_padded)):
            us = bench(fn)
            add(name, B, None if gpu else us, us if gpu else None, peak_mb=None if not gpu else
                round(peak_bytes(fn, dev) / 2**20, 1),
                mean_accepted=round(float(res.num_accepted.float().mean()), 2))

        kv = torch.zeros(args.layers, num_pages, 2, PAGE, 8, 128, device=dev, dtype=dtype)
        nodes = res.accepted_nodes.contiguous()
        meta = plan[False]()  # the commit moves KV within the pages the plan covers
        commit = {t: (lambda t=t: kv_compact(kv, meta.kv_indptr, meta.kv_indices, prefix, nodes,
                                             use_triton=t)) for t in (False, True)}
        add("kv_compact", B, bench(commit[False]), bench(commit[True]) if gpu else None)

    write_results("verify_kernels", args, dev, dtype, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
