"""DrafterConfig: the drafting parameters of a :class:`~agspec_gpu.drafter.Drafter`, checked
when made."""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral

from agspec_gpu.checks import (check_at_most, check_bool_fields, check_float_fields,
                               check_instance_field, check_int_fields, check_tuple_field)
from agspec_gpu.controller import BUILTIN_ROLES, ControllerConfig, RoleProfile
from agspec_gpu.tiers import CorpusTier

_NUM_TIERS = len(CorpusTier)
# the most each size may be: buffers and tables scale with them (max_nodes: a cost table of
# max_batch * (1 + max_nodes) entries), and lengths past 2**20 would only wrap the kernels'
# int32 scores; real configurations sit far below
_CAPS = {"max_positions": 1 << 10, "max_scan": (1 << 31) - 1, "max_candidate_rows": 1 << 10,
         "max_draft_depth": 1 << 12, "max_nodes": 1 << 12, "min_match": 1 << 20,
         "candidate_slack": 1 << 20}


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    """Drafting parameters.

    Attributes:
        max_positions: occurrences sampled per (request, corpus) as candidates.
        max_scan: entries of each index level's match range read to find them (the most
            recent ``max_positions`` of the tail's hits and of these; None: the whole range).
            Bounds the match kernel's work per row: a one-token match in a large level has a
            range of up to ~10^5 entries.
        max_candidate_rows: most corpora (rows of the match) supplying candidates to one
            request: those with the best score (match length plus tier bonus), then the
            earlier tier. None: every row within ``candidate_slack`` of the best.
        max_draft_depth: hard cap on draft depth (the role cap applies below it).
        max_nodes: most draft nodes per request.
        tree: trees (True) or chains (False).
        batch_budget: spend draft tokens by the cost model across the batch.
        min_match: shortest match that produces a draft.
        min_prob: nodes whose estimated acceptance probability is below this are not
            drafted (verification is not spent on long shots). The estimate runs about
            half the measured rate at low values (:class:`~agspec_gpu.drafter_state.DraftStats`).
        candidate_slack: rows (tiers) whose match is at most this much shorter than the
            request's longest also supply candidates.
        calibrate: scale candidate shares by the acceptance learned online per (match
            length, depth); off, a node's probability is its candidate share alone.
        tier_bonus: tokens added to a tier's match length (session, workspace, history,
            global) when choosing which rows supply candidates: the tenant's own text
            predicts its next tokens better than an equally long match in other text.
        controller: the adaptive-length rule.
        roles: the role profiles a session may open with (``open_session(..., role=)``):
            each names its draft-length cap and the controller's initial scale. Built in:
            ``default``, ``planner``, ``coder``, ``reviewer``; ``DecoderConfig(profiles=)``
            adds or replaces roles from a profile file.
        cuda_graphs: on a GPU, replay the device halves of a step as CUDA graphs per batch
            bucket (:mod:`agspec_gpu.drafter_graphs`): propose after the batched match (the
            candidate windows' rows, trie, probabilities, budget) and commit before the
            corpora (controller, calibration, tier weights, recent-token ring). Drafts and
            state are the same.
    """

    max_positions: int = 8
    max_scan: int | None = 256
    max_candidate_rows: int | None = 2
    max_draft_depth: int = 32
    max_nodes: int = 64
    tree: bool = True
    batch_budget: bool = True
    min_match: int = 1
    min_prob: float = 0.0
    candidate_slack: int = 0
    calibrate: bool = True
    tier_bonus: tuple[int, ...] = (2, 2, 1, 0)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    roles: tuple[RoleProfile, ...] = tuple(BUILTIN_ROLES.values())
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        check_int_fields(self, ("max_positions", "max_scan", "max_candidate_rows",
                                "max_draft_depth", "max_nodes", "min_match", "candidate_slack"),
                         optional=("max_scan", "max_candidate_rows"))
        check_bool_fields(self, ("tree", "batch_budget", "calibrate", "cuda_graphs"))
        check_float_fields(self, ("min_prob",))
        check_tuple_field(self, "tier_bonus", Integral, length=_NUM_TIERS, convert=int)
        check_instance_field(self, "controller", ControllerConfig)
        check_tuple_field(self, "roles", RoleProfile)
        names = [r.name for r in self.roles]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"roles: expected profiles with distinct names, got {names}")
        if self.max_positions < 1 or self.max_draft_depth < 1 or self.max_nodes < 1:
            raise ValueError("max_positions, max_draft_depth and max_nodes must be >= 1")
        if self.max_scan is not None and self.max_scan < 1:
            raise ValueError("max_scan must be >= 1 or None")
        if self.max_candidate_rows is not None and self.max_candidate_rows < 1:
            raise ValueError("max_candidate_rows must be >= 1 or None")
        if self.min_match < 1:
            raise ValueError("min_match must be >= 1")
        if self.candidate_slack < 0:
            raise ValueError("candidate_slack must be >= 0")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError("min_prob must be in [0, 1)")
        check_at_most(self, _CAPS)
        if min(self.tier_bonus) < 0 or max(self.tier_bonus) > 1 << 20:
            raise ValueError(f"tier_bonus must be {_NUM_TIERS} ints in [0, 2**20], got "
                             f"{self.tier_bonus}")
