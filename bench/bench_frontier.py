"""Tau against acceptance rate: agspec's and SuffixDecoding's frontiers on the same sessions.

The replay issue asks for agspec's tau >= 1.3x SuffixDecoding's *at an acceptance rate at
least SuffixDecoding's*: any drafter buys tau by drafting more, so the comparison that counts
is of frontiers, not of two default points. This sweeps each drafter's own knob for how much
to draft and prints (tau, acceptance rate, drafted per step) per point:

- agspec: ``min_prob`` (nodes whose estimated acceptance probability is below it are not
  drafted), with and without the batch-level budget (which also trims drafts by the cost
  model when the batch is full);
- SuffixDecoding (arctic-inference, vLLM's defaults otherwise): ``min_token_prob``, the same
  kind of threshold on its suffix-tree frequencies, times ``max_spec_factor`` (draft at most
  this many tokens per matched token; vLLM's 1 keeps it from drafting long after a short
  match, so above 1 it reaches the lower acceptance rates agspec runs at).

``replay*`` is the replay's modelled speedup of the whole continuous batch: the ``none``
lane's verification time over the point's, each the sum over its batched steps of
``cost(rows + drafted)`` under the default cost model (drafting time left out), the figure
the batch budget maximises step by step. Then, per agspec point, the best SuffixDecoding tau
among its points at an acceptance rate at least the agspec point's (None: SuffixDecoding
has no point that precise), and the ratio.

Sessions: ``--sessions`` per dev file of ``--half``, uncut by default (SuffixDecoding's
cross-request cache needs many sessions to reach its whole-set figure), replayed as one
continuous batch of ``--batch-size`` with the global tier built from the other half.
Teacher-forced greedy acceptance, as ``agspec-gpu replay``.

Usage::

    python bench/bench_frontier.py --global dev-half0.agspec --half 1 \\
        [--files mini_swe_agent__gemini-3-pro-preview.jsonl.gz] [--sessions N] \\
        [--agspec-min-prob 0 0.1 0.2 0.3] [--agspec-nobudget-min-prob 0.1 0.2] \\
        [--sd-min-token-prob 0.05 0.1 0.2 0.3 0.5] [--sd-spec-factor 1 2 4] \\
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agspec_gpu.baselines import SuffixDecoding, suffix_decoding_available
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane, HostLane
from agspec_gpu.tiers import CorpusStore, TierConfig, load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

from bench_drafter import DEV, FILES, cut


def best_at_least(points: list[tuple[float, float]], rate: float) -> float | None:
    """The highest tau among ``(acceptance rate, tau)`` points whose rate is at least
    ``rate`` (None: no point is that precise)."""
    taus = [t for r, t in points if r >= rate]
    return max(taus) if taus else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", nargs="+", default=list(FILES))
    p.add_argument("--sessions", type=int, default=1 << 30, help="sessions per file (all)")
    p.add_argument("--max-target-tokens", type=int, default=1 << 40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--global", dest="global_corpus", required=True)
    p.add_argument("--half", type=int, choices=(0, 1), required=True)
    p.add_argument("--agspec-min-prob", type=float, nargs="*", default=[0.0, 0.1, 0.2, 0.3])
    p.add_argument("--agspec-nobudget-min-prob", type=float, nargs="*", default=[0.1, 0.2],
                   help="points without the batch budget (0 drafts ~32 tokens a step: slow)")
    p.add_argument("--sd-min-token-prob", type=float, nargs="+",
                   default=[0.05, 0.1, 0.2, 0.3, 0.5])
    p.add_argument("--sd-spec-factor", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--json")
    args = p.parse_args()
    if not suffix_decoding_available():
        raise SystemExit("arctic-inference is not installed (bench/install_arctic_inference.sh)")
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    gc = load_global_corpus(args.global_corpus, tok)
    B = args.batch_size

    def agspec(name: str, **overrides):
        def make():
            store = CorpusStore(tok, TierConfig(), global_corpus=gc)
            return BatchedLane(name, Drafter(store, DrafterConfig(**overrides), max_batch=B),
                               store, "cpu")
        return name, make

    def sd(name: str, min_token_prob: float, spec_factor: float):
        return name, lambda: HostLane(SuffixDecoding(min_token_prob=min_token_prob,
                                                     max_spec_factor=spec_factor), name)

    lanes, knobs = ["none"], {"none": ("none", {})}
    for x in args.sd_spec_factor:
        for q in args.sd_min_token_prob:
            lanes.append(sd(f"sd-f{x:g}-p{q:g}", q, x))
            knobs[lanes[-1][0]] = ("suffix-decoding",
                                   {"min_token_prob": q, "max_spec_factor": x})
    for budget, probs in ((True, args.agspec_min_prob), (False, args.agspec_nobudget_min_prob)):
        for q in probs:
            lanes.append(agspec(f"agspec{'' if budget else '-nobudget'}-p{q:g}",
                                min_prob=q, batch_budget=budget))
            knobs[lanes[-1][0]] = ("agspec", {"min_prob": q, "batch_budget": budget})
    out = {"config": {**vars(args), "date": time.strftime("%Y-%m-%d"),
                      "machine": "cpu, torch path, 1 thread"}, "files": {}}
    t_all = time.time()
    for f in args.files:
        ss = [s for s in load_paths([DEV + f]) if session_half(s.task_id) == args.half]
        gc.check_disjoint(s.task_id for s in ss[:args.sessions])
        corpus = tokenize_sessions([cut(s, args.max_target_tokens, tok)
                                    for s in ss[:args.sessions]], tok)
        t0 = time.time()
        report = run_replay(corpus, lanes, tok, ReplayConfig(batch_size=B, oracle=False))
        rows = []
        for r in report.rows:
            if r["agent"] != "all" or r["drafter"] == "none":
                continue
            family, settings = knobs[r["drafter"]]
            rows.append({"point": r["drafter"], "family": family, "settings": settings,
                         "tau": r["tau"], "acceptance_rate": r["acceptance_rate"],
                         "drafted_per_step": r["drafted_per_step"],
                         "empty_draft_share": r["empty_draft_share"],
                         "target_tokens": r["target_tokens"], "mean_batch": r["mean_batch"],
                         "modelled_batch_speedup": r["modelled_batch_speedup"],
                         "modelled_replay_speedup": r["modelled_replay_speedup"]})
        sd_curve = [(r["acceptance_rate"], r["tau"]) for r in rows
                    if r["family"] == "suffix-decoding"]
        print(f"\n{f}: {len(corpus.sessions)} sessions, {rows[0]['target_tokens']} target "
              f"tokens, B={B}, {time.time() - t0:.0f}s")
        print(f"{'point':24s} {'tau':>6s} {'acc':>6s} {'drafted':>7s} {'empty':>6s} "
              f"{'replay*':>7s} {'SD best@>=acc':>13s} {'ratio':>6s}")
        for r in rows:
            ref = best_at_least(sd_curve, r["acceptance_rate"]) \
                if r["family"] != "suffix-decoding" else None
            r["sd_best_tau_at_rate"] = ref
            r["ratio_to_sd"] = None if ref is None else r["tau"] / ref
            ref_s = "-" if ref is None else f"{ref:.3f}"
            ratio_s = "-" if ref is None else f"{r['ratio_to_sd']:.3f}"
            print(f"{r['point']:24s} {r['tau']:6.3f} {r['acceptance_rate']:6.3f} "
                  f"{r['drafted_per_step']:7.2f} {r['empty_draft_share']:6.3f} "
                  f"{r['modelled_replay_speedup']:7.3f} {ref_s:>13s} {ratio_s:>6s}")
        out["files"][f] = {"sessions": len(corpus.sessions), "seconds": time.time() - t0,
                           "rows": rows}
    out["wall_seconds"] = time.time() - t_all
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
