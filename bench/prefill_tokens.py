"""Prompt tokens a multi-turn agent session prefills, with and without its KV kept between calls.

An agent calls ``generate`` once per assistant message, each time on its whole context so far.
``SpecDecoder`` keeps a session's KV from one call to the next (both runners), so a call
prefills only the tokens since the last one (the tool output and user turns, plus the last
token, the next root: ``tests/test_decoder.py`` checks exactly these counts); a loop without
a prefix cache prefills the whole context at every call. This counts both over real
sessions (cl100k tokens, every assistant message a call, no eviction: the pool holds the
session). Counted, not timed: the ratio is the prefill compute saved on any
hardware; its seconds depend on the GPU and the model.

Usage::

    python bench/prefill_tokens.py [PATHS...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agspec_gpu.replay import tokenize_sessions
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev"


def count(session) -> tuple[int, int, int]:
    """``(calls, tokens prefilled afresh, tokens prefilled with the session's KV)``."""
    calls = fresh = kept = 0
    kv_len = 0  # after a call the KV holds the context but its last token
    for i in session.target_messages:
        ctx = int(session.bounds[i])
        if ctx == 0:
            continue
        calls += 1
        fresh += ctx
        kept += ctx - kv_len
        kv_len = int(session.bounds[i + 1]) - 1
    return calls, fresh, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=[str(DEFAULT_DATA)])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    corpus = tokenize_sessions(load_paths(args.paths), load_tokenizer("cl100k"),
                               capture_files=False)
    rows: dict[str, dict] = {}
    for s in corpus.sessions:
        r = rows.setdefault(s.agent, {"agent": s.agent, "sessions": 0, "calls": 0,
                                      "prefill_fresh": 0, "prefill_kept_kv": 0})
        calls, fresh, kept = count(s)
        r["sessions"] += 1
        r["calls"] += calls
        r["prefill_fresh"] += fresh
        r["prefill_kept_kv"] += kept
    out = sorted(rows.values(), key=lambda r: r["agent"])
    out.append({"agent": "all", **{k: sum(r[k] for r in out) for k in
                                   ("sessions", "calls", "prefill_fresh", "prefill_kept_kv")}})
    print(f"{'agent':16} {'sessions':>8} {'calls':>7} {'afresh':>13} {'kept KV':>11} {'ratio':>7}")
    for r in out:
        r["ratio"] = r["prefill_fresh"] / r["prefill_kept_kv"] if r["prefill_kept_kv"] else None
        print(f"{r['agent']:16} {r['sessions']:8d} {r['calls']:7d} {r['prefill_fresh']:13,d} "
              f"{r['prefill_kept_kv']:11,d} {r['ratio'] or 0:6.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"paths": args.paths, "tokenizer": "cl100k",
                                               "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
