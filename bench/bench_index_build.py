"""Index build throughput, memory per token and append latency on real code tokens.

Corpus: the Python standard library's ``*.py`` sources on this machine (then the
interpreter's ``site-packages`` sources if more tokens are asked for, then repeats), tokenized
as whole files with cl100k and joined with a separator ``-1`` between files. The tokenized
array is cached as ``.npy`` (``--cache-dir``), so only the first run pays for tokenizing.

Measured:

* ``build``: ``SuffixIndex.build`` over the first ``size`` tokens (``--sizes``), median and
  spread over ``--repeats``; tokens/s, bytes per indexed (non-separator) token of the corpus
  (tokens + tags + suffix arrays), of the whole arena, and on CUDA the build's peak
  allocation per token.
* ``append_file``: one real 5,000-token file appended to an already built corpus of
  ``--append-base`` tokens that has spare capacity (fresh copy each repeat);
  ``append_file_grow``: the same right after ``build``, whose corpus is full, so the append
  also relocates it into a buffer of twice the size.
* ``append_step``: decode-step appends of k = 1, 2, 4, 8 real tokens, one after another,
  into the corpus with spare capacity (the level builds and merges they trigger show up in
  p99/max).

Usage::

    python bench/bench_index_build.py                       # 1M, 4M, 16M on CPU
    python bench/bench_index_build.py --quick               # < 30 s smoke run
    python bench/bench_index_build.py --device cuda --sizes 1M,4M,16M,100M

Prints a table and writes ``<out>.json`` and ``<out>.csv`` (default
``bench/results/index_build-<date>-<device>``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from agspec_gpu.index import SuffixIndex
from agspec_gpu.tiers import TierConfig
from devices import device_slug, pick_device  # (pick_device: bench_match's too)

SEP = -1
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "agspec_gpu-bench-cache"


# ------------------------------------------------------------------------ real code corpus
def source_files() -> list[Path]:
    """Standard-library ``*.py`` files (sorted), then ``site-packages`` ones (sorted)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    std, site = [], []
    for p in sorted(root.rglob("*.py")):
        (site if "site-packages" in p.relative_to(root).parts else std).append(p)
    return std + site


def load_code_tokens(n: int, cache_dir: Path = DEFAULT_CACHE, verbose: bool = True
                     ) -> tuple[np.ndarray, dict]:
    """At least ``n`` real cl100k tokens of Python sources, files joined by ``-1``.

    Returns ``(int32 [n] array, info)``; ``info`` says how many tokens are unique text and
    how many come from repeating it (only when the machine has fewer source tokens than ``n``).
    The cache holds the longest prefix tokenized so far and grows on demand.
    """
    from agspec_gpu.tokenizer import load_tokenizer

    tok = load_tokenizer("cl100k")
    files = source_files()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{len(files)}files-" \
          f"{tok.fingerprint[:12]}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    npy, meta_path = cache_dir / f"code-cl100k-{tag}.npy", cache_dir / f"code-cl100k-{tag}.json"
    arr = np.load(npy) if npy.exists() and meta_path.exists() else np.zeros(0, np.int32)
    done = json.loads(meta_path.read_text())["files_done"] if arr.size else 0
    if arr.size < n and done < len(files):
        t0 = time.perf_counter()
        parts, have = [arr], arr.size
        while have < n and done < len(files):
            batch = files[done:done + 64]
            texts = [p.read_text(encoding="utf-8", errors="replace") for p in batch]
            for ids in tok.encode_batch(texts):
                parts.append(np.asarray(ids + [SEP], dtype=np.int32))
                have += len(ids) + 1
            done += len(batch)
        arr = np.concatenate(parts)
        np.save(npy, arr)
        meta_path.write_text(json.dumps({"files_done": done, "tokens": int(arr.size)}))
        if verbose:
            print(f"tokenized {done} files -> {arr.size:,} tokens in "
                  f"{time.perf_counter() - t0:.1f} s (cached in {npy})", file=sys.stderr)
    unique = min(arr.size, n)
    if arr.size < n:  # the machine has fewer source tokens than asked: repeat them
        arr = np.tile(arr, -(-n // arr.size))
    return np.ascontiguousarray(arr[:n]), {"unique_tokens": int(unique),
                                           "repeated_tokens": int(n - unique),
                                           "source": "python sources (stdlib, site-packages)",
                                           "tokenizer": "cl100k", "cache": str(npy)}


# ------------------------------------------------------------------------ shared helpers
def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def fmt_size(n: int) -> str:
    for unit, m in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % (m // 16) == 0:
            v = n / m
            return f"{v:g}{unit}"
    return str(n)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def summarize(xs: Sequence[float]) -> dict:
    """median / p90 / p99 / min / max / mean of a list of seconds."""
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"median": statistics.median(s), "p90": q(0.9), "p99": q(0.99), "min": s[0],
            "max": s[-1], "mean": statistics.fmean(s), "n": len(s)}


def setup_threads(device: torch.device, threads: int | None) -> int:
    """On CPU the torch path is many small ops: with a busy or small CPU, intra-op threads
    mostly wait at barriers, so the default is one thread (``--threads`` overrides)."""
    if device.type == "cpu":
        torch.set_num_threads(threads or 1)
    elif threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def environment(device: torch.device) -> dict:
    env = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__,
           "device": str(device), "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def default_out(name: str, device: torch.device) -> str:
    return str(Path(__file__).resolve().parent / "results" /
               f"{name}-{_dt.date.today():%Y%m%d}-{device_slug(device)}")


def write_results(out: str, rows: list[dict], config: dict) -> tuple[Path, Path]:
    """Writes ``<out>.json`` ({"config", "results"}) and ``<out>.csv`` (one row per result)."""
    jp, cp = Path(out + ".json"), Path(out + ".csv")
    jp.parent.mkdir(parents=True, exist_ok=True)
    jp.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with cp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return jp, cp


def print_table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """``cols``: (header, key, format spec); missing values print as ``-``."""
    cells = [[h for h, _, _ in cols]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f) if f else str(r[k]))
                      for _, k, f in cols])
    width = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    print(f"\n{title}")
    for i, c in enumerate(cells):
        print("  ".join(x.rjust(w) for x, w in zip(c, width)))
        if i == 0:
            print("  ".join("-" * w for w in width))


