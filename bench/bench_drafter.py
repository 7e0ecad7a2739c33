"""Drafter variants on replayed dev sessions, at several batch sizes: the controller matrix.

The drafter issue's measurement: static k = 8 / 16 / 32 versus the adaptive controller,
chains versus trees, with and without the batch-level budget under the default cost model, at
B = 1, 16 and 64, next to SuffixDecoding and PLD in the same run on the same tokens.

Usage::

    python bench/bench_drafter.py --global dev-half0.agspec --half 1 \\
        [--sessions N] [--max-target-tokens T] [--batch-sizes 1 16 64] [--variants PY] \\
        [--cost-model cost.json] [--json out.json] [--csv out.csv]

Sessions: the first ``N`` of each dev file (of ``--half``, so a global tier built from the
other half never holds them), cut after the assistant message that reaches ``T`` target
tokens (the batch budget needs many concurrent sessions, not long ones). Every batch size
replays all of them as one continuous batch of ``B``, except B = 1 (the slowest), which
replays an evenly spaced subset of ``--single-sessions``.
``--variants`` is a Python list of ``(name, DrafterConfig overrides)`` or ``(name, None)``
for a named replay drafter (``suffix-decoding``, ``pld-hf``, ...); the default is the
matrix above. Teacher-forced greedy acceptance, as ``agspec-gpu replay``. ``--cost-model``
prices the modelled figures and steers the budget by a measured calibration's curve at each
batch size (default: the built-in estimate). ``speedup*`` charges the drafter's measured
time here (on a CPU, its torch path's), ``batch*`` and ``replay*`` leave drafting out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from pathlib import Path

import torch

from agspec_gpu.controller import ControllerConfig  # noqa: F401 - for --variants
from agspec_gpu.cost_model import CostModel, curve_at
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.replay import ReplayConfig, run_replay, session_responses, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane
from agspec_gpu.baselines import SUFFIX_DECODING_INSTALL_HINT, suffix_decoding_available
from agspec_gpu.tiers import CorpusStore, TierConfig, load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

# the dev trajectories beside this checkout (../shared), wherever the script runs from
DEV = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev") + "/"
FILES = ("swe_agent__claude-sonnet-4.jsonl.gz", "mini_swe_agent__gemini-3-pro-preview.jsonl.gz",
         "aider__chat_history.jsonl.gz")

MATRIX = [
    ("none", None),  # plain decoding: the replay speedups' denominator
    ("pld-hf", None),
    ("pld-vllm", None),
    ("suffix-decoding", None),
    # (with --half) its cache holding the other half's responses, as agspec's --global
    # tier holds that half's sessions: the peer given what agspec is given
    ("suffix-decoding-warm", None),
    ("controller-tree-budget", {}),
    ("controller-tree", {"batch_budget": False}),
    ("controller-chain-budget", {"tree": False}),
    ("controller-chain", {"tree": False, "batch_budget": False}),
    ("static-k8", {"controller": ControllerConfig(static_k=8)}),
    ("static-k16", {"controller": ControllerConfig(static_k=16)}),
    ("static-k32", {"controller": ControllerConfig(static_k=32)}),
]
# the batch figures are the replay's own: modelled_batch_speedup prices the lane's mean
# batch (a continuous batch of B sessions runs below B as its sessions end), and
# modelled_replay_speedup its verification time step by step over the none lane's
KEYS = ("drafter", "agent", "batch_size", "sessions", "target_tokens", "steps", "tau",
        "acceptance_rate", "drafted_per_step", "empty_draft_share", "draft_us_per_step",
        "commit_us_per_step", "oracle_tau", "modelled_speedup", "mean_batch",
        "modelled_batch_speedup", "modelled_replay_speedup")


def cut(session, max_tokens: int, tok):
    """The session up to the assistant message that reaches ``max_tokens`` target tokens."""
    n, keep = 0, []
    for m in session.messages:
        keep.append(m)
        if m.role == "assistant":
            n += len(tok.encode(m.content))
            if n >= max_tokens:
                break
    return dataclasses.replace(session, messages=tuple(keep))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=22, help="sessions per dev file (22)")
    p.add_argument("--max-target-tokens", type=int, default=1500)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--single-sessions", type=int, default=12,
                   help="sessions replayed at B=1 (the slowest; a subset)")
    p.add_argument("--global", dest="global_corpus")
    p.add_argument("--half", type=int, choices=(0, 1))
    p.add_argument("--variants", help="Python list of (name, overrides or None)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="a measured cost calibration (bench_e2e.py's "
                        "cost-<model>-<gpu>-<date>.json): at each batch size its curve "
                        "prices the modelled speedups and steers agspec's budget (default: "
                        "the built-in estimate)")
    p.add_argument("--no-oracle", action="store_true",
                   help="skip the oracle bound (one more pass per batch size)")
    p.add_argument("--json")
    p.add_argument("--csv")
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    sessions = []
    for f in FILES:
        ss = [s for s in load_paths([DEV + f])
              if args.half is None or session_half(s.task_id) == args.half]
        sessions += [cut(s, args.max_target_tokens, tok) for s in ss[:args.sessions]]
    gc = load_global_corpus(args.global_corpus, tok) if args.global_corpus else None
    variants = eval(args.variants) if args.variants else MATRIX  # noqa: S307 - own command line
    skipped = [v[0] for v in variants
               if v[0].startswith("suffix-decoding") and not suffix_decoding_available()]
    if skipped:  # (the baseline a user would pick: said, not silently gone)
        print(f"{', '.join(skipped)} left out: {SUFFIX_DECODING_INSTALL_HINT}")
        variants = [v for v in variants if v[0] not in skipped]
    warm = ()
    if any(v[0] == "suffix-decoding-warm" for v in variants):
        if args.half is None:
            print("suffix-decoding-warm left out: its cache holds the other half's responses "
                  "(give --half)")
            variants = [v for v in variants if v[0] != "suffix-decoding-warm"]
        else:
            warm = session_responses(tokenize_sessions(
                [s for f in FILES for s in load_paths([DEV + f])
                 if session_half(s.task_id) != args.half], tok).sessions)
    rows, t_all = [], time.time()
    # the starred speedups price steps with this (a measured curve, or the built-in estimate)
    print(f"cost model: {args.cost_model or CostModel().source}; speedup* adds the drafter's "
          f"CPU time", flush=True)
    for B in args.batch_sizes:
        subset = sessions if B > 1 else \
            sessions[::max(1, len(sessions) // args.single_sessions)][:args.single_sessions]
        corpus = tokenize_sessions(subset, tok)
        cost = curve_at(args.cost_model, B)

        def lane(name: str, overrides: dict, B=B):
            def make():
                store = CorpusStore(tok, TierConfig(), global_corpus=gc)
                return BatchedLane(name, Drafter(store, DrafterConfig(**overrides), max_batch=B,
                                                 cost=cost), store, "cpu",
                                   oracle_key=None if args.no_oracle else TierConfig())
            return name, make

        t0 = time.time()
        report = run_replay(corpus, [lane(n, kw) if kw is not None else n for n, kw in variants],
                            tok, ReplayConfig(batch_size=B, oracle=not args.no_oracle,
                                              global_corpus=args.global_corpus, cost_model=cost),
                            warm_responses=warm)
        for r in report.rows:
            r = dict(r, batch_size=B)
            rows.append(r)
            if r["agent"] == "all":
                replay = r.get("modelled_replay_speedup")
                print(f'B={B:<3d} {r["drafter"]:24s} tau={r["tau"]:.3f} '
                      f'acc={r["acceptance_rate"] or 0:.3f} drafted={r["drafted_per_step"]:.2f} '
                      f'speedup*={r["modelled_speedup"]:.2f} mean batch={r["mean_batch"]:.1f} '
                      f'batch*={r["modelled_batch_speedup"]:.2f} replay*='
                      f'{"-" if replay is None else format(replay, ".2f")} '
                      f'us={r["draft_us_per_step"]:.0f}+{r["commit_us_per_step"]:.0f} '
                      f'oracle={r["oracle_tau"] or float("nan"):.2f}',
                      flush=True)
        print(f"B={B}: {len(subset)} sessions, {time.time() - t0:.0f}s", flush=True)
    meta = {"batch_sizes": args.batch_sizes, "sessions_per_file": args.sessions,
            "max_target_tokens": args.max_target_tokens, "half": args.half,
            "global_corpus": args.global_corpus, "variants": [v[0] for v in variants],
            "skipped_variants": skipped,
            "cost_model": report.config["cost_model"], "speedup_model":
            report.config["speedup_model"], "wall_seconds": time.time() - t_all}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": rows, "config": meta}, fh, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, KEYS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
