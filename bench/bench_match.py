"""Latency of one batched longest-suffix match on real code tokens, against baselines.

Corpus: real cl100k tokens of Python sources (see ``bench_index_build.load_code_tokens``),
the first ``size`` tokens (``--sizes``, default 32K and 1M; 100M is for a GPU). Queries: ``B``
real 64-token windows of the corpus (no separator inside), each with one random token
written ``k`` tokens before its end, ``k`` log-uniform in ``[0, 63]`` (10% of rows left
intact), so the longest match is at least ``k`` and match lengths spread the way
they do when decoding code: often short, sometimes the whole window.

Methods (same queries, same corpus):

* ``agspec``: ``SuffixIndex.match`` (the public call: validation, descriptors, launch); the
  torch path on CPU, the Triton kernel on CUDA.
* ``agspec-launch``: the launcher ``suffix_match`` alone with descriptors built beforehand
  (what a decode loop that keeps descriptors on the device pays), with the arena's search
  keys on the CPU as the drafter passes them.
* ``agspec-launch-scan``: the same launch with ``max_scan`` (``--max-scan``, the drafter's
  default 256): positions from the first ``max_scan`` entries of each level's range, which
  bounds a row's work when a short match has a range of ~10^5 entries.
* ``agspec-launch-binary`` (CUDA only): ``agspec-launch-scan`` with the kernel's searches
  binary (``fan=1``) instead of ``FAN``-ary: what the multi-pivot rounds save (same results,
  checked).
* ``agspec-torch`` (CUDA only): the torch path on the GPU.
* ``unfold``: ``match_baselines.unfold_match``, the brute-force torch implementation one
  writes first; configurations predicted to exceed ``--baseline-budget-s`` per call are
  skipped and their predicted time is reported.
* ``suffix-decoding`` (when arctic-inference is installed): ``SuffixDecodingCache.speculate``
  over the same rows, one call per row (it is a CPU library); every document of the corpus
  is one cached response in its global tree. It also builds a draft, so it does a little
  more work than a match.

Reports median and p90 over ``--repeats`` for every (size, B, method), checks that
``agspec`` equals ``unfold`` wherever both ran, and writes ``<out>.json`` / ``<out>.csv``
(default ``bench/results/match-<date>-<device>``).

Usage::

    python bench/bench_match.py             # CPU: 32K and 1M, B = 1, 16, 64, 256
    python bench/bench_match.py --quick     # < 30 s smoke run
    python bench/bench_match.py --device cuda --sizes 32K,1M,100M
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_index_build import (  # noqa: E402  (bench/ is not a package)
    DEFAULT_CACHE, default_out, environment, fmt_size, load_code_tokens, parse_size, pick_device,
    print_table, setup_threads, summarize, sync, write_results,
)
from match_baselines import unfold_match  # noqa: E402

from agspec_gpu.index import SuffixIndex  # noqa: E402
from agspec_gpu.tiers import TierConfig  # noqa: E402
from agspec_gpu.kernels.suffix_match import suffix_match  # noqa: E402

VOCAB = 100_256  # cl100k ordinary tokens


# ------------------------------------------------------------------------ queries
def make_queries(arr: np.ndarray, B: int, L: int, rng: random.Random
                 ) -> tuple[np.ndarray, list[int]]:
    """``B`` real windows of ``L`` tokens with one perturbed token; returns (rows, k per row)."""
    n = arr.size
    rows, ks = [], []
    while len(rows) < B:
        s = rng.randrange(0, n - L)
        w = arr[s:s + L].copy()
        if (w < 0).any():
            continue
        if rng.random() < 0.1:
            k = L
        else:
            k = min(L - 1, int(2 ** rng.uniform(0, math.log2(L))) - 1)
            new = rng.randrange(VOCAB - 1)
            w[L - 1 - k] = new if new != w[L - 1 - k] else new + 1
        rows.append(w)
        ks.append(k)
    return np.stack(rows).astype(np.int32), ks


# ------------------------------------------------------------------------ SuffixDecoding
def suffix_decoding_cache_cls():
    """arctic-inference's SuffixDecodingCache, or None when it is not installed."""
    try:
        from agspec_gpu.baselines import suffix_decoding_available  # may not exist yet
        if not suffix_decoding_available():
            return None
    except ImportError:
        pass
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        return None
    return SuffixDecodingCache


