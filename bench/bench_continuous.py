"""Agent turns served in waves of ``generate`` calls against continuous batching (``step``).

A server runs many agents; each alternates a model turn (an assistant message) with a tool
call. With ``generate`` the server batches the agents that are ready into one call, and an
agent whose turn ends early waits for the call's longest turn before its tool output goes in
and its next turn can start (waves). With ``submit`` / ``step`` a turn that ends leaves the
batch at once, its agent appends the tool output and submits its next turn, which joins
the running batch at the next step.

The turns are real: the first sessions of a dev trajectory file, each assistant message's
token count as a turn's limit (``eos_id=None``) and the following tool and user messages as
the appended text, up to ``--turns`` turns per agent. The model is a tiny random Llama with
cl100k's vocabulary (the tokens it emits are not the trajectory's; the lengths are). Greedy,
both policies on the same decoder settings; tool execution takes no time here (on a real
server it only widens the gap: a wave also waits for every agent's tool).

Measured: the forwards each policy runs for the same tokens (verification steps plus
prefills: a ``generate`` call's, or a join's) and each turn's latency in forwards (from its
submission, or its wave's start, to its last token). A memory-bound GPU step costs about
the same at any batch size up to a few dozen requests, so forwards are what a GPU's time
follows; on a CPU the time follows the rows a forward carries (wall seconds are printed too,
and favour the waves, whose late steps carry few rows).

KV admission (``--runner paged --admission reserve optimistic``): a server sets one
``max_new_tokens`` for every turn (``--max-new-tokens``, say 1024) and the model ends most
turns well before it. Here a turn still ends at its real length, the client stopping it
(``on_tokens`` returning False, or ``cancel``; the random model never writes the
trajectory's end token), while the decoder only knows the limit: ``reserve`` admits a turn
once the pool holds it to that limit, ``optimistic`` once it holds its context and a step,
preempting when the batch outgrows the pool. Tokens a turn emits in its last step past its
length are not counted.

Usage::

    python bench/bench_continuous.py [--agents 8] [--turns 4] [--max-turn 96] [--runner hf]
        [--kv-cache-tokens N] [--max-new-tokens N] [--admission reserve [optimistic]]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from agspec_gpu import DecoderConfig, SpecDecoder
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_sessions
from tiny_llama import tiny_llama  # bench/, the script's folder

DEFAULT = (Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev"
           / "swe_agent__claude-sonnet-4.jsonl.gz")


def agent_turns(path: Path, tok, agents: int, turns: int, max_turn: int, max_prompt: int):
    """Per agent: ``(prompt ids, [(turn limit, ids appended after the turn), ...])``."""
    out = []
    for s in load_sessions(path, limit=agents):
        msgs = s.messages
        first = next(i for i, m in enumerate(msgs) if m.role == "assistant")
        prompt = tok.encode("".join(m.content for m in msgs[:first]))[-max_prompt:]
        plan, i = [], first
        while i < len(msgs) and len(plan) < turns:
            limit = min(max(len(tok.encode(msgs[i].content)), 1), max_turn)
            j = i + 1
            while j < len(msgs) and msgs[j].role != "assistant":
                j += 1
            after = tok.encode("".join(m.content for m in msgs[i + 1:j]))[:max_prompt]
            plan.append((limit, after or tok.encode("\n")))
            i = j
        out.append((prompt, plan))
    return out


def forwards(dec: SpecDecoder) -> int:
    """The decoder's forwards so far: verification steps plus prefills (one per ``generate``
    call or join)."""
    s = dec.stats
    return s["steps"] + s["prefills"]


class TurnEnds:
    """Each running turn's real length; with a server's ``max_new_tokens`` the client stops
    a turn there itself. ``take`` counts a turn's new tokens, up to its length."""

    def __init__(self, max_new_tokens: int | None) -> None:
        self.max_new_tokens = max_new_tokens
        self.left: dict[str, int] = {}

    def limit(self, sid: str, length: int) -> int:
        """The turn's ``max_new_tokens`` (its length, or the server's limit)."""
        self.left[sid] = length
        return self.max_new_tokens or length

    def take(self, sid: str, tokens: list[int]) -> tuple[int, bool]:
        """``(tokens counted, whether the turn reached its length)``."""
        n = min(len(tokens), self.left[sid])
        self.left[sid] -= n
        return n, self.left[sid] == 0


def waves(dec: SpecDecoder, sids, plans, ends: TurnEnds) -> dict:
    """Every round, one ``generate`` over the agents with a turn left."""
    turn = [0] * len(sids)
    latencies, tokens = [], 0

    def on_tokens(sid: str, toks: list[int]) -> bool:
        nonlocal tokens
        n, done = ends.take(sid, toks)
        tokens += n
        return not done  # False: the client stops the turn

    while True:
        ready = [b for b in range(len(sids)) if turn[b] < len(plans[b])]
        if not ready:
            break
        start = forwards(dec)
        dec.generate([sids[b] for b in ready], eos_id=None, on_tokens=on_tokens,
                     max_new_tokens=[ends.limit(sids[b], plans[b][turn[b]][0]) for b in ready])
        latencies += [forwards(dec) - start] * len(ready)  # every turn waits for the call
        for b in ready:
            dec.append(sids[b], plans[b][turn[b]][1])
            turn[b] += 1
    return {"tokens": tokens, "turn_latencies": latencies}


