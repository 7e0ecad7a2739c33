"""Wall time of one ``generate`` call whose requests end at very different lengths.

A server's batch mixes short and long answers. Eight sessions (prompts cut from a source
file of this package, cl100k), seven ending after ``--short`` tokens and one after
``--long``: once the short ones end, every further step serves one request. Greedy, both
runners, best of ``--repeat``. A tiny 2-layer random Llama with cl100k's vocabulary stands in
for the model, so on a CPU the time is mostly the LM head over the rows each step verifies:
a measure of the rows a step carries, not of a GPU's speed. Run it on two commits to compare
them (``PYTHONPATH=<other checkout>``).

Usage::

    python bench/bench_ragged_batch.py [--short 8] [--long 160] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import agspec_gpu
from agspec_gpu import DecoderConfig, SpecDecoder
from agspec_gpu.tokenizer import load_tokenizer
from tiny_llama import tiny_llama  # bench/, the script's folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    model = tiny_llama(tok.vocab_size)
    text = tok.encode((Path(agspec_gpu.__file__).parent / "decoder.py").read_text())
    limits = [args.short] * 7 + [args.long]
    rows = []
    for runner in ("hf", "paged"):
        best, steps = float("inf"), 0
        for _ in range(args.repeat):
            dec = SpecDecoder(model, tok, DecoderConfig(runner=runner, kv_cache_tokens=1 << 14))
            sids = [dec.open_session(f"t{i}", "coder", text[300 * i:300 * i + 200])
                    for i in range(len(limits))]
            t0 = time.perf_counter()
            dec.generate(sids, max_new_tokens=limits, eos_id=None)
            best, steps = min(best, time.perf_counter() - t0), dec.stats["steps"]
        rows.append({"runner": runner, "seconds": best, "steps": steps})
        print(f"{runner:6} {best:7.3f} s  {steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps({"limits": limits, "device": "cpu",
                                               "code": agspec_gpu.__file__, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
