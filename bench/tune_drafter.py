"""Replays a few dev sessions through agspec variants with explicit DrafterConfig overrides.

Usage::

    python bench/tune_drafter.py N 'VARIANTS' [BATCH_SIZE]

``N`` sessions of each of the SWE-agent and mini-swe-agent dev files; ``VARIANTS`` a Python
list of ``(name, overrides)`` where overrides is a dict of DrafterConfig fields, or None for
a named replay drafter (``suffix-decoding``, ``pld-hf``, ...). Example::

    python bench/tune_drafter.py 3 '[("default", {}), ("chain", {"tree": False}),
                                     ("suffix-decoding", None)]'

Prints tau, acceptance rate, drafted tokens and drafter µs per step per agent format
(one continuous batch of at most ``BATCH_SIZE`` sessions, default 64; teacher forcing, as
``agspec-gpu replay``).
"""

import sys
import time

import torch

from agspec_gpu.controller import ControllerConfig, RoleProfile  # noqa: F401 - for VARIANTS
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane
from agspec_gpu.tiers import CorpusStore, TierConfig
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

DEV = "../shared/data/trajectories/dev/"


def main() -> None:
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    n = int(sys.argv[1])
    batch_size = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    sessions = (load_paths([DEV + "swe_agent__claude-sonnet-4.jsonl.gz"], limit=n)
                + load_paths([DEV + "mini_swe_agent__gemini-3-pro-preview.jsonl.gz"], limit=n))
    corpus = tokenize_sessions(sessions, tok)

    def lane(name: str, overrides: dict):
        def make():
            store = CorpusStore(tok, TierConfig())
            return BatchedLane(name, Drafter(store, DrafterConfig(**overrides),
                                             max_batch=batch_size),
                               store, "cpu", oracle_key=None)
        return name, make

    variants = eval(sys.argv[2])  # noqa: S307 - a developer's own command line
    t0 = time.time()
    report = run_replay(corpus, [lane(nm, kw) if kw is not None else nm for nm, kw in variants],
                        tok, ReplayConfig(batch_size=batch_size, oracle=False))
    for r in report.rows:
        print(f'{r["drafter"]:22s} {r["agent"]:16s} tau={r["tau"]:.3f} '
              f'acc={r["acceptance_rate"] or 0:.3f} drafted={r["drafted_per_step"]:.2f} '
              f'us={r["draft_us_per_step"]:.0f}')
    print(f"time {time.time() - t0:.0f}s (batch size {batch_size})")


if __name__ == "__main__":
    main()
