"""Host time of stop-string checks over one request's output, per output length.

``generate`` checks a request's stop strings after every token it takes. Decoding the whole
output so far at each token (what it did before ``StopMatcher``) costs time linear in the
output per token; the matcher decodes a window sized by the longest stop string. Outputs are
real agent text (the dev sessions' assistant messages, cl100k tokens) and the stop strings
never occur, so every token is checked, the common case. CPU time on this machine: a ratio,
not a GPU figure.

Usage::

    python bench/bench_stops.py [--lengths 500 2000 8000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from agspec_gpu.stops import StopMatcher
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev"
STOPS = ["\nObservation:", "</tool_call>", "<|im_end|>"]  # agent-loop stops (not in the text)


def whole_output(decode, tokens, stops) -> int | None:
    """The check ``generate`` made before: decode the whole output after every token."""
    for k in range(1, len(tokens) + 1):
        text = decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return None


def windowed(decode, tokens, stops) -> int | None:
    m = StopMatcher(decode, stops)
    return next((k for k, t in enumerate(tokens, 1) if m.push(t)), None)


def seconds(fn, *args, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=[str(DEFAULT_DATA)])
    ap.add_argument("--lengths", type=int, nargs="+", default=[500, 2000, 8000])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tok = load_tokenizer("cl100k")
    text = "\n".join(m.content for s in load_paths(args.paths) for m in s.messages
                     if m.role == "assistant")
    tokens = tok.encode(text[:40 * max(args.lengths)])
    stops = [s for s in STOPS if s not in text]
    rows = []
    print(f"{'tokens':>7} {'whole output ms':>16} {'StopMatcher ms':>15} {'ratio':>7}")
    for n in args.lengths:
        out = tokens[:n]
        assert len(out) == n, f"only {len(out)} tokens of text"
        assert whole_output(tok.decode, out, stops) == windowed(tok.decode, out, stops)
        old = seconds(whole_output, tok.decode, out, stops, repeat=1 if n > 4000 else 3)
        new = seconds(windowed, tok.decode, out, stops)
        rows.append({"tokens": n, "whole_output_ms": old * 1e3, "stop_matcher_ms": new * 1e3,
                     "ratio": old / new})
        print(f"{n:7d} {old * 1e3:16.1f} {new * 1e3:15.1f} {old / new:6.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokenizer": "cl100k", "stops": stops,
                                               "device": "cpu", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