# ------------------------------------------------------------------------ measurements
def bench_build(arr: np.ndarray, sizes: list[int], repeats: int, max_depth: int,
                device: torch.device) -> list[dict]:
    rows = []
    warm = torch.from_numpy(arr[:1 << 16]).to(device)
    SuffixIndex.build(warm, max_depth=max_depth)  # kernels, allocator
    for size in sizes:
        tokens = torch.from_numpy(arr[:size]).to(device)
        indexed = int((tokens >= 0).sum())
        times, idx, peak = [], None, None
        for _ in range(repeats):
            idx = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            holder: list = []
            times.append(time_once(lambda: holder.append(
                SuffixIndex.build(tokens, max_depth=max_depth)), device))
            idx = holder[0]
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - before
        s = summarize(times)
        rows.append({
            "bench": "build", "size": size, "indexed_tokens": indexed, "repeats": repeats,
            "median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
            "mtok_per_s": size / s["median"] / 1e6,
            "bytes_per_indexed_token": idx.nbytes / max(indexed, 1),
            "arena_bytes_per_token": idx.arena.nbytes() / size,
            "peak_build_bytes_per_token": None if peak is None else peak / size,
            "levels": idx.arena.num_levels(idx.cid),
        })
        del idx
        print(f"  build {fmt_size(size)}: {s['median']:.3f} s", file=sys.stderr)
    return rows