def continuous(dec: SpecDecoder, sids, plans, ends: TurnEnds) -> dict:
    """``submit`` each agent's turn; as one ends, append its tool output and submit the next."""
    turn = [0] * len(sids)
    index = {s: b for b, s in enumerate(sids)}
    started, latencies, tokens = {}, [], 0
    for b, sid in enumerate(sids):
        dec.submit(sid, max_new_tokens=ends.limit(sid, plans[b][0][0]), eos_id=None)
        started[sid] = forwards(dec)
    while dec.running or dec.queued:
        for out in dec.step():
            n, done = ends.take(out.session_id, out.token_ids)
            tokens += n
            if not (done or out.finished):
                continue
            if not out.finished:
                dec.cancel(out.session_id)  # the client stops the turn at its length
            b = index[out.session_id]
            latencies.append(forwards(dec) - started[out.session_id])
            dec.append(out.session_id, plans[b][turn[b]][1])
            turn[b] += 1
            if turn[b] < len(plans[b]):
                dec.submit(out.session_id, eos_id=None,
                           max_new_tokens=ends.limit(out.session_id, plans[b][turn[b]][0]))
                started[out.session_id] = forwards(dec)
    return {"tokens": tokens, "turn_latencies": latencies}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trajectories", nargs="?", default=str(DEFAULT))
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-turn", type=int, default=96, help="most tokens of one turn")
    ap.add_argument("--max-prompt", type=int, default=512, help="most tokens of a prompt or "
                    "of one appended tool output")
    ap.add_argument("--runner", choices=("hf", "paged"), default="hf")
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 16,
                    help="DecoderConfig.kv_cache_tokens (paged: the page pool; a small one "
                    "makes requests wait for room)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="every turn's max_new_tokens, as a server sets it (the client stops "
                    "each turn at its real length); default: each turn's length")
    ap.add_argument("--admission", nargs="+", choices=("reserve", "optimistic"),
                    default=["reserve"], help="DecoderConfig.admission, each in turn")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    model = tiny_llama(tok.vocab_size)
    plans = agent_turns(Path(args.trajectories), tok, args.agents, args.turns, args.max_turn,
                        args.max_prompt)
    rows = []
    for admission in args.admission:
        for name, policy in (("waves (generate)", waves),
                             ("continuous (submit/step)", continuous)):
            dec = SpecDecoder(model, tok, DecoderConfig(
                runner=args.runner, max_batch=args.agents, admission=admission,
                kv_cache_tokens=args.kv_cache_tokens))
            sids = [dec.open_session(f"agent{b}", "coder", p) for b, (p, _) in enumerate(plans)]
            t0 = time.perf_counter()
            r = policy(dec, sids, [plan for _, plan in plans], TurnEnds(args.max_new_tokens))
            seconds = time.perf_counter() - t0
            lat = sorted(r.pop("turn_latencies"))
            s = dec.stats
            rows.append({"policy": name, "admission": admission, "forwards": forwards(dec),
                         "prefill_forwards": s["prefills"], "prefill_tokens": s["prefill_tokens"],
                         "preemptions": s["preemptions"],
                         "verification_steps": s["steps"], "tokens": r["tokens"],
                         "drafted": s["drafted"], "accepted": s["accepted"], "turns": len(lat),
                         "turn_latency_forwards_p50": statistics.median(lat),
                         "turn_latency_forwards_max": lat[-1],
                         "turn_latency_forwards_mean": sum(lat) / len(lat),
                         "wall_seconds": seconds})
            print(f"{name:26} {admission:10} {forwards(dec):5d} forwards ({s['prefills']:3d} "
                  f"prefills, {s['prefill_tokens']:6d} tokens, {s['preemptions']:3d} "
                  f"preemptions)  {r['tokens']:6d} tokens  turn latency in forwards: p50 "
                  f"{statistics.median(lat):6.1f}  mean {sum(lat) / len(lat):6.1f}  max "
                  f"{lat[-1]:4d}  ({seconds:.1f} s wall)")
    for admission in args.admission:
        w, c = [r for r in rows if r["admission"] == admission]
        print(f"{admission}: continuous against waves: {w['forwards'] / c['forwards']:.2f}x "
              f"fewer forwards, mean turn latency "
              f"{w['turn_latency_forwards_mean'] / c['turn_latency_forwards_mean']:.2f}x "
              f"shorter (in forwards)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": "cpu", "runner": args.runner, "agents": args.agents,
            "kv_cache_tokens": args.kv_cache_tokens, "max_new_tokens": args.max_new_tokens,
            "turns": args.turns, "max_turn": args.max_turn,
            "trajectories": str(args.trajectories), "turn_limits": [
                [limit for limit, _ in plan] for _, plan in plans], "rows": rows},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
