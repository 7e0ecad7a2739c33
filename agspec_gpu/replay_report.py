"""Presenting a replay report: a rich table for people, JSON / CSV for machines, and plots.

The JSON layout is DESIGN.md "Replay output": ``{"results": [row, ...], "config": {...}}``.
The CSV flattens each row: ``p_acc`` becomes ``p_acc_1 .. p_acc_32`` and the share dicts
become ``tier_share_<tier>`` / ``form_share_<form>`` columns.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from agspec_gpu.replay import ReplayReport

# (row key, column title, format) of the table printed at the end of a run.
_TABLE_COLUMNS = (
    ("drafter", "drafter", "{}"),
    ("agent", "agent", "{}"),
    ("sessions", "sess", "{}"),
    ("steps", "steps", "{}"),
    ("tau", "tau", "{:.2f}"),
    ("acceptance_rate", "acc rate", "{:.1%}"),
    ("drafted_per_step", "drafted/step", "{:.1f}"),
    ("empty_draft_share", "empty", "{:.0%}"),
    ("oracle_tau", "oracle tau", "{:.2f}"),
    ("draft_us_per_step", "draft µs/step", "{:.0f}"),
    ("commit_us_per_step", "commit µs/step", "{:.0f}"),
    ("modelled_speedup", "speedup*", "{:.2f}x"),
    ("modelled_batch_speedup", "batch×**", "{:.2f}x"),
    ("modelled_replay_speedup", "replay×***", "{:.2f}x"),
)


def printable(value) -> str:
    """``str(value)`` with lone surrogates written as backslash escapes (``"\\udc80"``).

    A non-UTF-8 file name or record decodes to lone surrogates (``"\\udc80"`` ..
    ``"\\udcff"``), which no strict UTF-8 stream can encode: the table, the CSV and the
    plot escape them, as ``errors="backslashreplace"`` would, instead of failing. Every
    other character is kept.
    """
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def _fmt(value, spec: str) -> str:
    return "—" if value is None else printable(spec.format(value))


def print_table(report: ReplayReport, console=None, title: str | None = None) -> None:
    """Prints drafter x agent rows (``all`` rows in bold) with rich.

    Names and the title are printed as plain text (:func:`printable`, no rich markup): an
    agent format named ``"[/x]"`` or holding a lone surrogate prints as it is, escaped.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title=None if title is None else Text(printable(title)), header_style="bold")
    for key, name, _ in _TABLE_COLUMNS:
        if key in ("drafter", "agent"):  # whole names (suffix-decoding-nocache / -warm)
            width = max((len(printable(str(r[key]))) for r in report.rows), default=0)
            table.add_column(name, justify="left", no_wrap=True, min_width=min(width, 32))
        else:
            table.add_column(name, justify="right")
    for row in report.rows:
        table.add_row(*(Text(_fmt(row.get(k), spec)) for k, _, spec in _TABLE_COLUMNS),
                      style="bold" if row["agent"] == "all" else None,
                      end_section=row["agent"] == "all")
    console.print(table)
    cost = report.config.get("cost_model", {})
    console.print(Text(printable(
        f"* modelled speedup = {report.config.get('speedup_model')}; ** with B the mean "
        f"batch: {report.config.get('batch_speedup_model')}; *** step by step: "
        f"{report.config.get('replay_speedup_model')}; cost model: "
        f"{cost.get('source', '?')}. tau counts accepted + bonus tokens per step.")))


def write_json(report: ReplayReport, path: str | Path) -> None:
    # ASCII (json's ensure_ascii): a lone surrogate is kept as its "\\udc80" escape
    Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")


def flatten_row(row: dict) -> dict:
    """A row with its list/dict values spread over scalar columns (for CSV)."""
    flat = {}
    for key, value in row.items():
        if key == "p_acc":
            flat.update({f"p_acc_{k}": p for k, p in enumerate(value, 1)})
        elif isinstance(value, dict):
            flat.update({f"{key}_{name}": v for name, v in value.items()})
        else:
            flat[key] = value
    return flat