def bench_appends(arr: np.ndarray, base_size: int, file_tokens: int, repeats: int,
                  steps: int, max_depth: int, device: torch.device) -> list[dict]:
    """Append latency into a built corpus: one file, then runs of decode steps."""
    base = SuffixIndex.build(torch.from_numpy(arr[:base_size]).to(device), max_depth=max_depth)
    rest = arr[base_size:]
    # a real file-sized append: a separator, then the next file's first tokens
    start = int(np.argmax(rest < 0)) + 1
    file = np.concatenate([[SEP], rest[start:start + file_tokens - 1]]).astype(np.int32)
    file_t = torch.from_numpy(file).to(device)
    sep = torch.full((1,), SEP, dtype=torch.int32, device=device)
    grown = copy.deepcopy(base)
    grown.append(sep)  # a built corpus has no spare capacity: the first append relocates it
    rows = []
    for kind, start_idx in (("append_file", grown), ("append_file_grow", base)):
        times = []
        for _ in range(repeats + 1):
            idx = copy.deepcopy(start_idx)
            times.append(time_once(lambda: idx.append(file_t), device))
        s = summarize(times[1:])  # the first one warms up level building at this size
        rows.append({"bench": kind, "base_size": base_size, "tokens_per_append":
                     int(file.size), "appends": s["n"], **{f"{q}_us": s[q] * 1e6 for q in
                     ("median", "p90", "p99", "max", "mean")}, "min_us": s["min"] * 1e6})
    for k in (1, 2, 4, 8):
        idx = copy.deepcopy(grown)
        chunks = [torch.from_numpy(rest[i * k:(i + 1) * k].copy()).to(device)
                  for i in range(steps)]
        times = [time_once(lambda c=c: idx.append(c), device) for c in chunks]
        s = summarize(times)
        rows.append({"bench": "append_step", "base_size": base_size, "tokens_per_append": k,
                     "appends": s["n"], **{f"{q}_us": s[q] * 1e6 for q in
                     ("median", "p90", "p99", "max", "mean")}, "min_us": s["min"] * 1e6,
                     "levels_after": idx.arena.num_levels(idx.cid)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M", help="corpus sizes, e.g. 1M,4M,16M,100M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-depth", type=int, default=TierConfig().max_depth,
                    help="longest match searched (default: the tiers', as the drafter runs)")
    ap.add_argument("--append-base", default="1M", help="corpus size for the append runs")
    ap.add_argument("--file-tokens", type=int, default=5000)
    ap.add_argument("--append-repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=512, help="decode-step appends per k")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU default 1)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", default=None, help="output prefix for .json and .csv")
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 30 s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.append_base = "64K,256K", 2, "256K"
        args.append_repeats, args.steps = 3, 64
    device = pick_device(args.device)
    setup_threads(device, args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    base_size = parse_size(args.append_base)
    need = max(sizes + [base_size + args.steps * 8 + 2 * args.file_tokens + 1024])
    arr, corpus_info = load_code_tokens(need, args.cache_dir)

    rows = bench_build(arr, sizes, args.repeats, args.max_depth, device)
    rows += bench_appends(arr, base_size, args.file_tokens, args.append_repeats, args.steps,
                          args.max_depth, device)

    env = environment(device)
    print(f"\nagspec_gpu index build — {env['device']}"
          f"{' (' + env['gpu'] + ')' if 'gpu' in env else ''}, torch {env['torch']}, "
          f"{env['torch_threads']} thread(s), max_depth {args.max_depth}, corpus: "
          f"{corpus_info['source']}, cl100k ({corpus_info['unique_tokens']:,} unique tokens"
          f"{', rest repeated' if corpus_info['repeated_tokens'] else ''})")
    for r in rows:
        r["size_h"] = fmt_size(r.get("size", r.get("base_size", 0)))
    print_table("build (median over repeats; spread = min..max)",
                [r | {"spread": f"{r['min_s']:.3f}..{r['max_s']:.3f}"} for r in rows
                 if r["bench"] == "build"],
                [("tokens", "size_h", ""), ("rep", "repeats", "d"), ("median s", "median_s",
                 ".3f"), ("spread s", "spread", ""), ("Mtok/s", "mtok_per_s", ".2f"),
                 ("B/indexed tok", "bytes_per_indexed_token", ".2f"),
                 ("arena B/tok", "arena_bytes_per_token", ".2f"),
                 ("peak B/tok", "peak_build_bytes_per_token", ".1f"), ("levels", "levels", "d")])
    print_table(f"append into a built {fmt_size(base_size)}-token corpus (microseconds)",
                [r for r in rows if r["bench"] != "build"],
                [("kind", "bench", ""), ("tok/append", "tokens_per_append", "d"),
                 ("n", "appends", "d"), ("median", "median_us", ".0f"), ("p90", "p90_us", ".0f"),
                 ("p99", "p99_us", ".0f"), ("max", "max_us", ".0f"), ("mean", "mean_us", ".0f")])
    config = {"argv": sys.argv[1:] if argv is None else argv, "max_depth": args.max_depth,
              "sizes": sizes, "repeats": args.repeats, "append_base": base_size,
              "file_tokens": args.file_tokens, "steps": args.steps, "corpus": corpus_info, **env}
    jp, cp = write_results(args.out or default_out("index_build", device), rows, config)
    print(f"\nwrote {jp} and {cp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
