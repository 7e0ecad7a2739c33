"""Host time of stop-string checks over one request's output, per output length.

``generate`` checks a request's stop strings after every token it takes. Decoding the whole
output so far at each token (what it did before ``StopMatcher``) costs time linear in the
output per token; the matcher decodes a window sized by the longest stop string. Outputs are
real agent text (the dev sessions' assistant messages, cl100k tokens) and the stop strings
never occur, so every token is checked, the common case. CPU time on this machine: a ratio,
not a GPU figure.

``--byte-runs N``: a second table, the matcher over runs of N byte-fallback pieces (what a
Llama-2 / Mistral style vocabulary writes for CJK, emoji or bytes that are not UTF-8; the
vocabulary is built here, no network), without and with the pieces' bytes
(``Tokenizer.byte_value``): without them each push decodes the whole run.

Usage::

    python bench/bench_stops.py [--lengths 500 2000 8000] [--byte-runs 4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
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


def byte_fallback_tokenizer():
    """A Llama-2 / Mistral style tokenizer, built here (no network): BPE with byte
    fallback (``<0x00>``-``<0xFF>``, ids 3-258), "▁" for spaces, and their decoder chain
    (Replace, ByteFallback, Fuse, Strip), which turns a run of byte pieces whose bytes are
    not valid UTF-8 into one U+FFFD per piece; its ``<pad>`` decodes to nothing and ends a
    run."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from agspec_gpu.tokenizer import from_hf
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "a", "b", "X", ".", "▁a", "▁b", "中", "<pad>"):
        vocab[piece] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab, [("▁", "a"), ("▁", "b")], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Replace("<pad>", ""),
                                     decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return from_hf(PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>",
                                           eos_token="</s>", unk_token="<unk>"), "bf")


def byte_runs(n: int, stops: list[str]) -> list[dict]:
    """Seconds to push runs of ``n`` byte pieces (CJK, emoji, bytes that are not UTF-8)
    through a matcher of ``stops``, without and with the pieces' bytes, same run."""
    t = byte_fallback_tokenizer()
    rng = random.Random(0)
    pieces = lambda text: [3 + b for b in text.encode()]  # noqa: E731
    runs = {"cjk": pieces("".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(n)))[:n],
            "emoji": pieces("🦀" * n)[:n],
            "not utf-8": [3 + 0xFF] + [3 + rng.randrange(256) for _ in range(n - 1)]}
    rows = []
    for name, tokens in runs.items():
        took = []
        for byte_value in (None, t.byte_value):
            m = StopMatcher(t.decode, stops, t.byte_pieces, t.has_no_token, byte_value)
            t0 = time.perf_counter()
            assert not any(m.push(x) for x in tokens)
            took.append(time.perf_counter() - t0)
        rows.append({"run": name, "pieces": n, "without_bytes_s": took[0],
                     "with_bytes_s": took[1], "ratio": took[0] / took[1]})
    return rows


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
    ap.add_argument("--byte-runs", type=int, default=0, metavar="N",
                    help="also time runs of N byte-fallback pieces (0: not)")
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
    runs = byte_runs(args.byte_runs, STOPS) if args.byte_runs > 0 else []
    if runs:
        print(f"\n{'run':>10} {'pieces':>7} {'without bytes s':>16} {'with bytes s':>13} "
              f"{'ratio':>7}")
        for r in runs:
            print(f"{r['run']:>10} {r['pieces']:7d} {r['without_bytes_s']:16.3f} "
                  f"{r['with_bytes_s']:13.3f} {r['ratio']:6.0f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokenizer": "cl100k", "stops": stops,
                                               "device": "cpu", "rows": rows,
                                               "byte_runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
