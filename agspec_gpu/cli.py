"""``agspec-gpu`` command line (also ``python -m agspec_gpu``).

Subcommands:

- ``replay PATH...``: teacher-forced acceptance replay of trajectory files through drafters;
  prints a table, writes JSON (the design's "Replay output", ../shared/DESIGN.md), CSV and
  plots on request.
- ``demo [REPO]``: the same on sessions built from a git repository's history (the current
  one by default), with no outside data; runs in well under a minute.
- ``profile TRAJ... -o profiles.json``: per-role draft caps from replayed acceptance curves.
- ``build-global --src DIR... -o FILE``: builds the read-only global corpus offline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.text import Text

from agspec_gpu.replay import MAX_BATCH_SIZE, MAX_ORACLE_K
from agspec_gpu.replay_lanes import AGSPEC_DRAFTERS, DRAFTER_NAMES, agspec_unavailable_reason
from agspec_gpu.replay_report import printable

_HOST_DEFAULT = ("none", "pld-hf", "pld-vllm", "suffix-decoding")



class Unavailable(RuntimeError):
    """Something this install lacks (a module, the git executable). No argument can fix it,
    so it exits 1, not 2 as bad input (arguments, files, configs: ``ValueError`` /
    ``OSError``) does."""


class _PipeConsole(Console):
    """A rich console that survives stdout becoming a closed pipe (``agspec-gpu ... | head``).

    Rich's own :meth:`Console.on_broken_pipe` exits at once, so a replay piped to ``head``
    lost its ``--json`` file. Here the console goes quiet (stdout to ``/dev/null``, as the
    Python docs' note on SIGPIPE does) and, when the command still has files to write
    (``keep_going``), lets it run on to write them; ``main`` then exits 1 without a message.
    """

    def __init__(self, *args, keep_going: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep_going = keep_going
        self.pipe_closed = False

    def on_broken_pipe(self) -> None:
        self.quiet = True
        self.pipe_closed = True
        _stdout_to_devnull()
        if not self.keep_going:
            raise SystemExit(1)


def _stdout_to_devnull() -> None:
    """Points file descriptor 1 at ``/dev/null``: later writes and the flush at exit then
    succeed instead of raising ``BrokenPipeError`` again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _say(console: Console, text: str, style: str | None = None) -> None:
    """Prints ``text`` as plain text: no rich markup (a path may hold ``[/x]``), lone
    surrogates escaped (:func:`printable`)."""
    console.print(Text(printable(text), style=style or ""))


class _RichProgress:
    """:class:`agspec_gpu.replay.ReplayProgress` as a rich progress bar over target tokens."""

    def __init__(self, console) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self._progress = Progress(TextColumn("{task.description:<26}"), BarColumn(),
                                  MofNCompleteColumn(), TextColumn("tokens"),
                                  TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                                  transient=False)
        self._task = None

    def start(self, name: str, total_tokens: int) -> None:
        if self._task is None:
            self._progress.start()
        else:
            self._progress.stop_task(self._task)
        self._task = self._progress.add_task(name, total=total_tokens)

    def advance(self, tokens: int) -> None:
        self._progress.advance(self._task, tokens)

    def stop(self) -> None:
        pass  # the bar stays until close(), so every pass is listed

    def close(self) -> None:
        if self._task is not None:
            self._progress.stop()


def _default_drafters(include_pld_vllm: bool = True) -> list[str]:
    from agspec_gpu.baselines import suffix_decoding_available

    out = [d for d in _HOST_DEFAULT if include_pld_vllm or d != "pld-vllm"]
    if not suffix_decoding_available():
        out.remove("suffix-decoding")
    if agspec_unavailable_reason() is None:
        out.append("agspec")
    return out


def _at_least(lo: int, at_most: int | None = None):
    """An argparse type: an int >= ``lo`` (and <= ``at_most``); argparse names the option in
    its error and exits 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < lo or (at_most is not None and value > at_most):
            bound = f">= {lo}" if at_most is None else f"in [{lo}, {at_most}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def _add_replay_options(p: argparse.ArgumentParser, *, default_drafters: str | None,
                        drafters: Sequence[str] = DRAFTER_NAMES) -> None:
    """The replay's options; ``default_drafters``: what the command replays without
    ``--drafter`` (None: no ``--drafter`` option), one of ``drafters``."""
    if default_drafters is not None:
        p.add_argument("--drafter", nargs="+", metavar="NAME", choices=drafters,
                       help=f"drafters to replay (default: {default_drafters}); one of "
                            f"{', '.join(drafters)}")
    p.add_argument("--tokenizer", default="cl100k",
                   help="'cl100k' (offline tiktoken cl100k_base) or a local HF tokenizer path")
    p.add_argument("--batch-size", type=_at_least(1, MAX_BATCH_SIZE), default=64,
                   help=f"continuous batch size (64; at most {MAX_BATCH_SIZE})")
    p.add_argument("--tenant-by", choices=("session", "agent"), default="session",
                   help="tenant of a session: itself (default) or its agent format")
    p.add_argument("--global", dest="global_corpus", metavar="FILE",
                   help="global corpus from `agspec-gpu build-global` (never built from the "
                        "replayed sessions)")
    p.add_argument("--half", type=int, choices=(0, 1),
                   help="replay only sessions of this half (see build-global --half)")
    p.add_argument("--device", default="cpu", help="device of the agspec corpora (cpu, cuda)")
    p.add_argument("--oracle-k", type=_at_least(1, MAX_ORACLE_K), default=32,
                   help=f"oracle depth cap (at most and by default {MAX_ORACLE_K}, the depth "
                        f"its corpora are indexed to)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle passes")
    p.add_argument("--cost-model", metavar="FILE",
                   help="verification cost model JSON: one curve, or a calibration of "
                        "several batch sizes (bench_e2e.py's cost-<model>-<gpu>-<date>.json: the "
                        "curve of the smallest batch >= --batch-size) (default: 8B bf16 on "
                        "H200 estimate)")
    p.add_argument("--threads", type=_at_least(1), default=1,
                   help="torch CPU threads (1: the replay's many small ops run fastest "
                        "single-threaded)")
    p.add_argument("--workers", type=_at_least(1), default=1,
                   help="processes, one torch thread each: the sessions are split into this "
                        "many shards of equal target tokens (1)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    p.add_argument("--plot", metavar="PNG", help="plot P_acc(k) and tau per agent format")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="agspec-gpu", description="GPU-resident retrieval drafting for coding agents: "
        "acceptance replay, demo, role profiling and the global corpus.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("replay", help="acceptance replay of agent trajectories")
    p.add_argument("paths", nargs="+", metavar="PATH", help="trajectory files or directories")
    p.add_argument("--max-sessions", type=_at_least(0), metavar="N",
                   help="replay at most the first N sessions of each PATH")
    p.add_argument("--cross-halves", action="store_true",
                   help="replay every session with a global tier built from the other half "
                        "of the given trajectory files (both halves, counters summed)")
    _add_replay_options(p, default_drafters="none, pld-hf, pld-vllm, suffix-decoding if "
                        "installed (and suffix-decoding-warm with --cross-halves), agspec")

    p = sub.add_parser("demo", help="replay sessions built from a git repository's history")
    p.add_argument("repo", nargs="?", default=".", help="repository (default: the current one)")
    p.add_argument("--max-commits", type=_at_least(1), default=20,
                   help="newest commits to use (20)")
    p.add_argument("--max-session-chars", type=_at_least(1), default=120_000,
                   help="leave out commits whose session text is longer (120,000 characters: "
                        "a session replays step by step, so the longest sets the run time)")
    # (no suffix-decoding-warm: its cache holds the other half's responses, --cross-halves)
    _add_replay_options(p, default_drafters="none, pld-hf, suffix-decoding if installed, "
                        "agspec", drafters=[d for d in DRAFTER_NAMES
                                            if d != "suffix-decoding-warm"])

    p = sub.add_parser("profile", help="per-role draft caps from replayed P_acc(k) curves")
    p.add_argument("paths", nargs="+", metavar="TRAJ")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="profiles JSON")
    p.add_argument("--max-sessions", type=_at_least(0), metavar="N")
    p.add_argument("--profile-drafter", default="agspec-static-k32", choices=AGSPEC_DRAFTERS,
                   help="drafter whose curves are measured (a static k shows the whole curve)")
    _add_replay_options(p, default_drafters=None)

    p = sub.add_parser("build-global", help="build the read-only global corpus")
    p.add_argument("--src", nargs="*", default=[], metavar="DIR",
                   help="public source trees / files (never the replayed sessions)")
    p.add_argument("--trajectories", nargs="*", default=[], metavar="PATH",
                   help="public agent trajectories; each session becomes one document")
    p.add_argument("--half", type=int, choices=(0, 1),
                   help="only trajectory sessions of this half (replay the other half)")
    p.add_argument("--tokenizer", default="cl100k")
    p.add_argument("--max-depth", type=_at_least(1), default=32, help="index depth; must match the "
                   "store's TierConfig.max_depth (32)")
    p.add_argument("--suffix", nargs="+", default=[".py"], help="file suffixes (.py)")
    p.add_argument("-o", "--out", required=True, metavar="FILE")
    return ap


def _need(module: str, attr: str):
    """``module.attr``, imported lazily, or :class:`Unavailable` naming what is missing."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise Unavailable(f"needs {module}.{attr}, which is not available ({exc})") from None


def _load_sessions(paths: Sequence[str], max_sessions: int | None) -> list:
    from agspec_gpu.trajectories import load_sessions

    out = []
    for p in paths:
        out += load_sessions(p, limit=max_sessions)
    return out


def _of_half(sessions: list, half: int | None) -> list:
    """The sessions of ``--half`` (all when None); ValueError when it leaves none."""
    if half is None:
        return sessions
    from agspec_gpu.tiers import session_half

    kept = [s for s in sessions if session_half(s.task_id) == half]
    if sessions and not kept:
        raise ValueError(f"--half {half}: none of the {len(sessions)} sessions read is in "
                         f"half {half}")
    return kept


def _distinct(names: Sequence[str] | None) -> list[str] | None:
    """``--drafter``'s names, each once (in order): a repeated lane would replay twice and
    report its rows twice."""
    return None if names is None else list(dict.fromkeys(names))


def _run(args, sessions: list, drafters: list[str], console, title: str):
    import torch

    from agspec_gpu.cost_model import curve_at
    from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
    from agspec_gpu.replay_report import print_table, write_csv, write_json, write_plot
    from agspec_gpu.tokenizer import load_tokenizer

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise ValueError(f"--device: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device here")
    torch.set_num_threads(args.threads)
    for d in drafters:
        if d in AGSPEC_DRAFTERS and agspec_unavailable_reason() is not None:
            raise Unavailable(f"--drafter {d}: {agspec_unavailable_reason()}")
    tokenizer = load_tokenizer(args.tokenizer)
    config = ReplayConfig(
        batch_size=args.batch_size, tenant_by=args.tenant_by, oracle=not args.no_oracle,
        oracle_k=args.oracle_k, device=args.device, global_corpus=args.global_corpus,
        workers=args.workers, cost_model=curve_at(args.cost_model, args.batch_size))
    t0 = time.perf_counter()
    # Workspace captures cost a pass over every message; only agspec and the oracle use them.
    needs_files = any(d in AGSPEC_DRAFTERS for d in drafters) or (
        config.oracle and agspec_unavailable_reason() is None)
    corpus = tokenize_sessions(sessions, tokenizer, capture_files=needs_files)
    if not any(s.target_messages for s in corpus.sessions):
        raise ValueError(f"no session with a non-empty assistant message to replay "
                         f"({len(sessions)} sessions read)")
    if "all" in corpus.agents:
        raise ValueError("agent format 'all' is reserved: the report's rows over every "
                         "format are named so")
    _say(console, f"{len(corpus.sessions)} sessions, {len(corpus.stream):,} tokens "
         f"({tokenizer.name}) in {time.perf_counter() - t0:.1f}s; drafters: "
         f"{', '.join(drafters)}")
    progress = None if args.no_progress else _RichProgress(console)
    with tempfile.TemporaryDirectory(prefix="agspec-halves-") as tmp:
        halves = _cross_half_globals(sessions, tokenizer, tmp, console) \
            if getattr(args, "cross_halves", False) else None
        try:
            report = run_replay(corpus, drafters, tokenizer, config, progress=progress,
                                inputs=getattr(args, "paths", None) or
                                [getattr(args, "repo", "")], cross_halves=halves)
        finally:
            if progress is not None:
                progress.close()
    # the files before the table: they survive a table that cannot be printed
    if args.json:
        write_json(report, args.json)
    if args.csv:
        write_csv(report, args.csv)
    print_table(report, console, title=title)
    if args.plot:  # after the table: matplotlib is an optional dependency
        write_plot(report, args.plot)
    return report


def _cross_half_globals(sessions: list, tokenizer, tmp: str, console) -> tuple[str, str]:
    """Global corpora of half 0 and half 1 of the replayed sessions, in ``tmp``: those the
    run loaded (``--max-sessions`` cuts them as it cuts the replay, and a warm
    SuffixDecoding's cache holds their responses too)."""
    from agspec_gpu.tiers import TierConfig, build_global_corpus, session_half

    num = [sum(session_half(s.task_id) == h for s in sessions) for h in (0, 1)]
    if 0 in num:
        raise ValueError(f"--cross-halves: all {len(sessions)} sessions read are in half "
                         f"{num.index(len(sessions))}; give more (--max-sessions)")
    out = []
    for h in (0, 1):
        t0 = time.perf_counter()
        path = str(Path(tmp) / f"half{h}.agspec")
        g = build_global_corpus([], tokenizer, path, max_depth=TierConfig().max_depth,
                                sessions=sessions, half=h)
        _say(console, f"global tier of half {h}: {g.tokens.numel():,} tokens "
             f"({time.perf_counter() - t0:.1f}s)")
        out.append(path)
    return out[0], out[1]


def _cmd_replay(args, console) -> int:
    if args.cross_halves and (args.global_corpus or args.half is not None):
        raise ValueError("--cross-halves builds its own global tiers: drop --global / --half")
    sessions = _of_half(_load_sessions(args.paths, args.max_sessions), args.half)
    drafters = _distinct(args.drafter) or _default_drafters()
    if args.cross_halves and not args.drafter and "suffix-decoding" in drafters:
        # next to agspec's global tier of the other half: SuffixDecoding whose cache holds
        # that half's responses
        drafters.insert(drafters.index("suffix-decoding") + 1, "suffix-decoding-warm")
    _run(args, sessions, drafters, console, "replay")
    return 0


def _cmd_demo(args, console) -> int:
    from agspec_gpu.gitlog import GitError, sessions_from_git

    try:
        sessions = sessions_from_git(args.repo, max_commits=args.max_commits)
    except GitError as exc:
        if shutil.which("git") is None:
            raise Unavailable(str(exc)) from None
        raise ValueError(f"REPO {exc}") from None  # the message starts with the path
    if not sessions:
        raise ValueError(f"REPO {args.repo}: no commit that modifies a text file")
    kept = [s for s in sessions if sum(len(m.content) for m in s.messages)
            <= args.max_session_chars]
    if not kept:
        raise ValueError(f"--max-session-chars {args.max_session_chars}: every session is "
                         f"longer")
    left_out = len(sessions) - len(kept)
    sessions = _of_half(kept, args.half)
    drafters = _distinct(args.drafter) or _default_drafters(include_pld_vllm=False)
    if "agspec" not in drafters and args.drafter is None:
        _say(console, f"agspec skipped: {agspec_unavailable_reason()}", style="yellow")
    _run(args, sessions, drafters, console, f"demo: {len(sessions)} sessions from "
         f"{Path(args.repo).resolve().name} git history"
         + (f" ({left_out} longer than {args.max_session_chars:,} characters left out)"
            if left_out else ""))
    return 0


def _cmd_profile(args, console) -> int:
    profile_roles = _need("agspec_gpu.controller", "profile_roles")
    from agspec_gpu.cost_model import CostModel

    sessions = _of_half(_load_sessions(args.paths, args.max_sessions), args.half)
    # One curve per agent format (the replay passes the format as the role); sessions of an
    # unprofiled format use "default", profiled on all sessions.
    if any(s.agent == "default" for s in sessions):
        raise ValueError("agent format 'default' is reserved: the profile of every format "
                         "is named so")
    report = _run(args, sessions, [args.profile_drafter], console, "profile")
    curves = {r["agent"]: r["p_acc"] for r in report.rows if r["steps"]}
    curves["default"] = curves.pop("all")
    profiles = profile_roles(curves, cost=CostModel.from_json(report.config["cost_model"]),
                             out=args.out)
    for role, prof in sorted(profiles.items()):
        _say(console, f"{role}: draft_cap={prof.draft_cap}")
    _say(console, f"wrote {args.out}")
    return 0


def _cmd_build_global(args, console) -> int:
    build = _need("agspec_gpu.tiers", "build_global_corpus")
    from agspec_gpu.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    if not args.src and not args.trajectories:
        raise ValueError("give --src and/or --trajectories")
    if args.half is not None and not args.trajectories:
        raise ValueError("--half selects trajectory sessions: give --trajectories")
    with warnings.catch_warnings(record=True) as left_out:  # files or documents not taken
        warnings.simplefilter("always")
        g = build(list(args.src), load_tokenizer(args.tokenizer), args.out,
                  max_depth=args.max_depth, suffixes=tuple(args.suffix),
                  trajectories=list(args.trajectories), half=args.half)
    for w in left_out:
        _say(console, f"warning: {w.message}", style="yellow")
    _say(console, f"wrote {args.out}: {g.tokens.numel():,} tokens in "
         f"{time.perf_counter() - t0:.1f}s")
    return 0


def _check_outputs(args) -> None:
    """Each output file asked for can be written where it is named, no two the same file,
    and a plot in a format matplotlib (installed) writes: before a run that takes minutes,
    not after it."""
    seen = _input_files(args)
    for key, option in (("json", "--json"), ("csv", "--csv"), ("plot", "--plot"),
                        ("out", "-o")):
        out = getattr(args, key, None)
        if out is None:
            continue
        if out.endswith(("/", os.sep)) or not Path(out).parent.is_dir() or Path(out).is_dir():
            raise ValueError(f"{option} {out}: not a file path in an existing directory")
        try:  # (os.access passes root anywhere, /proc too)
            with tempfile.NamedTemporaryFile(dir=Path(out).parent, prefix=".agspec-"):
                pass
        except OSError as exc:
            raise ValueError(f"{option} {out}: its directory is not writable "
                             f"({exc.strerror})") from None
        real = os.path.realpath(out)
        if real in seen:
            raise ValueError(f"{option} {out}: the same file as {seen[real]}")
        seen[real] = option
    if getattr(args, "plot", None) is not None:
        _check_plot(args.plot)


def _input_files(args) -> dict[str, str]:
    """``{realpath: "input PATH"}`` of every file the command reads: an output naming one
    would overwrite what it was made from (``replay X.jsonl --json X.jsonl`` had replaced
    the trajectory with its own report). Directories count for the files a run takes from
    them (trajectory files, or ``--src`` files with a ``--suffix``)."""
    from agspec_gpu.trajectories import trajectory_files

    def files(path: str, of_dir) -> list[Path]:
        p = Path(path)
        return of_dir(p) if p.is_dir() else [p]

    def sources(directory: Path) -> list[Path]:
        from agspec_gpu.tiers import source_files  # (build-global's: it needs the index)

        return source_files([directory], args.suffix)

    inputs: dict[str, str] = {}
    named = [files(p, trajectory_files) for k in ("paths", "trajectories")
             for p in getattr(args, k, None) or ()]
    named += [files(p, sources) for p in getattr(args, "src", None) or ()]
    named += [[Path(p)] for p in (getattr(args, k, None) for k in ("global_corpus",
                                                                   "cost_model")) if p]
    for f in (f for group in named for f in group):
        inputs[os.path.realpath(f)] = f"input {f}"
    return inputs


def _check_plot(path: str) -> None:
    """``--plot``'s format is one matplotlib writes, and matplotlib is installed."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise Unavailable(f"--plot needs matplotlib (pip install 'agspec_gpu[bench]'): "
                          f"{exc}") from None

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(f"--plot {path}: expected a file ending in one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agspec-gpu``; returns the exit status.

    0: done. 2: bad input, named in the message (argparse's usage errors raise
    ``SystemExit(2)``; a bad file, path or config is a ``ValueError`` / ``OSError``). 1:
    something the install lacks (:class:`Unavailable`), or stdout was a closed pipe (quietly,
    after the files asked for were written). Anything else is a bug: a traceback. Messages
    of a status 1 or 2 go to stderr (a table redirected to a file still shows them).
    """
    args = _parser().parse_args(argv)
    files = [getattr(args, k, None) for k in ("json", "csv", "plot", "out")]
    # Off a terminal rich would wrap the table at 80 columns; logs and pipes get it whole.
    console = _PipeConsole(width=None if sys.stdout.isatty() else 160,
                           keep_going=any(files))
    errors = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    commands = {"replay": _cmd_replay, "demo": _cmd_demo, "profile": _cmd_profile,
                "build-global": _cmd_build_global}
    try:
        _check_outputs(args)
        status = commands[args.command](args, console)
    except Unavailable as exc:
        _say(errors, f"agspec-gpu {args.command}: {exc}", style="red")
        return 1
    except (ValueError, OSError) as exc:  # bad input files, paths, configs: no traceback
        _say(errors, f"agspec-gpu {args.command}: {exc}", style="red")
        return 2
    return 1 if console.pipe_closed else status


if __name__ == "__main__":
    sys.exit(main())
