"""Acceptance of SpecDecoder's public loop on real agent sessions, beside the replay harness.

The replay harness (``agspec_gpu.replay``) drives the ``Drafter`` directly and feeds it the
files it captured from each message. This drives ``SpecDecoder`` the way a user's loop does:
``open_session``; ``append(ids, text=...)`` for every message the model did not write (the
decoder captures the files itself: what a tool output shows, read with the command the model
generated, and what that message wrote); ``propose``; ``commit``; ``close_session``;
``close_tenant`` -- inside the same teacher-forced protocol, in the same run, on the same
sessions. The logits handed to ``commit`` are one-hot at the trajectory's next tokens (the
target's greedy output is the trajectory), so ``commit`` emits what the harness emits; the
model is never run (a one-layer ``transformers`` Llama with cl100k's vocabulary only sizes
the decoder). Lanes:

* ``agspec``: the harness's own lane (files from its captures);
* ``decoder``: SpecDecoder, files captured by ``append(text=...)``;
* ``decoder-notext``: SpecDecoder, ``append`` without text: the files the agent wrote
  only, none that a tool output showed.

A gap between ``agspec`` and ``decoder`` is wiring the public API lacks; ``decoder-notext``
shows what capturing tool outputs is worth. A session's prompt (the messages before its first
target message) reaches ``open_session(..., text=...)`` decoded as one text, where the
harness captures each of its messages apart (the dev sessions' prompts show no files).

Usage::

    python bench/decoder_replay.py [PATHS...] [--limit 2] [--batch-size 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from agspec_gpu import DecoderConfig, DraftBatch, SpecDecoder
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.replay_lanes import StepResult, accept_on_host
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_sessions

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev"


class DecoderLane:
    """A replay lane (:class:`agspec_gpu.replay_lanes.Lane`) over SpecDecoder's public API."""

    wants_files = False  # the decoder captures files from append(text=...) itself

    def __init__(self, name: str, dec: SpecDecoder, with_text: bool) -> None:
        self.name, self.dec, self.with_text = name, dec, with_text
        self.oracle_key = dec.config.tiers  # bounded by the oracle of the same corpora
        self._roles = {r.name for r in dec.drafter.config.roles}
        self._step: tuple[DraftBatch, torch.Tensor] | None = None
        self.captured: list[str | None] = []  # the paths append() captured, in order

    def open_session(self, sid, tenant, role, prompt) -> None:
        ids = prompt.tolist()
        self.dec.open_session(tenant, role if role in self._roles else "default", ids,
                              session_id=sid,
                              text=self.dec.tokenizer.decode(ids) if self.with_text else None)

    def extend(self, sid, tokens) -> None:
        ids = tokens.tolist()
        self.captured += self.dec.append(
            sid, ids, text=self.dec.tokenizer.decode(ids) if self.with_text else None)

    def add_file(self, tenant, path, text, first_line) -> None:
        raise AssertionError("wants_files is False")

    def start_message(self, sid, tenant, context) -> None:
        pass

    def step(self, sids, contexts, truth, remaining) -> StepResult:
        t0 = time.perf_counter()
        draft = self.dec.propose(sids)
        seconds = time.perf_counter() - t0
        draft = draft.narrowed(max(int(draft.num_draft_tokens.max()), 1))
        num_acc, sources, path = accept_on_host(draft, truth)
        self._step = (draft, path)
        return StepResult(draft.num_draft_tokens.numpy().astype(np.int64), num_acc, sources,
                          seconds)

    def observe(self, sids, output_ids, num_output, num_accepted, path_nodes=None) -> None:
        """Commits the step with logits whose argmax spells ``output_ids``: the root's row
        and the rows of the first ``num_output - 1`` path nodes; the last one emitted is the
        bonus, so its children that spell it (the message ended there) are cut."""
        draft, path = self._step
        B, N = draft.token_ids.shape
        V = self.dec.vocab_size
        logits = torch.zeros(B, 1 + N, V)
        tokens = draft.token_ids.clone()
        valid = torch.arange(N)[None, :] < draft.num_draft_tokens[:, None]
        for b in range(B):
            out = output_ids[b, :num_output[b]].tolist()
            a = len(out) - 1
            rows = [0] + [1 + int(path[b, d]) for d in range(a)]
            logits[b, rows, out] = 1.0
            last = int(path[b, a - 1]) if a else -1
            cut = valid[b] & (draft.parents[b] == last) & (tokens[b] == out[a])
            tokens[b, cut] = (out[a] + 1) % V
        res = self.dec.commit(sids, DraftBatch(tokens, draft.parents, draft.num_draft_tokens,
                                               draft.maybe_source), logits)
        got = res.output_ids.tolist()
        for b in range(B):
            n = int(num_output[b])
            assert got[b][:n] == output_ids[b, :n].tolist(), (sids[b], got[b], output_ids[b])

    def finish_message(self, sid) -> None:
        pass

    def close_session(self, sid) -> None:
        self.dec.close_session(sid)

    def close_tenant(self, tenant) -> None:
        self.dec.close_tenant(tenant)