def build_suffix_decoding(cls, arr: np.ndarray, max_depth: int):
    """Every document (separator-delimited) becomes one cached response of the global tree."""
    cache = cls(max_tree_depth=max_depth)
    cuts = np.flatnonzero(arr < 0).tolist() + [arr.size]
    prev = 0
    for i, e in enumerate(cuts):
        doc = np.ascontiguousarray(arr[prev:e], dtype=np.int32)
        prev = e + 1
        if doc.size == 0:
            continue
        cache.start_request(("doc", i), np.zeros(0, dtype=np.int32))
        cache.add_active_response(("doc", i), doc)
        cache.stop_request(("doc", i))
    cache.start_request("bench", np.zeros(0, dtype=np.int32))
    return cache


# ------------------------------------------------------------------------ timing
def measure(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1,
            budget_s: float | None = None) -> list[float]:
    """Seconds per call; stops early (at least one call) once ``budget_s`` is spent."""
    for _ in range(warmup):
        fn()
    times, spent = [], 0.0
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        spent += times[-1]
        if budget_s is not None and spent > budget_s:
            break
    return times


def same(a, b) -> bool:
    return bool(torch.equal(a.length.cpu(), b.length.cpu()) and
                torch.equal(a.count.cpu(), b.count.cpu()) and
                torch.equal(a.positions.cpu(), b.positions.cpu()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32K,1M", help="corpus sizes (100M for a GPU)")
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-depth", type=int, default=TierConfig().max_depth,
                    help="longest match searched (default: the tiers', as the drafter runs)")
    ap.add_argument("--max-positions", type=int, default=8)
    ap.add_argument("--max-scan", type=int, default=256)
    ap.add_argument("--query-len", type=int, default=64)
    ap.add_argument("--baseline-budget-s", type=float, default=None,
                    help="unfold: skip configurations predicted slower than this per call, "
                         "and stop repeating once this much time is spent (CPU 6, CUDA 10)")
    ap.add_argument("--no-unfold", action="store_true")
    ap.add_argument("--no-suffix-decoding", action="store_true")
    ap.add_argument("--sd-max-size", default="16M",
                    help="skip SuffixDecoding above this corpus size (its CPU tree takes "
                         "about 2.7 s per 1M tokens and ~300 bytes per token to build on CPU)")
    ap.add_argument("--sd-spec-tokens", type=int, default=8,
                    help="SuffixDecoding max_spec_tokens (draft size it builds)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 30 s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.batch, args.repeats = "32K,256K", "1,16,256", 3
        args.baseline_budget_s = args.baseline_budget_s or 1.0
    device = pick_device(args.device)
    setup_threads(device, args.threads)
    budget = args.baseline_budget_s or (6.0 if device.type == "cpu" else 10.0)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    batches = [int(b) for b in args.batch.split(",") if b]
    L, D, P = args.query_len, args.max_depth, args.max_positions
    arr_all, corpus_info = load_code_tokens(max(sizes), args.cache_dir)
    sd_cls = None if args.no_suffix_decoding else suffix_decoding_cache_cls()
    use_triton = device.type == "cuda"
    triton_note = None
    if use_triton:
        try:
            import agspec_gpu.kernels.suffix_match_triton  # noqa: F401
        except ImportError as e:  # the kernel may not exist yet
            use_triton, triton_note = False, f"Triton kernel unavailable ({e}); torch path"
            print(triton_note, file=sys.stderr)

    rows: list[dict] = []
    wide: list[dict] = []
    mismatches = 0
    extra: dict = {}
    unfold_prev: tuple[int, int, float] | None = None  # (size, B, seconds) last measured
    for size in sizes:
        arr = arr_all[:size]
        tokens = torch.from_numpy(arr.copy()).to(device)
        t0 = time.perf_counter()
        idx = SuffixIndex.build(tokens, max_depth=D)
        sync(device)
        extra[f"agspec_build_s_{fmt_size(size)}"] = time.perf_counter() - t0
        sd = None
        if sd_cls is not None and size <= parse_size(args.sd_max_size):
            t0 = time.perf_counter()
            sd = build_suffix_decoding(sd_cls, arr, D)
            extra[f"suffix_decoding_build_s_{fmt_size(size)}"] = time.perf_counter() - t0
        for B in batches:
            rng = random.Random(args.seed * 1_000_003 + size * 7 + B)
            q_np, ks = make_queries(arr, B, L, rng)
            q = torch.from_numpy(q_np).to(device)
            lens = torch.full((B,), L, dtype=torch.int32, device=device)
            ref = idx.match(q, lens, max_positions=P, use_triton=use_triton)
            mean_len = float(ref.length.float().mean())
            res: dict[str, dict] = {}

            def record(method: str, times: list[float] | None, **kw) -> None:
                r = {"size": size, "batch": B, "method": method, **kw}
                if times:
                    s = summarize(times)
                    r |= {"median_ms": s["median"] * 1e3, "p90_ms": s["p90"] * 1e3,
                          "min_ms": s["min"] * 1e3, "max_ms": s["max"] * 1e3, "n": s["n"],
                          "us_per_query": s["median"] * 1e6 / B}
                rows.append(r)
                res[method] = r

            record("agspec", measure(lambda: idx.match(q, lens, max_positions=P,
                                                         use_triton=use_triton),
                                     device, args.repeats), mean_match_len=mean_len,
                   path="triton" if use_triton else "torch")
            desc = idx.arena.descriptors([idx.cid] * B)
            record("agspec-launch", measure(lambda: suffix_match(
                idx.arena.tokens, idx.arena.sa, desc, q, lens, max_depth=D, max_positions=P,
                use_triton=use_triton, sa_key=idx.arena.sa_key), device, args.repeats),
                mean_match_len=mean_len)
            record("agspec-launch-scan", measure(lambda: suffix_match(
                idx.arena.tokens, idx.arena.sa, desc, q, lens, max_depth=D, max_positions=P,
                max_scan=args.max_scan, use_triton=use_triton, sa_key=idx.arena.sa_key),
                device, args.repeats),
                mean_match_len=mean_len, max_range=int((ref.sa_hi - ref.sa_lo).max()))
            if use_triton:  # the same launch with binary searches: what the fan-out saves
                from agspec_gpu.kernels.suffix_match_triton import suffix_match_triton

                def binary():
                    return suffix_match_triton(idx.arena.tokens, idx.arena.sa, desc, q, lens,
                                               max_depth=D, max_positions=P,
                                               max_scan=args.max_scan, fan=1)
                ok = same(binary(), suffix_match(idx.arena.tokens, idx.arena.sa, desc, q, lens,
                                                 max_depth=D, max_positions=P,
                                                 max_scan=args.max_scan, use_triton=True))
                mismatches += not ok
                record("agspec-launch-binary", measure(binary, device, args.repeats),
                       mean_match_len=mean_len, equal_to_agspec=ok)
            if device.type == "cuda":
                record("agspec-torch", measure(lambda: idx.match(q, lens, max_positions=P,
                                                               use_triton=False),
                                               device, args.repeats), mean_match_len=mean_len)
            if not args.no_unfold:
                pred = None
                if unfold_prev is not None:
                    ps, pb, pt = unfold_prev
                    pred = pt * (size / ps) * (B / pb)
                if pred is not None and pred > budget:
                    record("unfold", None, skipped=True, predicted_ms=pred * 1e3)
                else:
                    out: list = []
                    times = measure(lambda: out.append(unfold_match(
                        tokens, q, lens, max_depth=D, max_positions=P)), device,
                        args.repeats, warmup=0, budget_s=budget)
                    unfold_prev = (size, B, statistics.median(times))
                    ok = same(ref, out[0])
                    mismatches += not ok
                    record("unfold", times, equal_to_agspec=ok,
                           mean_match_len=float(out[0].length.float().mean()))
            if sd is not None:
                ctx = [np.ascontiguousarray(r) for r in q_np]
                drafts: list = []

                def run_sd() -> None:
                    drafts.clear()
                    for c in ctx:
                        drafts.append(sd.speculate("bench", c, max_spec_tokens=args.sd_spec_tokens,
                                                   max_spec_factor=1.0, min_token_prob=0.1,
                                                   use_tree_spec=True))

                times = measure(run_sd, torch.device("cpu"), args.repeats)
                record("suffix-decoding", times,
                       mean_match_len=statistics.fmean(d.match_len for d in drafts))
            a = res["agspec"]
            w = {"size_h": fmt_size(size), "batch": B, "mean_len": mean_len,
                 "agspec_med": a["median_ms"], "agspec_p90": a["p90_ms"],
                 "launch_med": res["agspec-launch"]["median_ms"],
                 "scan_med": res["agspec-launch-scan"]["median_ms"],
                 "max_range": res["agspec-launch-scan"]["max_range"]}
            if "agspec-torch" in res:
                w["torch_med"] = res["agspec-torch"]["median_ms"]
            if "agspec-launch-binary" in res:
                w["binary_med"] = res["agspec-launch-binary"]["median_ms"]
                w["x_binary"] = w["binary_med"] / w["scan_med"]
            u = res.get("unfold")
            if u is not None:
                w["unfold_med"] = u.get("median_ms")
                w["unfold_pred"] = f"~{u['predicted_ms']:.0f} (skipped)" if u.get("skipped") \
                    else None
                # a skipped configuration's ratio is a prediction: its own column, marked
                w["x_unfold"] = u["median_ms"] / a["median_ms"] if u.get("median_ms") else None
                w["x_unfold_pred"] = f"~{u['predicted_ms'] / a['median_ms']:.3g}" \
                    if u.get("skipped") else None
            if "suffix-decoding" in res:
                w["sd_med"] = res["suffix-decoding"]["median_ms"]
                w["sd_p90"] = res["suffix-decoding"]["p90_ms"]
                w["sd_len"] = res["suffix-decoding"]["mean_match_len"]
                w["x_sd"] = w["sd_med"] / a["median_ms"]
            wide.append(w)
            print(f"  {fmt_size(size)} B={B}: agspec {a['median_ms']:.2f} ms", file=sys.stderr)
        del idx, sd

    env = environment(device)
    print(f"\nagspec_gpu batched match — {env['device']}"
          f"{' (' + env['gpu'] + ')' if 'gpu' in env else ''}, torch {env['torch']}, "
          f"{env['torch_threads']} thread(s), agspec path: "
          f"{'triton' if use_triton else 'torch'}, max_depth {D}, P {P}, query {L} tokens"
          f"\ncorpus: real cl100k code tokens; milliseconds per batched call (median, p90 over "
          f"{args.repeats}); x = median speedup of agspec")
    cols = [("tokens", "size_h", ""), ("B", "batch", "d"), ("mean len", "mean_len", ".1f"),
            ("agspec", "agspec_med", ".2f"), ("p90", "agspec_p90", ".2f"),
            ("launch only", "launch_med", ".2f"),
            (f"launch, max_scan {args.max_scan}", "scan_med", ".2f"),
            ("widest range", "max_range", "d")]
    if use_triton:
        cols += [("binary search", "binary_med", ".2f"), ("x binary", "x_binary", ".3g")]
    if device.type == "cuda":
        cols.append(("torch path", "torch_med", ".2f"))
    if not args.no_unfold:
        cols += [("unfold", "unfold_med", ".1f"), ("unfold predicted", "unfold_pred", ""),
                 ("x unfold", "x_unfold", ".3g"), ("x unfold predicted", "x_unfold_pred", "")]
    if sd_cls is not None:
        cols += [("suffix-dec", "sd_med", ".2f"), ("p90", "sd_p90", ".2f"),
                 ("sd len", "sd_len", ".1f"), ("x sd", "x_sd", ".3g")]
    print_table("", wide, cols)
    print("build seconds: " + ", ".join(f"{k.replace('_build_s_', ' ')} {v:.2f}"
                                        for k, v in extra.items()))
    if sd_cls is None and not args.no_suffix_decoding:
        print("suffix-decoding: arctic-inference not installed "
              "(bench/install_arctic_inference.sh); column omitted")
    if mismatches:
        print(f"WARNING: agspec disagrees with unfold or with its binary search on "
              f"{mismatches} configuration(s)")
    config = {"argv": sys.argv[1:] if argv is None else argv, "sizes": sizes,
              "batches": batches, "repeats": args.repeats, "max_depth": D,
              "max_positions": P, "max_scan": args.max_scan, "query_len": L,
              "unfold_budget_s": budget,
              "suffix_decoding": sd_cls is not None, "sd_spec_tokens": args.sd_spec_tokens,
              "agspec_path": "triton" if use_triton else "torch", "triton_note": triton_note,
              "agspec_unfold_mismatches": mismatches, "corpus": corpus_info, **extra, **env}
    jp, cp = write_results(args.out or default_out("match", device), rows, config)
    print(f"\nwrote {jp} and {cp}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