def write_csv(report: ReplayReport, path: str | Path) -> None:
    rows = [flatten_row(r) for r in report.rows]
    fields: list[str] = []
    for r in rows:  # union of columns, first-seen order (share columns vary per drafter)
        fields += [k for k in r if k not in fields]
    # UTF-8 whatever the locale; a lone surrogate escaped as in the table (printable)
    with open(path, "w", newline="", encoding="utf-8", errors="backslashreplace") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_plot(report: ReplayReport, path: str | Path) -> None:
    """Two panels: ``P_acc(k)`` per drafter (all agents), and ``tau`` per drafter per agent
    format (bars; the oracle bound as a marker where known)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    rows = report.rows
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    agents = list(dict.fromkeys(r["agent"] for r in rows))
    by = {(r["drafter"], r["agent"]): r for r in rows}
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.8))
    for d in drafters:
        r = by.get((d, "all"))
        if r and r["steps"]:
            ax0.plot(range(1, len(r["p_acc"]) + 1), r["p_acc"], marker=".", label=printable(d))
    ax0.set(xlabel="k (draft tokens)", ylabel="P(at least k accepted)",
            title="Acceptance curve P_acc(k), all agents", ylim=(0, 1))
    ax0.grid(alpha=0.3)
    ax0.legend(fontsize=8)
    width = 0.8 / max(len(drafters), 1)
    for i, d in enumerate(drafters):
        xs = [a + (i - (len(drafters) - 1) / 2) * width for a in range(len(agents))]
        ax1.bar(xs, [(by.get((d, a)) or {}).get("tau") or 0 for a in agents], width,
                label=printable(d))
    for a, agent in enumerate(agents):
        oracle = next((r["oracle_tau"] for r in rows
                       if r["agent"] == agent and r.get("oracle_tau") is not None), None)
        if oracle is not None:
            ax1.plot([a - 0.4, a + 0.4], [oracle, oracle], "k--", lw=1)
    ax1.set_xticks(range(len(agents)), [printable(a) for a in agents], rotation=15, fontsize=8)
    ax1.set(ylabel="tau (tokens per step)", title="tau per agent format (dashed: oracle)")
    ax1.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_rows(row_sets: list[list[dict]], cost_model) -> list[dict]:
    """Rows of several replays of the same drafters on disjoint sessions, summed.

    Every figure is a ratio of counts the rows carry (``steps``, ``target_tokens``, the
    per-step means), so the merge is exact: ``tau = sum(target_tokens) / sum(steps)``,
    acceptance = accepted / drafted, ``P_acc`` and the shares weighted by steps and by
    attributed accepted tokens, the oracle's steps recovered as ``target_tokens /
    oracle_tau`` (its tokens are the same messages), a lane's ``modelled_ms`` as the sum of
    its ``"all"`` rows' (every agent row carries the lane's, as in a replay). Row order:
    drafters as they first appear, agent formats sorted, then ``"all"`` (as a replay orders
    them).
    """
    from agspec_gpu.replay_stats import add_replay_speedups, drafter_us_per_step, \
        modelled_batch_speedup, modelled_speedup

    groups: dict[tuple[str, str], list[dict]] = {}
    for rows in row_sets:
        for r in rows:
            groups.setdefault((r["drafter"], r["agent"]), []).append(r)
    drafters = list(dict.fromkeys(d for d, _ in groups))
    agents = sorted({a for _, a in groups if a != "all"}) + ["all"]
    out = []
    for drafter, agent in ((d, a) for d in drafters for a in agents if (d, a) in groups):
        rs = groups[(drafter, agent)]
        steps = sum(r["steps"] for r in rs)
        tt = sum(r["target_tokens"] for r in rs)
        wsum = lambda key: sum((r.get(key) or 0.0) * r["steps"] for r in rs)  # noqa: E731
        acc, drafted = wsum("accepted_per_step"), wsum("drafted_per_step")
        per = lambda x: x / steps if steps else None  # noqa: E731
        attributed = [(r.get("attributed_accepted_share") or 0.0)
                      * (r["accepted_per_step"] or 0.0) * r["steps"] for r in rs]

        def shares(key: str) -> dict:
            tot = sum(attributed)
            names = dict.fromkeys(n for r in rs for n in r.get(key, {}))
            return {n: sum(r.get(key, {}).get(n, 0.0) * a for r, a in zip(rs, attributed))
                    / tot for n in names} if tot else {}

        o_known = all(r.get("oracle_tau") for r in rs)
        o_steps = sum(r["target_tokens"] / r["oracle_tau"] for r in rs) if o_known else None
        tau = per(tt)
        row = {
            "drafter": drafter, "agent": agent,
            "sessions": sum(r["sessions"] for r in rs),
            "messages": sum(r["messages"] for r in rs),
            "target_tokens": tt, "steps": steps, "tau": tau,
            "acceptance_rate": acc / drafted if drafted else None,
            "drafted_per_step": per(drafted),
            "empty_draft_share": per(wsum("empty_draft_share")),
            "oracle_tau": tt / o_steps if o_steps else None,
            "draft_us_per_step": per(wsum("draft_us_per_step")),
            "commit_us_per_step": per(wsum("commit_us_per_step")),
            "accepted_per_step": per(acc),
            "wasted_per_step": per(drafted - acc),
            "p_acc": [sum(r["p_acc"][k] * r["steps"] for r in rs) / steps if steps else 0.0
                      for k in range(len(rs[0]["p_acc"]))],
            "tier_share": shares("tier_share"),
            "form_share": shares("form_share"),
            "attributed_accepted_share": sum(attributed) / acc if acc and any(attributed)
            else None,
        }
        row["modelled_speedup"] = modelled_speedup(
            tau, row["drafted_per_step"],
            drafter_us_per_step(row["draft_us_per_step"], row["commit_us_per_step"]), cost_model)
        # lane-level, as in a replay (every agent's row holds its lane's batch figures and
        # times): from the "all" rows of the replays, also where this agent was absent
        lane = groups.get((drafter, "all"), [])
        if lane and all(r.get("mean_batch") for r in lane):
            bsteps = sum(r["batch_steps"] for r in lane)
            row["batch_steps"] = bsteps
            row["mean_batch"] = sum(r["mean_batch"] * r["batch_steps"] for r in lane) / bsteps
            row["modelled_batch_speedup"] = modelled_batch_speedup(
                tau, row["drafted_per_step"], row["mean_batch"], cost_model)
        lane_ms = [r.get("modelled_ms") for r in lane]
        row["modelled_ms"] = sum(lane_ms) if lane_ms and None not in lane_ms else None
        out.append(row)
    add_replay_speedups(out)
    return out
