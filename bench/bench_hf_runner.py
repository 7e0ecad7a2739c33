"""Time of a call and a step of :class:`~agspec_gpu.runners.hf.HFRunner` at long contexts.

The ``hf`` runner (``DecoderConfig``'s default: any causal LM through its own forward) keeps
a batch's KV in one padded ``DynamicCache``. This times a later call's ``prefill`` (a kept
session's KV of ``--contexts`` tokens minus ``--new-tokens``, then those new tokens: a tool
output), then ``verify_padded`` and ``commit`` apart per step, with a chain draft of
``--nodes`` tokens per request; each figure the best of ``--repeat`` runs (of ``--steps``
steps). A random 4-layer Llama (fp32, no GQA: a large KV per token) stands in for the model;
token ids are arbitrary (no acceptance is measured here), so the figures are a CPU's memory
traffic and attention, not a GPU's speed. Run it on two commits to compare them
(``PYTHONPATH=<other checkout>``).

Usage::

    python bench/bench_hf_runner.py [--contexts 1024,4096,16384] [--batch 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers

import agspec_gpu
from agspec_gpu.accept import greedy_accept
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.runners.hf import HFRunner, SessionKV


def _model(args) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers,
                                   num_attention_heads=args.hidden // 64,
                                   num_key_value_heads=args.hidden // 64,
                                   max_position_embeddings=1 << 16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def _kept_kv(model, length: int, gen: torch.Generator) -> SessionKV:
    """Random keys / values of ``length`` tokens in every layer (what a kept session holds)."""
    c = model.config
    shape = (c.num_key_value_heads, length, c.hidden_size // c.num_attention_heads)
    layers = range(c.num_hidden_layers)
    return SessionKV(tuple(torch.randn(shape, generator=gen) for _ in layers),
                     tuple(torch.randn(shape, generator=gen) for _ in layers), length)


def run(model, context: int, args) -> dict:
    gen = torch.Generator().manual_seed(context)
    B, N = args.batch, args.nodes
    # each request a little shorter than the last: a ragged batch, as a server's is
    lens = [context - 17 * b for b in range(B)]
    best = None
    for _ in range(args.repeat):
        runner = HFRunner(model)
        # a later call of a kept session: its KV, then --new-tokens appended (a tool output)
        past = [_kept_kv(model, n - args.new_tokens, gen) for n in lens]
        ids = [torch.randint(args.vocab, (n,), generator=gen).tolist() for n in lens]
        t0 = time.perf_counter()
        root = runner.prefill(ids, past).argmax(-1).to(torch.int32)
        prefill_s = time.perf_counter() - t0
        verify_s = commit_s = 0.0
        for _ in range(args.steps):
            chain = torch.randint(args.vocab, (B, N), generator=gen)
            draft = DraftBatch.from_lists([[(int(t), j - 1) for j, t in enumerate(row)]
                                           for row in chain])
            t0 = time.perf_counter()
            logits = runner.verify_padded(draft, root)
            t1 = time.perf_counter()
            res = greedy_accept(draft, logits)
            t2 = time.perf_counter()
            runner.commit(res)
            t3 = time.perf_counter()
            root = res.bonus_ids().to(torch.int32)
            verify_s, commit_s = verify_s + t1 - t0, commit_s + t3 - t2
        row = {"context": context, "batch": B, "nodes": N, "steps": args.steps,
               "new_tokens": args.new_tokens, "prefill_ms": 1e3 * prefill_s,
               "verify_ms": 1e3 * verify_s / args.steps, "commit_ms": 1e3 * commit_s / args.steps}
        best = row if best is None else {k: min(v, row[k]) if k.endswith("_ms") else v
                                         for k, v in best.items()}
    kv_mb = sum(lens) * 2 * model.config.num_hidden_layers * model.config.hidden_size * 4 / 2**20
    best["kv_mb"] = kv_mb
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = _model(args)
    rows = []
    with torch.no_grad():
        for ctx in (int(c) for c in args.contexts.split(",") if c):
            r = run(model, ctx, args)
            rows.append(r)
            print(f"context {ctx:6}  B={r['batch']}  KV {r['kv_mb']:7.1f} MB  prefill "
                  f"{r['prefill_ms']:8.1f} ms  verify {r['verify_ms']:8.2f} ms  commit "
                  f"{r['commit_ms']:8.2f} ms per step", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": "cpu", "threads": args.threads, "machine": platform.machine(),
             "torch": torch.__version__, "transformers": transformers.__version__,
             "code": agspec_gpu.__file__, "config": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
