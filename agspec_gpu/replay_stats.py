"""The replay's per-agent figures.

Teacher forcing: the target's greedy output is known (the trajectory's assistant message),
so verification needs no model (:func:`agspec_gpu.accept.teacher_forced_accept`);
:class:`ReplayStats` turns the per-step counts into the figures of DESIGN.md "Replay output".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agspec_gpu.cost_model import CostModel, StepTokenCounts

P_ACC_MAX_K = 32  # P_acc(k) is reported for k = 1 .. P_ACC_MAX_K
_SOURCE_CODES = 256  # maybe_source is int8 tier*8 + form; non-negative codes fit in 0..127
_FALLBACK_TIERS = ("session", "workspace", "history", "global")


def source_names() -> tuple[dict[int, str], dict[int, str]]:
    """``(tier names, form names)`` by index, for decoding ``maybe_source = tier*8 + form``."""
    try:
        from agspec_gpu.tiers import CorpusTier

        tiers = {int(t): t.name.lower() for t in CorpusTier}
    except ImportError:  # the tier module is optional until the drafter exists
        tiers = dict(enumerate(_FALLBACK_TIERS))
    from agspec_gpu.forms import EmissionForm

    forms = {i: f.name.lower() for i, f in enumerate(EmissionForm)}
    return tiers, forms


@dataclass
class ReplayStats:
    """Counters of one drafter's replay, per agent format (index into ``agents``).

    Every counter is an ``int64``/``float64`` array with the agent as its first axis, so a
    step updates them with a few ``bincount`` calls whatever the batch size.
    """

    agents: tuple[str, ...]
    sessions: np.ndarray = field(init=False)
    messages: np.ndarray = field(init=False)
    target_tokens: np.ndarray = field(init=False)
    steps: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)
    drafted: np.ndarray = field(init=False)
    empty_steps: np.ndarray = field(init=False)
    draft_seconds: np.ndarray = field(init=False)
    accepted_hist: np.ndarray = field(init=False)  # [A, P_ACC_MAX_K + 1], last bin is >= K
    source_hist: np.ndarray = field(init=False)  # [A, 256] accepted tokens per source code
    # batched steps by the tokens their forward verifies (rows + drafts)
    step_tokens: StepTokenCounts = field(default_factory=StepTokenCounts)
    batch_steps: int = 0
    batch_rows: int = 0
    has_sources: bool = False  # the drafter reported maybe_source at least once

    def __post_init__(self) -> None:
        A = len(self.agents)
        for name in ("sessions", "messages", "target_tokens", "steps", "accepted", "drafted",
                     "empty_steps"):
            setattr(self, name, np.zeros(A, dtype=np.int64))
        self.draft_seconds = np.zeros(A, dtype=np.float64)
        self.commit_seconds = np.zeros(A, dtype=np.float64)
        self.accepted_hist = np.zeros((A, P_ACC_MAX_K + 1), dtype=np.int64)
        self.source_hist = np.zeros((A, _SOURCE_CODES), dtype=np.int64)

    def add_step(self, agent: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                 produced: np.ndarray, draft_seconds: float,
                 maybe_sources: np.ndarray | None = None, commit_seconds: float = 0.0) -> None:
        """Records one batched step.

        Parameters
        ----------
        agent, drafted, accepted, produced : ``int [B]`` per row: agent index, draft tokens
            proposed, draft tokens accepted, tokens emitted (accepted + bonus, capped).
        draft_seconds : wall time of the whole batch's proposal; split evenly over its rows.
        maybe_sources : ``int [B, D]`` source code of each accepted token, ``-1`` elsewhere.
        commit_seconds : wall time of the drafter's commit of the step (``observe``), split
            as ``draft_seconds``.
        """
        A = len(self.agents)
        B = len(agent)
        count = np.bincount(agent, minlength=A)
        self.steps += count
        self.drafted += np.bincount(agent, drafted, minlength=A).astype(np.int64)
        self.accepted += np.bincount(agent, accepted, minlength=A).astype(np.int64)
        self.target_tokens += np.bincount(agent, produced, minlength=A).astype(np.int64)
        self.empty_steps += np.bincount(agent, drafted == 0, minlength=A).astype(np.int64)
        self.draft_seconds += draft_seconds * count / max(B, 1)
        self.commit_seconds += commit_seconds * count / max(B, 1)
        K1 = P_ACC_MAX_K + 1
        hist_idx = agent * K1 + np.minimum(accepted, P_ACC_MAX_K)
        self.accepted_hist += np.bincount(hist_idx, minlength=A * K1).reshape(A, K1)
        if maybe_sources is not None:
            self.has_sources = True
        if maybe_sources is not None and maybe_sources.size:
            rows, cols = np.nonzero(maybe_sources >= 0)
            codes = agent[rows] * _SOURCE_CODES + maybe_sources[rows, cols]
            self.source_hist += np.bincount(
                codes, minlength=A * _SOURCE_CODES).reshape(A, _SOURCE_CODES)
        self.step_tokens.add(B + int(drafted.sum()), B)
        self.batch_steps += 1
        self.batch_rows += B

    def modelled_ms(self, cost_model: CostModel) -> float:
        """The lane's verification time under ``cost_model``: ``sum over its batched steps
        of cost(rows + drafted tokens)`` (drafting time left out)."""
        return self.step_tokens.modelled_ms(cost_model)

    def merge(self, other: "ReplayStats") -> None:
        """Adds ``other``'s counters (the same drafter on other sessions) to these."""
        if other.agents != self.agents:
            raise ValueError(f"other: agents {other.agents} differ from {self.agents}")
        for name in ("sessions", "messages", "target_tokens", "steps", "accepted", "drafted",
                     "empty_steps", "draft_seconds", "commit_seconds", "accepted_hist",
                     "source_hist"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.step_tokens.merge(other.step_tokens)
        self.batch_steps += other.batch_steps
        self.batch_rows += other.batch_rows
        self.has_sources |= other.has_sources

    def rows(self, drafter: str, cost_model: CostModel,
             oracle_tau: dict[str, float | None] | None = None) -> list[dict]:
        """One row per agent format with any steps, then the ``"all"`` row."""
        out = []
        for a, agent in enumerate(self.agents):
            if self.sessions[a]:
                out.append(self._row(drafter, agent, [a], cost_model, oracle_tau))
        out.append(self._row(drafter, "all", list(range(len(self.agents))), cost_model,
                             oracle_tau))
        return out

    def _row(self, drafter: str, agent: str, idx: list[int], cost_model: CostModel,
             oracle_tau: dict[str, float | None] | None) -> dict:
        s = lambda arr: arr[idx].sum(0)  # noqa: E731 - sum over the selected agents
        steps, drafted, accepted = int(s(self.steps)), int(s(self.drafted)), int(s(self.accepted))
        target = int(s(self.target_tokens))
        per_step = lambda x: x / steps if steps else None  # noqa: E731
        tau = per_step(target)
        draft_us = per_step(float(s(self.draft_seconds)) * 1e6)
        commit_us = per_step(float(s(self.commit_seconds)) * 1e6)
        hist = s(self.accepted_hist)
        at_least = np.cumsum(hist[::-1])[::-1]  # at_least[k] = steps with >= k accepted
        tiers, forms = source_names()
        src = s(self.source_hist)
        tier_tok = np.bincount(np.arange(_SOURCE_CODES) // 8, src, minlength=32)
        form_tok = np.bincount(np.arange(_SOURCE_CODES) % 8, src, minlength=8)
        attributed = int(src.sum())
        share = lambda counts, names: {  # noqa: E731
            names.get(i, f"#{i}"): float(c) / attributed for i, c in enumerate(counts) if c
        } if attributed else {}
        drafted_ps = per_step(drafted)
        return {
            "drafter": drafter,
            "agent": agent,
            "sessions": int(s(self.sessions)),
            "messages": int(s(self.messages)),
            "target_tokens": target,
            "steps": steps,
            "tau": tau,
            "acceptance_rate": accepted / drafted if drafted else None,
            "drafted_per_step": drafted_ps,
            "empty_draft_share": per_step(int(s(self.empty_steps))),
            "oracle_tau": (oracle_tau or {}).get(agent),
            "draft_us_per_step": draft_us,  # propose
            "commit_us_per_step": commit_us,  # the drafter's commit (observe)
            "accepted_per_step": per_step(accepted),
            "wasted_per_step": per_step(drafted - accepted),
            "p_acc": [float(at_least[k]) / steps if steps else 0.0
                      for k in range(1, P_ACC_MAX_K + 1)],
            "tier_share": share(tier_tok, tiers),
            "form_share": share(form_tok, forms),
            # share of accepted tokens whose source the draft named (None: it names none)
            "attributed_accepted_share": attributed / accepted
            if accepted and self.has_sources else None,
            "modelled_speedup": modelled_speedup(tau, drafted_ps, drafter_us_per_step(draft_us,
                                                                              commit_us),
                                                 cost_model),
            # the whole lane's mean rows per batched step (agents share the batch)
            "batch_steps": self.batch_steps,
            "mean_batch": self.batch_rows / self.batch_steps if self.batch_steps else None,
            "modelled_batch_speedup": modelled_batch_speedup(
                tau, drafted_ps, self.batch_rows / self.batch_steps if self.batch_steps
                else None, cost_model),
            # the whole lane's verification time, step by step (see add_replay_speedups)
            "modelled_ms": self.modelled_ms(cost_model) if self.batch_steps else None,
        }


def drafter_us_per_step(draft_us: float | None, commit_us: float | None) -> float | None:
    """The drafter's time per step: its propose and its commit (None: neither timed)."""
    if draft_us is None and commit_us is None:
        return None
    return (draft_us or 0.0) + (commit_us or 0.0)


def add_replay_speedups(rows: list[dict]) -> None:
    """Sets ``modelled_replay_speedup`` on every ``"all"`` row: the ``none`` lane's
    ``modelled_ms`` over the row's lane's (None without a ``none`` row or without times,
    and on the agents' rows: the batch mixes agents, so the figure is the lane's only). Both sum
    ``cost(rows + drafted)`` over the batched steps of the same sessions' continuous batch,
    each lane's as its own acceptance shaped it: the speedup of the whole replay's
    verification time, which a budget that drafts less when the batch is full can win while
    tau and ``modelled_batch_speedup`` (one mean batch) do not show it."""
    none_ms = next((r.get("modelled_ms") for r in rows
                    if r["drafter"] == "none" and r["agent"] == "all"), None)
    for r in rows:
        ms = r.get("modelled_ms")
        # a lane's figure: an agent's row (whose modelled_ms is its lane's) has none
        r["modelled_replay_speedup"] = none_ms / ms if none_ms and ms and \
            r["agent"] == "all" else None


def modelled_batch_speedup(tau: float | None, drafted_per_step: float | None,
                           mean_batch: float | None, cost_model: CostModel) -> float | None:
    """Decode speedup of a batch of ``mean_batch`` requests under ``cost_model``, drafting
    time excluded: ``tau * cost(B) / cost(B * (1 + drafted_per_step))``. Each step verifies
    every request's root and drafts in one forward; without speculation it decodes ``B``
    tokens. This is the figure the batch budget maximises (on CPU the torch path's drafting
    time says nothing of a GPU's, so it is left out here). A staircase measured at more
    requests prices the drafts from its own base (``num_requests``), as the replay does."""
    if tau is None or drafted_per_step is None or not mean_batch:
        return None
    return tau * cost_model.step_ms(mean_batch, num_requests=mean_batch) / cost_model.step_ms(
        mean_batch * (1 + drafted_per_step), num_requests=mean_batch)


def modelled_speedup(tau: float | None, drafted_per_step: float | None,
                     draft_us_per_step: float | None, cost_model: CostModel) -> float | None:
    """Decode speedup over no speculation under ``cost_model`` (one request per forward).

    ``speedup = tau * cost(1) / (cost(1 + drafted_per_step) + draft_time)``: without
    speculation a token costs one single-token forward; with it a step verifies the root plus
    the drafted tokens in one forward, pays the measured drafting time (propose and commit),
    and yields ``tau`` tokens. Drafting time is per request step (a batched drafter's time
    is shared by its rows), so the batched drafter is not charged its whole batch's launch
    per request.
    """
    if tau is None or drafted_per_step is None:
        return None
    draft_ms = (draft_us_per_step or 0.0) / 1e3
    # (a staircase measured at more requests: one request's drafts priced from its base)
    return tau * cost_model.step_ms(1, num_requests=1) / (
        cost_model.step_ms(1 + drafted_per_step, num_requests=1) + draft_ms)
