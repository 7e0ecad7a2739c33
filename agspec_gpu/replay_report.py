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
    ("modelled_speedup", "speedup*", "{:.2f}x"),
)


def _fmt(value, spec: str) -> str:
    return "—" if value is None else spec.format(value)


def print_table(report: ReplayReport, console=None, title: str | None = None) -> None:
    """Prints drafter x agent rows (``all`` rows in bold) with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title, header_style="bold")
    for key, name, _ in _TABLE_COLUMNS:
        table.add_column(name, justify="left" if key in ("drafter", "agent") else "right")
    for row in report.rows:
        table.add_row(*(_fmt(row.get(k), spec) for k, _, spec in _TABLE_COLUMNS),
                      style="bold" if row["agent"] == "all" else None,
                      end_section=row["agent"] == "all")
    console.print(table)
    cost = report.config.get("cost_model", {})
    console.print(f"* modelled speedup = {report.config.get('speedup_model')}; cost model: "
                  f"{cost.get('source', '?')}. tau counts accepted + bonus tokens per step.",
                  highlight=False)


def write_json(report: ReplayReport, path: str | Path) -> None:
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
    with open(path, "w", newline="") as fh:
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
            ax0.plot(range(1, len(r["p_acc"]) + 1), r["p_acc"], marker=".", label=d)
    ax0.set(xlabel="k (draft tokens)", ylabel="P(at least k accepted)",
            title="Acceptance curve P_acc(k), all agents", ylim=(0, 1))
    ax0.grid(alpha=0.3)
    ax0.legend(fontsize=8)
    width = 0.8 / max(len(drafters), 1)
    for i, d in enumerate(drafters):
        xs = [a + (i - (len(drafters) - 1) / 2) * width for a in range(len(agents))]
        ax1.bar(xs, [(by.get((d, a)) or {}).get("tau") or 0 for a in agents], width, label=d)
    for a, agent in enumerate(agents):
        oracle = next((r["oracle_tau"] for r in rows
                       if r["agent"] == agent and r.get("oracle_tau") is not None), None)
        if oracle is not None:
            ax1.plot([a - 0.4, a + 0.4], [oracle, oracle], "k--", lw=1)
    ax1.set_xticks(range(len(agents)), agents, rotation=15, fontsize=8)
    ax1.set(ylabel="tau (tokens per step)", title="tau per agent format (dashed: oracle)")
    ax1.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
