"""Adaptive draft length (per request) and the batch-level draft-token budget.

Per request ``r`` (all state in device tensors sized for the maximum batch):

* ``k_t = min(C_role, max(1, floor(S_t * L_match)))``: the draft depth scales with the
  length of the match that produced it, capped by the role's offline cap ``C_role``.
* ``S_t`` moves by verification feedback: ``* alpha`` when the whole draft was accepted,
  ``* beta`` when it was cut short, clamped to ``[s_min, s_max]``; no update when a fully
  accepted draft was cut by the cap (the cap, not ``S_t``, limited it).

Batch level: every candidate draft node carries an estimated acceptance probability. A
step verifying ``B`` roots plus ``n`` draft tokens yields ``B + sum(p)`` tokens in
``cost(B + n)``; nodes are taken in decreasing ``p`` and the count ``n*`` maximising that
throughput is kept, so speculation shrinks smoothly as the batch (and its cost) grows.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from agspec_gpu.checks import check_float_fields, check_int_fields, is_int
from agspec_gpu.cost_model import CostModel
from agspec_gpu.kernels.batch_budget import budget_count_torch
from agspec_gpu.kernels.controller_commit import scale_update_torch
from agspec_gpu.kernels.depth_caps import depth_rule_torch


# the controller's scales are float32 state: a bound past these would overflow it (to inf,
# which no rejection contracts) or underflow it (to 0, which no acceptance grows)
_SCALE_MIN, _SCALE_MAX = 1e-6, 1e9


@dataclass(frozen=True, slots=True)
class RoleProfile:
    """Offline profile of an agent role: its draft cap and initial scale."""

    name: str
    draft_cap: int = 32
    initial_scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty str, got {self.name!r}")
        check_int_fields(self, ("draft_cap",))
        check_float_fields(self, ("initial_scale",))
        if not 1 <= self.draft_cap < 2 ** 31:
            raise ValueError(f"draft_cap must be in [1, 2**31), got {self.draft_cap}")
        if not _SCALE_MIN <= self.initial_scale <= _SCALE_MAX:
            raise ValueError(f"initial_scale must be in [{_SCALE_MIN:g}, {_SCALE_MAX:g}] (the "
                             f"controller's float32 state), got {self.initial_scale}")


# Caps and initial scales chosen on replayed dev sessions (see the drafter's min_prob): deep
# drafts pay while the batch budget, not the cap, trims them at large batch sizes.
BUILTIN_ROLES = {
    "default": RoleProfile("default", 32, 4.0),
    "planner": RoleProfile("planner", 16, 4.0),
    "coder": RoleProfile("coder", 32, 4.0),
    "reviewer": RoleProfile("reviewer", 24, 4.0),
}


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    alpha: float = 1.5
    beta: float = 0.75
    s_min: float = 4.0
    s_max: float = 16.0
    static_k: int | None = None  # fixed depth; disables the adaptive rule

    def __post_init__(self) -> None:
        check_float_fields(self, ("alpha", "beta", "s_min", "s_max"), infinite=("s_max",))
        check_int_fields(self, ("static_k",), optional=("static_k",))
        if not (1.0 <= self.alpha <= 1e3 and 1e-3 <= self.beta <= 1.0):
            raise ValueError(f"need 1 <= alpha <= 1e3 and 1e-3 <= beta <= 1, got alpha="
                             f"{self.alpha}, beta={self.beta}")
        if not (_SCALE_MIN <= self.s_min <= self.s_max
                and (self.s_max <= _SCALE_MAX or self.s_max == float("inf"))):
            raise ValueError(f"need {_SCALE_MIN:g} <= s_min <= s_max <= {_SCALE_MAX:g} (or "
                             f"s_max = inf), got s_min={self.s_min}, s_max={self.s_max}")
        if self.static_k is not None and not 1 <= self.static_k < 2 ** 31:
            raise ValueError(f"static_k must be in [1, 2**31), got {self.static_k}")


def draft_depth(scale: torch.Tensor, match_len: torch.Tensor, cap: torch.Tensor,
                config: ControllerConfig) -> torch.Tensor:
    """``int32 [B]``: ``min(cap, max(1, floor(scale * match_len)))`` (static_k if set)."""
    return depth_rule_torch(scale, match_len, cap, config.static_k)


def update_scale(scale: torch.Tensor, drafted_depth: torch.Tensor, accepted: torch.Tensor,
                 cap: torch.Tensor, config: ControllerConfig) -> torch.Tensor:
    """New ``S_t`` after verification (requests with no draft keep theirs).

    Args: scale ``float [B]``; drafted_depth ``int [B]`` depth of the verified draft;
    accepted ``int [B]`` draft tokens accepted; cap ``int [B]`` the role caps.
    """
    return scale_update_torch(scale, drafted_depth, accepted, cap, alpha=config.alpha,
                              beta=config.beta, s_min=config.s_min, s_max=config.s_max)


def cost_table(cost: CostModel, device: torch.device | str, max_tokens: int) -> torch.Tensor:
    """``float64 [max_tokens + 1]`` on ``device``: ``cost.step_ms(n)`` for ``n = 0 ..
    max_tokens`` (build once: a step then reads its costs as a slice, no interpolation),
    non-decreasing: a step over more tokens is never cheaper than one over fewer (a curve
    that falls somewhere would have the budget buy tokens, zero-scored ones included, to
    reach the cheaper point, and keep fewer than it paid for)."""
    return torch.tensor(list(itertools.accumulate(
        (cost.step_ms(n) for n in range(max_tokens + 1)), max)), dtype=torch.float64,
        device=device)


def batch_budget(scores: torch.Tensor, num_requests: int | torch.Tensor, cost: CostModel,
                 max_tokens: int | None = None,
                 table: torch.Tensor | None = None) -> torch.Tensor:
    """How many of the (descending) node scores to verify in one step.

    Args:
        scores: ``float [M]`` estimated acceptance probabilities, sorted descending.
        num_requests: ``B``, roots verified anyway (an int, or a 0-d int64 device tensor:
            then ``table`` is required and must cover ``B + M``).
        cost: step time versus tokens.
        max_tokens: consider at most this many of the scores (an int >= 0), or all.
        table: ``cost_table(cost, device, T)`` with ``T >= max(B, cost.table_base()) + M``,
            when the caller built it once (a per-step caller: no host-to-device copy each
            call); otherwise (or when it is shorter) built here.

    Returns:
        ``int64 []`` (0-d tensor) ``n*`` maximising ``(B + cumsum(scores)[n-1]) / cost(B + n)``
        over ``n in [0, M]``; ties go to the smaller ``n``. A higher cost per token never
        yields a larger ``n*`` for the same scores. The scores are summed exactly, in units
        of ``2**-32`` (:mod:`agspec_gpu.kernels.batch_budget`, whose kernel the drafter runs).
    """
    if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 0):
        raise ValueError(f"max_tokens: expected an int >= 0 or None, got {max_tokens!r}")
    M = scores.numel() if max_tokens is None else min(scores.numel(), max_tokens)
    if isinstance(num_requests, torch.Tensor):  # a device scalar: gather, no host read
        if table is None:
            raise ValueError("table: required when num_requests is a tensor")
    elif not (is_int(num_requests) and 0 <= num_requests < 2 ** 31):
        raise ValueError(f"num_requests: expected an int in [0, 2**31) or an int64 [] "
                         f"tensor, got {num_requests!r}")
    elif table is None or table.numel() < max(num_requests, cost.table_base() or 0) + M + 1:
        # (a staircase reads a step of n at table_base + n, past B + n where it is larger)
        table = cost_table(cost, scores.device, max(num_requests, cost.table_base() or 0) + M)
    return budget_count_torch(scores[:M], num_requests, table, cost.table_base())


# ---------------------------------------------------------------- offline profiling
def caps_from_curve(p_acc: list[float], theta: float) -> int:
    """``C = max{k : P_acc(k) >= theta}`` (at least 1); ``p_acc[k-1]`` is ``P_acc(k)``."""
    ok = [k + 1 for k, p in enumerate(p_acc) if p >= theta]
    return max(ok) if ok else 1


def profile_roles(curves: dict[str, list[float]], cost: CostModel | None = None,
                  out: str | Path | None = None) -> dict[str, RoleProfile]:
    """Role caps from measured acceptance curves ``P_acc(k)`` per role.

    ``theta`` = verification overhead of one extra token relative to a decode step:
    ``(cost(2) - cost(1)) / cost(1)`` scaled to the drafted block, i.e. a token is worth
    drafting while its acceptance probability exceeds the marginal time it costs.
    """
    cost = cost or CostModel.default()
    theta = max((cost.step_ms(33) - cost.step_ms(1)) / 32 / cost.step_ms(1), 1e-3)
    profiles = {role: RoleProfile(role, caps_from_curve(c, theta)) for role, c in curves.items()}
    if out is not None:
        Path(out).write_text(json.dumps(
            {"theta": theta, "cost_model": cost.to_json(),
             "roles": {r: {"draft_cap": p.draft_cap, "p_acc": curves[r]}
                       for r, p in profiles.items()}}, indent=2))
    return profiles


def load_profiles(path: str | Path,
                  base: dict[str, RoleProfile] | None = None) -> dict[str, RoleProfile]:
    """Role profiles from an ``agspec-gpu profile`` file.

    A profiled role keeps the ``initial_scale`` of the same-named role of ``base`` (or of
    its ``"default"``); the roles of ``base`` the file does not name are kept as they are.
    Without ``base`` only the file's roles are returned (initial scale 1.0).
    """
    if not Path(path).is_file():
        raise ValueError(f"profiles: no profile file at {path} (write one with "
                         f"`agspec-gpu profile`)")
    try:
        obj = json.loads(Path(path).read_text())
        caps = {r: v["draft_cap"] for r, v in obj["roles"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"profiles {path}: not an agspec-gpu profile file ({exc})") from exc
    fallback = (base or {}).get("default", RoleProfile("default"))
    try:  # (RoleProfile checks each cap and name: an int >= 1, a non-empty str)
        profiled = {r: RoleProfile(r, c, 1.0 if base is None else
                                   base.get(r, fallback).initial_scale)
                    for r, c in caps.items()}
    except ValueError as exc:
        raise ValueError(f"profiles {path}: {exc}") from None
    return profiled if base is None else {**base, **profiled}
