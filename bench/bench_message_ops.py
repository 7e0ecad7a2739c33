"""Launches per message-boundary call of the agspec drafter, counted on any machine.

Between two requests of a session the drafter indexes what the model did not generate:
``open_session`` (the prompt), ``extend`` (tool output, user messages, a cut message's
rest), ``add_workspace_file`` (files the agent opened) and ``close_session`` (its text to
the tenant's history). On a GPU each torch op there is a kernel launch (~5-10 us of host
time), and the end-to-end benchmark measured 3.5-4 ms per message on an H100. This replays
the dev sessions' boundaries as the replay target does (``agspec_gpu.replay_target``: the
prompt at open, the messages up to each target message fed, the target message itself
appended as context in one call, standing in for its steps' commits; two target messages
per session, cut at ``--max-message-tokens``) through the agspec lane, and counts the torch
dispatcher's kernel-launching ops per call (``tests/op_count.py``; views and allocations
aside), twice: with the index's level builds in one launch (``context_array``'s kernel,
as on a GPU) and with the torch build (every round run, as on a GPU). The CPU's search
keys of the torch match path (``prefix_keys``, absent on a GPU) are left out; a closed
session's text is checked for negative values on a CPU only (2 ops of ``close_session``
here). Only counts:
a CPU's time per call (its torch sorts) says nothing of a GPU's.

Usage::

    python bench/bench_message_ops.py [--sessions 64] [--global dev-half0.agspec] [--out P]

Prints a table; writes ``P.json`` (default ``bench/results/message_ops-<date>-cpu.json``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path

import torch

import agspec_gpu.index as index_mod
import agspec_gpu.kernels.suffix_array as sa_mod
from agspec_gpu.replay import tokenize_sessions
from agspec_gpu.replay_target import ReplayTargetConfig, _Request, _start_next, make_proposer
from agspec_gpu.tiers import load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths
from bench_drafter import DEV, FILES
from bench_e2e import round_robin_by_agent
from bench_layer_kernels import write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from op_count import CountOps  # noqa: E402  (the tests' dispatch counter)

CALLS = (("drafter", "open_session"), ("drafter", "extend"), ("drafter", "close_session"),
         ("store", "add_workspace_file"), ("store", "close_tenant"))


def count_boundaries(corpus, tok, global_corpus, kernel: bool, max_message_tokens: int
                     ) -> dict[str, dict]:
    """Replays every session's boundaries through a fresh agspec lane; per call, its
    count, launches per call and the most frequent ops."""
    count = CountOps()
    saved = (index_mod.context_array, index_mod.prefix_keys, sa_mod.build_context_array)
    if kernel:  # the level build as the GPU runs it: one launch
        index_mod.context_array = count.launches(saved[0], "context_array")
    else:  # the torch build's every round, as on a GPU (a CPU stops them early)
        sa_mod.build_context_array = functools.partial(saved[2], early_stop=False)
    index_mod.prefix_keys = count.pause(saved[1])  # the CPU match path's keys only
    stats: dict[str, list] = collections.defaultdict(lambda: [0, collections.Counter()])
    try:
        prop = make_proposer("agspec", tok, "cpu", 64, global_corpus=global_corpus)
        owners = {"drafter": prop.drafter, "store": prop.store}
        for owner, name in CALLS:
            obj = owners[owner]
            fn = getattr(obj, name)

            def counted(*a, _fn=fn, _name=name, **k):
                n0 = len(count.ops)
                try:
                    return _fn(*a, **k)
                finally:
                    stats[_name][0] += 1
                    stats[_name][1].update(count.ops[n0:])
            setattr(obj, name, counted)
        cfg = ReplayTargetConfig(batch_size=64, context_tokens=4096,
                                 max_message_tokens=max_message_tokens, messages_per_session=2)
        with torch.inference_mode(), count.mode:
            for s in corpus.sessions:
                if not s.target_messages:
                    continue
                req = _Request(s, s.sid)
                prompt_end = int(s.bounds[s.target_messages[0]])
                prop.open_session(s.sid, s.sid, s.agent, s.tokens[:prompt_end])
                while _start_next(req, prop, cfg, prompt_end) is not None:
                    prop.extend(s.sid, s.tokens[req.pos:req.end])  # the message's tokens
                    req.done_messages += 1
                    if req.end < req.msg_end:
                        prop.extend(s.sid, s.tokens[req.end:req.msg_end])
                    for path, text, first_line in s.maybe_files[req.msg]:
                        prop.add_file(s.sid, path, text, first_line)
                prop.close_session(s.sid)
                prop.close_tenant(s.sid)
    finally:
        index_mod.context_array, index_mod.prefix_keys, sa_mod.build_context_array = saved
    return {name: {"calls": n, "launches_per_call": sum(c.values()) / n,
                   "top_ops": {op: v / n for op, v in c.most_common(6)}}
            for name, (n, c) in sorted(stats.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", default=DEV, help="folder of the dev files")
    ap.add_argument("--sessions", type=int, default=64, help="half-1 sessions, round robin")
    ap.add_argument("--max-message-tokens", type=int, default=128)
    ap.add_argument("--global", dest="global_corpus", default=None,
                    help="an agspec global corpus (built from dev half 0)")
    ap.add_argument("--out", default=None, help="output prefix (.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    sessions = [s for s in load_paths([str(Path(args.trajectories) / f) for f in FILES])
                if session_half(s.task_id) == 1]
    corpus = tokenize_sessions(round_robin_by_agent(sessions)[:args.sessions], tok,
                               capture_files=True)
    g = load_global_corpus(args.global_corpus, tok) if args.global_corpus else None
    rows = []
    for kernel in (False, True):
        for name, r in count_boundaries(corpus, tok, g, kernel,
                                        args.max_message_tokens).items():
            rows.append({"call": name, "level_build": "kernel" if kernel else "torch", **r})
    print(f"launches per message-boundary call ({len(corpus.sessions)} dev sessions, two "
          f"target messages each)")
    print(f"{'call':>20} {'build':>7} {'calls':>6} {'launches':>9}")
    for r in rows:
        print(f"{r['call']:>20} {r['level_build']:>7} {r['calls']:>6} "
              f"{r['launches_per_call']:>9.1f}")
    write_results("message_ops", args, torch.device("cpu"), torch.int32, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
