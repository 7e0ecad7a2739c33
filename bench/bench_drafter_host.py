"""The drafter's own host time per serving step: propose + commit with the device stubbed.

The end-to-end goal gives the drafter 2% of a step (~150 us of an 8B model's ~7.5 ms step
on the H200). On a GPU a step's device work is asynchronous, so what the drafter costs the
step is its host time: the launchers' Python, the staging of its host lists, the graph
steps' input copies, the session tier's bookkeeping. This measures that part alone, on a
CPU as well: the match's Triton kernel is a no-op launch (the match takes its Triton path,
as on a GPU) and the two graph steps (``StepGraphs``, padded to their buckets as on a GPU)
return outputs computed once per bucket instead of replaying a graph. What is left runs for
real: the drafter's and the store's Python, the host-to-device staging, the copies into the
graph steps' inputs, the session tier's bookkeeping (its append's kernel is stubbed too; on
a CPU the periodic level build's sorts run here; on a GPU they are launched, with a few
reads of sizes: the median leaves them out, the mean does not).

``B`` sessions of the dev trajectories' text (a prompt of ``--prompt-tokens`` tokens each,
then their next tokens, ``--accept`` drafted tokens accepted plus the bonus per step) step
as a running batch does: ``propose(sids, stable=False)``, then ``observe`` with the counts
on the host, no validation and the accepted path. Per batch size the median and mean host
microseconds of propose, of commit and of both, over ``--steps`` steps after a warm-up.

Usage::

    python bench/bench_drafter_host.py [--batch-sizes 1,16,64] [--steps 300] [--out PREFIX]

Prints a table; writes ``PREFIX.json`` (default ``bench/results/drafter_host-<date>-cpu``).
On a GPU, ``bench_drafter_step.py`` times the real steps (graphs replayed, kernels run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from pathlib import Path

import torch

import agspec_gpu.drafter as drafter_mod
import agspec_gpu.index as index_mod
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.drafter_graphs import GRAPH_OUTPUTS
from agspec_gpu.tiers import CorpusStore, TierConfig
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths
from bench_drafter import DEV, FILES  # bench/, the script's folder
from bench_launch_overhead import stubbed
from bench_layer_kernels import write_results


# the launchers a step calls by module attribute (the append: from 2026-12-03 evening)
LAUNCHERS = ((drafter_mod, "suffix_match"), (index_mod, "arena_append"))


def session_tokens(tok, count: int, need: int, folder: str) -> list[torch.Tensor]:
    """``count`` token streams of at least ``need`` tokens: the dev sessions' messages in
    order (cycled when the files hold fewer long enough)."""
    out = []
    for s in load_paths([str(Path(folder) / f) for f in FILES]):
        ids = tok.encode("\n".join(m.content for m in s.messages))
        if len(ids) >= need:
            out.append(torch.tensor(ids[:need], dtype=torch.int32))
        if len(out) == count:
            break
    if not out:
        raise SystemExit(f"no dev session of {need} tokens in {folder}")
    return [out[i % len(out)] for i in range(count)]


class _NoReplay:
    def replay(self) -> None:
        pass


def stub_replays(graphs) -> None:
    """``graphs`` (a ``StepGraphs``) on its CUDA-graph path with each bucket's "capture"
    computing its outputs once (eagerly) and its "replay" doing nothing: a step copies its
    inputs into the bucket's buffers, resets padding rows and returns views of the outputs,
    as on a GPU."""
    graphs.use_graphs = True

    def captured(buf: dict) -> bool:
        if "graph" not in buf:
            buf[GRAPH_OUTPUTS], buf["graph"] = graphs._call(buf), _NoReplay()
        return True
    graphs._captured = captured


@contextlib.contextmanager
def stubbed_device(on: bool = True):
    """The match's and the session tier's append's Triton launchers with no-op kernels, as
    the drafter and the arena call them (on a CPU they would take their torch paths)."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in LAUNCHERS
             if hasattr(mod, name)]
    try:
        if on:
            for mod, name, fn in saved:
                setattr(mod, name, functools.partial(fn, use_triton=True))
        with stubbed(on):
            yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def run(B: int, streams: list[torch.Tensor], args, tok) -> dict:
    store = CorpusStore(tok, TierConfig(use_global=False), torch.device("cpu"))
    d = Drafter(store, DrafterConfig(cuda_graphs=False), max_batch=B)
    d._graphs = d._step_graphs(use_graphs=False)  # padded buckets, as on a GPU
    for g in d._graphs:
        stub_replays(g)
    tenants = max(B // 4, 1)
    for t in range(tenants):  # a workspace file per tenant: three corpora per request
        store.add_workspace_file(f"t{t}", "notes.md", tok.decode(streams[t][:400].tolist()))
    sids = [f"s{i}" for i in range(B)]
    P, A = args.prompt_tokens, args.accept
    for i, sid in enumerate(sids):
        d.open_session(sid, f"t{i % tenants}", prompt_ids=streams[i][:P])
    path = torch.full((B, d.config.max_nodes), -1, dtype=torch.int64)
    path[:, :A] = torch.arange(A)
    nout = torch.full((B,), A + 1, dtype=torch.int32)
    nacc = torch.full((B,), A, dtype=torch.int32)
    counts = [A + 1] * B
    prop, com = [], []
    warm = args.steps // 4
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    for s in range(warm + args.steps):
        at = P + s * (A + 1)
        out = torch.stack([x[at:at + A + 1] for x in streams[:B]])
        t0 = clock()
        d.propose(sids, stable=False)
        t1 = clock()
        d.observe(sids, out, nout, nacc, num_output_host=counts, validate=False,
                  path_nodes=path)
        t2 = clock()
        if s >= warm:
            prop.append(t1 - t0)
            com.append(t2 - t1)
    both = [p + c for p, c in zip(prop, com)]
    us = lambda xs, f: f(xs) * 1e6  # noqa: E731
    return {"batch_size": B, "steps": args.steps,
            "propose_us_median": us(prop, statistics.median),
            "commit_us_median": us(com, statistics.median),
            "step_us_median": us(both, statistics.median),
            "propose_us_mean": us(prop, statistics.fmean),
            "commit_us_mean": us(com, statistics.fmean),
            "step_us_mean": us(both, statistics.fmean)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--accept", type=int, default=2, help="draft tokens accepted per step")
    ap.add_argument("--trajectories", default=DEV, help="folder of the dev files")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="the host thread's CPU time (default: what a shared machine's other "
                         "processes do not inflate) or wall time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    need = args.prompt_tokens + (args.steps + args.steps // 4) * (args.accept + 1)
    streams = session_tokens(tok, max(sizes), need, args.trajectories)
    rows = []
    print(f"{'B':>3s} {'propose us':>11s} {'commit us':>10s} {'step us':>8s}   (median; mean)")
    with stubbed_device():
        for B in sizes:
            r = run(B, streams, args, tok)
            rows.append(r)
            print(f"{B:3d} {r['propose_us_median']:11.1f} {r['commit_us_median']:10.1f} "
                  f"{r['step_us_median']:8.1f}   ({r['propose_us_mean']:.1f}, "
                  f"{r['commit_us_mean']:.1f}, {r['step_us_mean']:.1f})", flush=True)
    write_results("drafter_host", args, torch.device("cpu"), torch.int32, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
