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
  match, so above 1 it reaches the lower acceptance rates agspec runs at); each point also
  *warm* (``sdw-*``, family ``suffix-decoding-warm``): its cache holding the responses of
  the other half's sessions of the ``--files``, the traffic agspec's global tier is built
  from (``--no-sd-warm``: cold only);
- the prompt-lookup baselines (their upstream rules, ``agspec_gpu.baselines``), by the number
  of tokens they draft after a match: ``pld-hf``'s ``num_output_tokens`` (transformers'
  default 10) per ``max_matching_ngram_size`` (default 2), and ``pld-vllm``'s ``k`` (5 as
  benchmarked) per n-gram size ``n`` (``prompt_lookup_min = prompt_lookup_max = n``, vLLM's
  setting when only the max is given; default 5);
- ``none`` (plain decoding, tau 1), the replay speedups' denominator.

Beside them, the oracle bound (``ReplayConfig(oracle=True)``, one more replay per file): the
tau of accepting, each step, the longest prefix (at most ``oracle_k`` = 32 tokens) of the true
continuation found in agspec's corpora (the default ``TierConfig``: session, workspace, global
tier). By construction it bounds the agspec and PLD points (their drafts come from those
corpora: PLD's from the session's own text), not SuffixDecoding's, whose cache also holds
the responses of the file's earlier sessions, which agspec's per-session tenants never see.
``tau/orc`` is a point's share of it; ``--no-oracle`` skips it.

``replay*`` is the replay's modelled speedup of the whole continuous batch: the ``none``
lane's verification time over the point's, each the sum over its batched steps of
``cost(rows + drafted)`` under the default cost model (drafting time left out), the figure
the batch budget maximises step by step (``--cost-model``: a measured calibration,
``bench_e2e.py``'s file, its curve for ``--batch-size``; it steers agspec's budget too).
Then, per agspec and PLD point, the best SuffixDecoding tau (cold, and warm) among its
points at an acceptance rate *at most* the point's, and the ratio: the point drafts at least
as precisely as the SuffixDecoding point it is held against, as the goal asks (None:
every SuffixDecoding point is more precise than it).

Sessions: ``--sessions`` per dev file of ``--half``, uncut by default (SuffixDecoding's
cross-request cache needs many sessions to reach its whole-set figure), replayed as one
continuous batch of ``--batch-size`` with the global tier built from the other half.
Teacher-forced greedy acceptance, as ``agspec-gpu replay``.

Usage::

    python bench/bench_frontier.py --global dev-half0.agspec --half 1 \\
        [--files mini_swe_agent__gemini-3-pro-preview.jsonl.gz] [--sessions N] \\
        [--agspec-min-prob 0 0.1 0.2 0.3] [--agspec-nobudget-min-prob 0.1 0.2] \\
        [--sd-min-token-prob 0.05 0.1 0.2 0.3 0.5] [--sd-spec-factor 1 2 4] \\
        [--pld-hf-tokens 2 5 10 20] [--pld-hf-ngram 2] [--pld-vllm-k 2 5 10] \\
        [--pld-vllm-ngram 5] [--no-sd-warm] [--cost-model cost.json] [--no-oracle] \\
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agspec_gpu.baselines import PLDHF, PLDVLLM, SuffixDecoding, suffix_decoding_available
from agspec_gpu.cost_model import curve_at
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.replay import ReplayConfig, run_replay, session_responses, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane, HostLane
from agspec_gpu.tiers import CorpusStore, TierConfig, load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

from bench_drafter import DEV, FILES, cut


