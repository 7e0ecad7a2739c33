"""A step's host lists to the device, as session 22 built them and as now: pageable
``to_device`` copies against ``HostWriter``'s pinned ring, the match descriptors read row by
row from the corpora against gathered from the arena's ``DescriptorTable``, and page
allocation one sequence at a time against ``allocate_many``.

Four cases per batch size ``B`` (the lists a serving step really builds):

* ``match_lists``: a propose's slots and tiers, then the match descriptors of ``3 B`` (request,
  corpus) rows of an arena of 128 corpora (100-2,000 tokens each): ``to_device`` + the
  descriptors read row by row and copied in two, against the descriptors gathered from the
  table and everything in one ``HostWriter`` write (what the drafter does now);
* ``observe_lists``: a commit's slots and the scatter indices of ``append_rows`` (8 tokens a
  row): three pageable copies against two writes;
* ``page_alloc``: ``B`` sequences growing by 3 tokens a step on 16-token pages (a few cross
  a page each step): ``allocate`` per sequence (one copy and one write each) against one
  ``allocate_many`` (one copy and one scatter);
* ``match_grid``: a propose's (request, corpus) grid for ``B`` sessions of ``B / 4`` tenants
  with workspaces: built every step (slots, ``corpora_of``, rows, the tenant-version check)
  against the drafter's reuse while the batch and the store's epoch stay.

Per case the median microseconds of host time (the call returns; nothing waits for the
device) and of the synchronized call (the copies done), over ``--steps`` calls after a
warm-up, old and new taking turns. On a CPU the copies are no-ops: the host work only
(numpy packing, the Python loops); the device script runs it on the GPU.

Usage::

    python bench/bench_host_staging.py [--device cuda] [--batch-sizes 1,16,64] [--out PREFIX]

Prints a table; writes ``PREFIX.json`` (default ``bench/results/host_staging-<date>-<dev>``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.host import HostWriter, synchronize, to_device
from agspec_gpu.index import IndexArena, IndexConfig
from agspec_gpu.kernels.suffix_match import MatchDescriptors
from agspec_gpu.kv_cache import PagedKVCache
from agspec_gpu.tiers import CorpusStore, TierConfig
from agspec_gpu.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from bench_layer_kernels import write_results  # noqa: E402
from index_reference import descriptors_reference  # noqa: E402  (the loop it replaced)
from devices import cpu_threads, pick_device  # noqa: E402  (bench/ is not a package)


def timed(fns, steps: int, dev: torch.device) -> list[tuple[float, float]]:
    """Per function ``fn(step)``: ``(host us, synchronized us)``, medians over ``steps`` calls
    after ``steps // 4`` untimed ones; the functions take turns, step by step, so that a
    noisy machine's drift falls on all of them alike."""
    host = [[] for _ in fns]
    synced = [[] for _ in fns]
    for s in range(steps + steps // 4):
        for i, fn in enumerate(fns):
            synchronize(dev)
            t0 = time.perf_counter()
            fn(s)
            t1 = time.perf_counter()
            synchronize(dev)
            t2 = time.perf_counter()
            if s >= steps // 4:
                host[i].append(t1 - t0)
                synced[i].append(t2 - t0)
    return [(statistics.median(h) * 1e6, statistics.median(y) * 1e6)
            for h, y in zip(host, synced)]


def arena(dev: torch.device) -> tuple[IndexArena, list[int]]:
    ar = IndexArena(IndexConfig(tail_tokens=64), dev)
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    cids = []
    for _ in range(128):
        c = ar.new_corpus()
        ar.append(c, torch.randint(0, 50_000, (rng.randrange(100, 2000),), generator=g,
                                   dtype=torch.int32).to(dev))
        cids.append(c)
    return ar, cids


def drafter(B: int, dev: torch.device, tok) -> tuple[Drafter, list[str]]:
    """A drafter with ``B`` open sessions of ``B / 4`` tenants, each with a workspace file."""
    store = CorpusStore(tok, TierConfig(use_global=False), dev)
    d = Drafter(store, DrafterConfig(cuda_graphs=False), max_batch=B)  # no capture: host work
    for t in range(max(B // 4, 1)):
        store.add_workspace_file(f"t{t}", "a.py", "def f(x):\n    return x + 1\n" * 20)
    sids = [f"s{i}" for i in range(B)]
    for i, sid in enumerate(sids):
        d.open_session(sid, f"t{i % max(B // 4, 1)}", prompt_ids=list(range(100 + i)))
    return d, sids


def cases(B: int, dev: torch.device, ar: IndexArena, cids: list[int], steps: int,
          tok) -> dict:
    """name -> (old fn(step), new fn(step)), each fresh state of its own."""
    rows = [cids[(7 * i) % len(cids)] for i in range(3 * B)]
    slots, tiers = list(range(B)), [i % 3 for i in range(3 * B)]
    writer = HostWriter(1 << 20, dev)

    def match_old(_):  # as session 22's propose: three copies, the fields row by row
        to_device(slots + tiers, torch.int64, dev)
        i64, i32, max_levels, max_tail = descriptors_reference(ar, rows)
        MatchDescriptors.packed(to_device(i64, torch.int64, dev), to_device(i32, torch.int32, dev),
                                len(rows), max_levels, max_tail)

    def match_new(_):  # as Drafter.propose: one write of the lists and the descriptors
        i64, i32, max_levels, max_tail = ar.descriptor_fields(rows)
        _, _, i64, i32 = writer.write((slots, torch.int64), (tiers, torch.int64),
                                      (i64, torch.int64), (i32, torch.int32))
        MatchDescriptors.packed(i64, i32, len(rows), max_levels, max_tail)

    M = 8  # append_rows' lists: a row's destination and source indices
    dst = [i * 4096 + j for i in range(B) for j in range(M)]
    src = [i * M + j for i in range(B) for j in range(M)]

    def observe_old(_):
        to_device(slots, torch.int64, dev)
        to_device(dst, torch.int64, dev)
        to_device(src, torch.int64, dev)

    def observe_new(_):
        writer.write((slots, torch.int64))
        writer.write((dst, torch.int64), (src, torch.int64))

    def pages(many: bool):
        P = (100 + 7 * B + 3 * (steps + steps // 4)) // 16 + 1  # the longest sequence's pages
        cache = PagedKVCache(1, num_pages=B * P, page_size=16, num_kv_heads=1, head_dim=8,
                             dtype=torch.float16, device=dev, max_seqs=B, max_pages_per_seq=P)
        ids = [f"s{b}" for b in range(B)]
        base = [100 + 7 * b for b in range(B)]

        def step(s):
            lens = [n + 3 * s for n in base]
            if many:
                cache.allocate_many(ids, lens)
            else:
                for sid, n in zip(ids, lens):
                    cache.allocate(sid, n)
        return step

    d, sids = drafter(B, dev, tok)
    d.propose(sids)  # the grid of this batch, as a running batch's last step left it

    def grid_old(_):  # as session 22's propose, every step
        d._match_grid(sids)
        [i for i, s in enumerate(sids) if d._version[s] != d.store.tenant_version(s)]

    def grid_new(_):  # as Drafter.propose now: reused while batch and epoch stay
        assert (d.store.epoch, tuple(sids)) == d._grid_key

    return {"match_lists": (match_old, match_new), "observe_lists": (observe_old, observe_new),
            "page_alloc": (pages(False), pages(True)), "match_grid": (grid_old, grid_new)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    cpu_threads(dev)
    ar, cids = arena(dev)
    tok = load_tokenizer("cl100k")
    rows = []
    print(f"{'case':14s} {'B':>3s} {'old host us':>12s} {'new host us':>12s} "
          f"{'old synced':>11s} {'new synced':>11s} {'host ratio':>10s}")
    for B in (int(b) for b in args.batch_sizes.split(",")):
        for name, (old, new) in cases(B, dev, ar, cids, args.steps, tok).items():
            (oh, os_), (nh, ns) = timed([old, new], args.steps, dev)
            rows.append({"case": name, "batch_size": B, "old_host_us": oh, "new_host_us": nh,
                         "old_synced_us": os_, "new_synced_us": ns, "host_ratio": oh / nh})
            print(f"{name:14s} {B:3d} {oh:12.1f} {nh:12.1f} {os_:11.1f} {ns:11.1f} "
                  f"{oh / nh:9.2f}x", flush=True)
    write_results("host_staging", args, dev, torch.int64, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