def decoder_lane(name: str, tokenizer, batch_size: int, with_text: bool):
    cfg = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2,
                                   max_position_embeddings=1 << 24)  # sessions of any length
    model = transformers.LlamaForCausalLM(cfg).eval()  # sizes the decoder; never run
    return lambda: DecoderLane(name, SpecDecoder(model, tokenizer,
                                                 DecoderConfig(max_batch=batch_size)),
                               with_text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=None)
    ap.add_argument("--limit", type=int, default=2, help="sessions per trajectory file")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    paths = args.paths or sorted(str(p) for p in DEFAULT_DATA.glob("*.jsonl.gz"))
    torch.manual_seed(0)
    tok = load_tokenizer("cl100k")
    sessions = [s for p in paths for s in load_sessions(p, limit=args.limit)]
    corpus = tokenize_sessions(sessions, tok)
    built: dict[str, DecoderLane] = {}

    def factory(name: str):
        def build() -> DecoderLane:
            built[name] = decoder_lane(name, tok, args.batch_size, name == "decoder")()
            return built[name]
        return build

    lanes = ["agspec"] + [(n, factory(n)) for n in ("decoder", "decoder-notext")]
    t0 = time.perf_counter()
    report = run_replay(corpus, lanes, tok, ReplayConfig(batch_size=args.batch_size),
                        inputs=paths)
    wall = time.perf_counter() - t0
    keys = ("drafter", "agent", "sessions", "target_tokens", "steps", "tau",
            "acceptance_rate", "drafted_per_step", "oracle_tau")
    print(f"{'lane':15} {'agent':16} {'sess':>4} {'tokens':>7} {'steps':>6} {'tau':>6} "
          f"{'acc':>6} {'drafted':>8} {'oracle':>7}")
    for r in report.rows:
        print(f"{r['drafter']:15} {r['agent']:16} {r['sessions']:4d} {r['target_tokens']:7d} "
              f"{r['steps']:6d} {r['tau']:6.3f} {r['acceptance_rate']:6.3f} "
              f"{r['drafted_per_step']:8.2f} {r['oracle_tau'] or 0:7.3f}")
    files = {n: len(lane.captured) for n, lane in built.items()}
    print(f"files captured by append(text=...): {files}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "protocol": "teacher-forced replay (DESIGN.md Evaluation); decoder lanes drive "
                        "SpecDecoder.open_session/append/propose/commit/close with one-hot "
                        "logits at the trajectory's tokens",
            "tokenizer": "cl100k", "batch_size": args.batch_size, "limit": args.limit,
            "inputs": paths, "wall_seconds": wall, "files_captured": files,
            "rows": [{k: r[k] for k in keys} for r in report.rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