def best_at_most(points: list[tuple[float, float]], rate: float) -> float | None:
    """The highest tau among ``(acceptance rate, tau)`` points whose rate is at most
    ``rate``: the best a baseline does while drafting no more precisely than a point at
    ``rate`` (None: every point is more precise)."""
    taus = [t for r, t in points if r is not None and r <= rate]
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
    p.add_argument("--pld-hf-tokens", type=int, nargs="*", default=[2, 5, 10, 20],
                   help="pld-hf num_output_tokens (transformers' default 10)")
    p.add_argument("--pld-hf-ngram", type=int, nargs="+", default=[2],
                   help="pld-hf max_matching_ngram_size (default 2)")
    p.add_argument("--pld-vllm-k", type=int, nargs="*", default=[2, 5, 10],
                   help="pld-vllm k, tokens drafted per match (5 as benchmarked)")
    p.add_argument("--pld-vllm-ngram", type=int, nargs="+", default=[5],
                   help="pld-vllm n-gram size: prompt_lookup_min = prompt_lookup_max (5)")
    p.add_argument("--no-sd-warm", action="store_true",
                   help="SuffixDecoding cold only (no points with the other half's responses)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="a measured cost calibration (bench_e2e.py's "
                        "cost-<model>-<gpu>-<date>.json) for the modelled speedups and "
                        "agspec's budget (default: the built-in estimate)")
    p.add_argument("--no-oracle", action="store_true",
                   help="skip the oracle bound (one more replay per file)")
    p.add_argument("--json")
    args = p.parse_args()
    if not suffix_decoding_available():
        raise SystemExit("arctic-inference is not installed (bench/install_arctic_inference.sh)")
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    gc = load_global_corpus(args.global_corpus, tok)
    B = args.batch_size
    cost = curve_at(args.cost_model, B)
    print(f"cost model of replay*: {cost.source}", flush=True)
    # SuffixDecoding given the traffic agspec's global tier holds: the other half's responses
    warm = () if args.no_sd_warm else session_responses(tokenize_sessions(
        [s for f in args.files for s in load_paths([DEV + f])
         if session_half(s.task_id) != args.half], tok).sessions)

    # every point is compared with the oracle over agspec's default corpora (the named
    # ``none`` lane's key too): one oracle pass per file
    key = None if args.no_oracle else TierConfig()

    def agspec(name: str, **overrides):
        def make():
            store = CorpusStore(tok, TierConfig(), global_corpus=gc)
            return BatchedLane(name, Drafter(store, DrafterConfig(**overrides), max_batch=B,
                                             cost=cost), store, "cpu", oracle_key=key)
        return name, make

    def host(name: str, make_drafter):
        return name, lambda: HostLane(make_drafter(), name, oracle_key=key)

    lanes, knobs = ["none"], {"none": ("none", {})}
    for n in args.pld_hf_ngram:
        for k in args.pld_hf_tokens:
            lanes.append(host(f"pld-hf-n{n}-k{k}", lambda n=n, k=k: PLDHF(n, k)))
            knobs[lanes[-1][0]] = ("pld-hf",
                                   {"max_matching_ngram_size": n, "num_output_tokens": k})
    for n in args.pld_vllm_ngram:
        for k in args.pld_vllm_k:
            lanes.append(host(f"pld-vllm-n{n}-k{k}", lambda n=n, k=k: PLDVLLM(n, n, k)))
            knobs[lanes[-1][0]] = ("pld-vllm", {"prompt_lookup_min": n,
                                                "prompt_lookup_max": n, "k": k})
    def sd(q: float, x: float, responses) -> SuffixDecoding:
        d = SuffixDecoding(min_token_prob=q, max_spec_factor=x)
        if len(responses):
            d.cache_responses(responses)
        return d

    for family, prefix, responses in (("suffix-decoding", "sd", ()),
                                      ("suffix-decoding-warm", "sdw", warm)):
        if family.endswith("warm") and not len(warm):
            continue
        for x in args.sd_spec_factor:
            for q in args.sd_min_token_prob:
                lanes.append(host(f"{prefix}-f{x:g}-p{q:g}",
                                  lambda q=q, x=x, r=responses: sd(q, x, r)))
                knobs[lanes[-1][0]] = (family, {"min_token_prob": q, "max_spec_factor": x})
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
        # the oracle lane's store is built by the replay, which loads the global corpus
        # from the path (the lanes above share ``gc``, the same file)
        report = run_replay(corpus, lanes, tok, ReplayConfig(
            batch_size=B, oracle=not args.no_oracle,
            global_corpus=None if args.no_oracle else args.global_corpus, cost_model=cost))
        rows = []
        for r in report.rows:
            if r["agent"] != "all":
                continue
            family, settings = knobs[r["drafter"]]
            rows.append({"point": r["drafter"], "family": family, "settings": settings,
                         "tau": r["tau"], "acceptance_rate": r["acceptance_rate"],
                         "drafted_per_step": r["drafted_per_step"],
                         "empty_draft_share": r["empty_draft_share"],
                         "target_tokens": r["target_tokens"], "mean_batch": r["mean_batch"],
                         "modelled_batch_speedup": r["modelled_batch_speedup"],
                         "modelled_replay_speedup": r["modelled_replay_speedup"],
                         "oracle_tau": r["oracle_tau"]})
        oracle = rows[0]["oracle_tau"]  # every lane has the same key: one bound
        oracle_s = "-" if oracle is None else f"{oracle:.3f} (k={report.config['oracle_k']}, " \
            f"{report.config['lane_seconds']['oracle1']:.0f}s)"
        curves = {fam: [(r["acceptance_rate"], r["tau"]) for r in rows if r["family"] == fam]
                  for fam in ("suffix-decoding", "suffix-decoding-warm")}
        print(f"\n{f}: {len(corpus.sessions)} sessions, {rows[0]['target_tokens']} target "
              f"tokens, B={B}, {time.time() - t0:.0f}s; oracle tau {oracle_s}")
        print(f"{'point':24s} {'tau':>6s} {'acc':>6s} {'drafted':>7s} {'empty':>6s} "
              f"{'replay*':>7s} {'tau/orc':>7s} {'SD@<=acc':>8s} {'ratio':>6s} "
              f"{'SDw@<=acc':>9s} {'ratio':>6s}")
        for r in rows:
            rate = r["acceptance_rate"]  # None: nothing drafted (none, a PLD finding no match)
            cells = []
            for fam, key in (("suffix-decoding", "sd"), ("suffix-decoding-warm", "sd_warm")):
                ref = best_at_most(curves[fam], rate) if not r["family"].startswith(
                    "suffix-decoding") and rate is not None else None
                r[f"{key}_best_tau_at_rate"] = ref
                r[f"ratio_to_{key}"] = None if ref is None else r["tau"] / ref
                cells += ["-" if ref is None else f"{ref:.3f}",
                          "-" if ref is None else f"{r['tau'] / ref:.3f}"]
            r["tau_over_oracle"] = None if oracle is None else r["tau"] / oracle
            rate_s = "-" if rate is None else f"{rate:.3f}"
            orc_s = "-" if oracle is None else f"{r['tau_over_oracle']:.3f}"
            print(f"{r['point']:24s} {r['tau']:6.3f} {rate_s:>6s} "
                  f"{r['drafted_per_step']:7.2f} {r['empty_draft_share']:6.3f} "
                  f"{r['modelled_replay_speedup']:7.3f} {orc_s:>7s} {cells[0]:>8s} "
                  f"{cells[1]:>6s} {cells[2]:>9s} {cells[3]:>6s}")
        out["files"][f] = {"sessions": len(corpus.sessions), "seconds": time.time() - t0,
                           "oracle_tau": oracle, "oracle_k": report.config["oracle_k"],
                           "lane_seconds": report.config["lane_seconds"], "rows": rows}
    out["wall_seconds"] = time.time() - t_all
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
