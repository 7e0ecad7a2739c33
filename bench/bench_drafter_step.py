"""Time of one drafter step (propose, commit) on replayed dev sessions, graphed and eager.

The drafter's share of a speculative step is the end-to-end goal's "drafter < 2% of step
time"; this isolates it from the model. Sessions replay through the drafter alone (teacher
forcing, as ``agspec-gpu replay``) as one continuous batch per batch size; every step's
``propose`` and ``observe`` (the commit, with host counts and the verifier's accepted path,
as a serving loop calls it) is timed with the device synchronized around it. On a GPU the
drafter runs with its CUDA graphs (``DrafterConfig.cuda_graphs``) and without, in the same
run on the same steps; on a CPU (torch path, no graphs) it is a smoke test, not a speed claim.

Usage::

    python bench/bench_drafter_step.py [--device cuda] [--global dev-half0.agspec --half 1]
        [--sessions 8] [--max-target-tokens 600] [--batch-sizes 1 16 64] [--out PREFIX]

Prints a table and writes ``PREFIX.json`` / ``PREFIX.csv``: per (variant, batch size) the
median and mean milliseconds per batched step of propose and commit, the mean batch, tau,
and what one propose + commit launches: GPU activities (kernels, copies, fills, as the
profiler sees them, CUDA-graph replays included) or, on a CPU, torch ops, counted over
warm-up steps.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch

from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.host import synchronize
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane
from agspec_gpu.tiers import CorpusStore, TierConfig, load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

from bench_drafter import DEV, FILES, cut
from devices import pick_device


class TimedLane(BatchedLane):
    """The agspec lane with its commit timed too (propose: ``StepResult.draft_seconds``), and
    the device's activities (kernels, copies, fills; on a CPU its ops) counted over the
    steps ``profile = (first, count)``, which should lie in the untimed warm-up."""

    def __init__(self, *args, profile: tuple[int, int] = (0, 0), **kw) -> None:
        super().__init__(*args, **kw)
        self.propose_s: list[float] = []
        self.commit_s: list[float] = []
        self.batch: list[int] = []
        self.profile, self._prof = profile, None
        self.events_per_step: float | None = None
        # what is counted: the GPU's activities, or on a CPU its ops
        cuda = self.device.type == "cuda"
        self._activity = torch.profiler.ProfilerActivity.CUDA if cuda else \
            torch.profiler.ProfilerActivity.CPU
        self._kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU

    def step(self, sids, contexts, truth, remaining):
        if self.profile[1] and len(self.propose_s) == self.profile[0]:
            synchronize(self.device)
            self._prof = torch.profiler.profile(activities=[self._activity])
            self._prof.__enter__()
        res = super().step(sids, contexts, truth, remaining)
        self.propose_s.append(res.draft_seconds)
        self.batch.append(len(sids))
        return res

    def observe(self, sids, output_ids, num_output, num_accepted, path_nodes=None):
        synchronize(self.device)
        t0 = time.perf_counter()
        super().observe(sids, output_ids, num_output, num_accepted, path_nodes)
        synchronize(self.device)
        self.commit_s.append(time.perf_counter() - t0)
        if self._prof is not None and len(self.commit_s) == sum(self.profile):
            self._prof.__exit__(None, None, None)
            n = sum(1 for e in self._prof.events() if e.device_type == self._kind)
            self.events_per_step, self._prof = n / self.profile[1], None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--global", dest="global_corpus")
    p.add_argument("--half", type=int, choices=(0, 1))
    p.add_argument("--trajectories", default=DEV, help="folder of the dev files")
    p.add_argument("--sessions", type=int, default=8, help="sessions per dev file (8)")
    p.add_argument("--max-target-tokens", type=int, default=600)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--warmup-steps", type=int, default=8, help="steps left out of the times")
    p.add_argument("--out", help="write PREFIX.json and PREFIX.csv")
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = pick_device(args.device)
    tok = load_tokenizer("cl100k")
    gc = load_global_corpus(args.global_corpus, tok) if args.global_corpus else None
    sessions = []
    for f in FILES:
        sessions += [s for s in load_paths([str(Path(args.trajectories) / f)])
                     if args.half is None or session_half(s.task_id) == args.half][:args.sessions]
    if gc is not None:
        gc.check_disjoint(s.task_id for s in sessions)
    corpus = tokenize_sessions([cut(s, args.max_target_tokens, tok) for s in sessions], tok)
    variants = [("graphs", True), ("eager", False)] if dev.type == "cuda" else [("eager", False)]
    rows = []
    for B in args.batch_sizes:
        for name, graphs in variants:
            lanes: list[TimedLane] = []

            def make(graphs=graphs, B=B):
                store = CorpusStore(tok, TierConfig(), dev, global_corpus=gc)
                d = Drafter(store, DrafterConfig(cuda_graphs=graphs), max_batch=B)
                lanes.append(TimedLane(name, d, store, dev,
                                       profile=(args.warmup_steps // 2, args.warmup_steps // 2)))
                return lanes[-1]

            t0 = time.perf_counter()
            rep = run_replay(corpus, [(name, make)], tok,
                             ReplayConfig(batch_size=B, oracle=False, device=str(dev)))
            lane, w = lanes[0], args.warmup_steps
            prop, com = lane.propose_s[w:] or lane.propose_s, lane.commit_s[w:] or lane.commit_s
            all_row = next(r for r in rep.rows if r["agent"] == "all")
            rows.append({
                "variant": name, "batch_size": B, "device": str(dev), "steps": len(prop),
                "mean_batch": statistics.fmean(lane.batch),
                "propose_ms_median": 1e3 * statistics.median(prop),
                "propose_ms_mean": 1e3 * statistics.fmean(prop),
                "commit_ms_median": 1e3 * statistics.median(com),
                "commit_ms_mean": 1e3 * statistics.fmean(com),
                "tau": all_row["tau"], "wall_s": time.perf_counter() - t0,
                # per propose + commit, counted in warm-up steps (a capture there adds some)
                ("gpu_activities_per_step" if dev.type == "cuda" else "cpu_ops_per_step"):
                    lane.events_per_step,
                "graph_errors": [g.graph_error for g in lane.drafter._graphs]
                if lane.drafter._graphs is not None else None})
            r = rows[-1]
            print(f"B={B:<3} {name:7s} steps={r['steps']:5d} mean_batch={r['mean_batch']:5.1f} "
                  f"propose {r['propose_ms_median']:7.3f} ms (mean {r['propose_ms_mean']:.3f}) "
                  f"commit {r['commit_ms_median']:7.3f} ms (mean {r['commit_ms_mean']:.3f}) "
                  f"tau {r['tau']:.3f}  {lane.events_per_step} "
                  f"{'GPU activities' if dev.type == 'cuda' else 'CPU ops'} per step", flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"config": vars(args), "rows": rows},
                                                       indent=1) + "\n")
        with out.with_suffix(".csv").open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=[k for k in rows[0] if k != "graph_errors"],
                               extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
