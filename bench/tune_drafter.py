"""Replays a few dev sessions through agspec variants with explicit DrafterConfig overrides.

Usage::

    python bench/tune_drafter.py N 'VARIANTS' [--batch-size B] [--global FILE] [--half H]

``N`` sessions of each dev file (SWE-agent, mini-swe-agent, aider; with ``--half``, only
sessions of that half, so a global tier built from the other half never holds them);
``VARIANTS`` a Python list of ``(name, overrides)`` where overrides is a dict of
DrafterConfig fields, or None for a named replay drafter (``suffix-decoding``, ``pld-hf``,
...). Example::

    python bench/tune_drafter.py 3 '[("default", {}), ("chain", {"tree": False}),
                                     ("suffix-decoding", None)]' --global dev-half0.agspec --half 1

Prints tau, acceptance rate, drafted tokens and drafter µs per step per agent format
(one continuous batch of at most ``B`` sessions, default 64; teacher forcing, as
``agspec-gpu replay``).
"""

import argparse
import time

import torch

from agspec_gpu.controller import ControllerConfig, RoleProfile  # noqa: F401 - for VARIANTS
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane
from agspec_gpu.tiers import CorpusStore, TierConfig, load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

DEV = "../shared/data/trajectories/dev/"
FILES = ("swe_agent__claude-sonnet-4.jsonl.gz", "mini_swe_agent__gemini-3-pro-preview.jsonl.gz",
         "aider__chat_history.jsonl.gz")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("n", type=int)
    p.add_argument("variants")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--global", dest="global_corpus")
    p.add_argument("--half", type=int, choices=(0, 1))
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    sessions = []
    for f in FILES:
        ss = [s for s in load_paths([DEV + f])
              if args.half is None or session_half(s.id) == args.half]
        sessions += ss[:args.n]
    corpus = tokenize_sessions(sessions, tok)
    gc = load_global_corpus(args.global_corpus) if args.global_corpus else None

    def lane(name: str, overrides: dict):
        def make():
            store = CorpusStore(tok, TierConfig(), global_corpus=gc)
            return BatchedLane(name, Drafter(store, DrafterConfig(**overrides),
                                             max_batch=args.batch_size),
                               store, "cpu", oracle_key=None)
        return name, make

    variants = eval(args.variants)  # noqa: S307 - a developer's own command line
    t0 = time.time()
    report = run_replay(corpus, [lane(nm, kw) if kw is not None else nm for nm, kw in variants],
                        tok, ReplayConfig(batch_size=args.batch_size, oracle=False,
                                          global_corpus=args.global_corpus))
    for r in report.rows:
        print(f'{r["drafter"]:22s} {r["agent"]:16s} tau={r["tau"]:.3f} '
              f'acc={r["acceptance_rate"] or 0:.3f} drafted={r["drafted_per_step"]:.2f} '
              f'us={r["draft_us_per_step"]:.0f}', flush=True)
    print(f"time {time.time() - t0:.0f}s (batch size {args.batch_size})")


if __name__ == "__main__":
    main()
