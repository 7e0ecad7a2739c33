"""Host time of the kernel launches a serving step makes one by one, outside its graphs.

Between a step's two reads of the device the host's work is on the critical path: the GPU
waits for it. Each eager launch costs the host its launcher's Python (checks, block sizes,
output allocations) and Triton's own launch. This times, per call, what
``SpecDecoder``'s paged step launches eagerly: the drafter's match (``suffix_match`` as the
drafter calls it: queries read from its ring, windows written; before 2026-12-03 three
launches, which this times on a checkout of that age), the greedy walk
(``greedy_tree_accept`` on flat rows), the planner (``plan_tree``: two kernels) and the
KV commit (``kv_compact``). The match and the walk write into outputs kept across calls, as
the drafter and the running batch keep them (a checkout before that allocates them).

On a GPU the launches are real (asynchronous: the host time per call, the device
synchronized between rounds, not inside them). On a CPU the Triton kernels are replaced by
a no-op launcher, so the figure is the launchers' own Python only: what this project's code
adds to Triton's launch, the part a change here can move.

Usage::

    python bench/bench_launch_overhead.py [--device cuda] [--batch-sizes 1,16,64] [--out PREFIX]

Prints a table; writes ``PREFIX.json`` (default
``bench/results/launch_overhead-<date>-<cpu or the GPU's short name>.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import statistics
import subprocess
import time
from pathlib import Path

import torch

import agspec_gpu
from agspec_gpu.accept import tree_qo_indptr
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import synchronize
from agspec_gpu.index import IndexArena, IndexConfig
from agspec_gpu.kernels import kv_compact as kv_compact_mod
from agspec_gpu.kernels import suffix_match_triton, tree_accept, tree_mask
from agspec_gpu.kernels.kv_compact import kv_compact
from agspec_gpu.kernels.suffix_match import MatchResult, suffix_match
from agspec_gpu.kernels.tree_accept import greedy_tree_accept
from agspec_gpu.tree import TreeMetadata, plan_tree
from bench_layer_kernels import write_results  # bench/, the script's folder
from devices import cpu_threads, pick_device

NUM_TIERS = 4  # match rows per request (session, workspace, history, global)


class _NoLaunch:
    """``kernel[grid](*args, **kw)`` that launches nothing (CPU: the launcher's Python)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed(on: bool):
    """The step's Triton kernels replaced by :class:`_NoLaunch` while ``on``."""
    names = [(suffix_match_triton, "_suffix_match_kernel"), (tree_accept, "_tree_accept_kernel"),
             (tree_mask, "_tree_rows_kernel"), (tree_mask, "_tree_mask_kernel"),
             (kv_compact_mod, "_kv_compact_kernel")]
    for mod, name in (("ring_queries", "_ring_queries_kernel"),  # before 2026-12-03
                      ("match_windows", "_match_windows_kernel"),
                      ("arena_append", "_arena_append_kernel")):  # from 2026-12-03 evening
        with contextlib.suppress(ImportError):
            names.append((importlib.import_module(f"agspec_gpu.kernels.{mod}"), name))
    saved = [(m, n, getattr(m, n)) for m, n in names]
    try:
        if on:
            for m, n in names:
                setattr(m, n, _NoLaunch())
        yield
    finally:
        for m, n, k in saved:
            setattr(m, n, k)


def cases(B: int, dev: torch.device, nodes: int) -> dict:
    """One closure per launch, on inputs shaped as a step of ``B`` requests."""
    g = torch.Generator().manual_seed(B)
    ar = IndexArena(IndexConfig(max_depth=32, tail_tokens=256), dev)
    cids = []
    for _ in range(NUM_TIERS):
        cids.append(ar.new_corpus())
        ar.append(cids[-1], torch.randint(0, 1000, (3000,), generator=g,
                                          dtype=torch.int32).to(dev))
    desc = ar.descriptors([cids[i % NUM_TIERS] for i in range(B * NUM_TIERS)])
    ring = torch.randint(0, 1000, (B + 1, 32), generator=g, dtype=torch.int32).to(dev)
    ring_len = torch.full((B + 1,), 32, dtype=torch.int32, device=dev)
    rows = torch.arange(B * NUM_TIERS, device=dev) // NUM_TIERS

    # the outputs the drafter keeps (from 2026-12-03 afternoon; before, each call allocated)
    kept = {}
    if "out" in inspect.signature(suffix_match).parameters:
        Q, i64 = B * NUM_TIERS, functools.partial(torch.empty, dtype=torch.int64, device=dev)
        kept["out"] = MatchResult(
            torch.empty(Q, dtype=torch.int32, device=dev), i64(Q), i64(Q, 8),
            i64(Q, max(desc.max_levels, 4)), i64(Q, max(desc.max_levels, 4)),
            torch.empty(Q, 8, 32, dtype=torch.int32, device=dev),
            torch.empty(Q, 8, 32, dtype=torch.int8, device=dev))
    if "query_rows" in inspect.signature(suffix_match).parameters:
        def match():
            return suffix_match(ar.tokens, ar.sa, desc, ring, ring_len, max_depth=32,
                                max_positions=8, max_scan=256, use_triton=True,
                                query_rows=rows, max_lengths=ring_len, window=32, src=ar.src,
                                **kept)
    else:  # before 2026-12-03: the drafter's three launches
        from agspec_gpu.kernels.match_windows import match_windows
        from agspec_gpu.kernels.ring_queries import ring_queries

        slots = torch.arange(B, device=dev)
        tier = torch.zeros(B, NUM_TIERS, dtype=torch.int64, device=dev)

        def match():
            q, ql = ring_queries(slots, tier, ring, ring_len, ring_len, use_triton=True)
            m = suffix_match(ar.tokens, ar.sa, desc, q, ql, max_depth=32, max_positions=8,
                             max_scan=256, use_triton=True)
            return match_windows(ar.tokens, ar.src, desc.tok_base, desc.num_tokens,
                                 m.positions, 32, use_triton=True)

    trees = [[(int(t), j - 1) for j, t in enumerate(torch.randint(0, 9, (nodes,), generator=g))]
             for _ in range(B)]
    d = DraftBatch.from_lists(trees, dev)
    pad = lambda x: torch.nn.functional.pad(x, (0, 64 - nodes), value=-1)  # noqa: E731
    wide = DraftBatch(pad(d.token_ids), pad(d.parents), d.num_draft_tokens)  # the drafter's 64
    draft = wide.narrowed(nodes)  # a step's drafts: column views of the drafter's
    qo = tree_qo_indptr(draft)
    target = torch.randint(0, 9, (int(qo[-1]),), generator=g).to(dev)

    walk_out = {}
    if "out" in inspect.signature(greedy_tree_accept).parameters:  # the running batch's
        from agspec_gpu.accept import AcceptBuffers

        walk_out["out"] = AcceptBuffers(B, nodes, dev).walk(B, nodes)
    row_start = qo[:-1]

    def accept():
        return greedy_tree_accept(draft.token_ids, draft.parents, draft.num_draft_tokens, target,
                                  max_depth=nodes, row_start=row_start, use_triton=True,
                                  **walk_out)

    pages, ps = 64, 16
    table = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    roots, prefix = i32(*[1] * B), i32(*[500] * B)
    meta = TreeMetadata.empty(B, 65, pages, ps, dev)

    def plan():
        return plan_tree(wide, roots, prefix, table, ps, out=meta, use_triton=True)

    # [layers, pages, K | V, page_size, KV heads, head_dim]
    kv = torch.zeros(2, B * pages, 2, ps, 2, 8, dtype=torch.float16, device=dev)
    path = torch.arange(4, dtype=torch.int32, device=dev).repeat(B, 1)
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
    kv_indices = table.view(-1)

    def commit():
        kv_compact(kv, kv_indptr, kv_indices, prefix, path, use_triton=True)

    return {"suffix_match": match, "greedy_tree_accept": accept, "plan_tree": plan,
            "kv_compact": commit}


def host_us(fn, dev: torch.device, rounds: int, calls: int) -> float:
    """Median over ``rounds`` of the mean host microseconds of ``calls`` calls."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(rounds):
        synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    synchronize(dev)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--nodes", type=int, default=16, help="draft nodes per request")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    cpu_threads(dev)
    stub = dev.type != "cuda"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(agspec_gpu.__file__).parent).stdout.strip()
    except OSError:
        rev = ""
    rows = []
    with stubbed(stub):
        for B in [int(b) for b in args.batch_sizes.split(",") if b]:
            for name, fn in cases(B, dev, args.nodes).items():
                us = host_us(fn, dev, args.rounds, args.calls)
                rows.append({"launch": name, "batch_size": B, "host_us": us,
                             "kernel": "no-op (launcher's Python only)" if stub else "real",
                             "revision": rev})
                print(f"B={B:<3d} {name:20s} {us:7.1f} us per call"
                      f"{' (kernel stubbed)' if stub else ''}", flush=True)
    write_results("launch_overhead", args, dev, torch.float32, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
