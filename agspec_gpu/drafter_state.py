"""A drafter's device state: its sessions' slots and the statistics it learns online.

* :class:`SlotState`: one row per session slot (its recent-token ring and controller state),
  plus a spare row that the padding rows of a step replayed as a CUDA graph read and write;
* :class:`DraftStats`: the tier weights and the calibration tables, exponentially decayed
  counts over a prior, and the counts of one commit that are folded into them.

Both are made once, when the drafter is built, and updated in place: a graphed step reads and
writes them at fixed addresses.
"""

from __future__ import annotations

import torch

from agspec_gpu.kernels.drafter_commit import ring_push_torch


class SlotState:
    """Per-session device state, ``S = num_slots`` rows (a drafter's ``max_sessions`` and
    the spare row).

    Attributes:
        recent: ``int32 [S, D]`` each session's last ``D`` tokens, right-aligned: the query
            of its next match is the last ``recent_len`` of them.
        recent_len: ``int32 [S]`` valid tokens of ``recent``.
        match_cap: ``int32 [S]`` an upper bound on the next match length: the last match
            plus the tokens appended since (an occurrence of ``l`` tokens implies one of
            ``l - a`` before ``a`` appended tokens); ``D`` when other text joins the
            session's corpora.
        scale: ``float32 [S]`` the controller's depth scale.
        cap: ``int32 [S]`` the depth cap of the session's role.
        prev_full: ``int64 [S]`` 1 when the session's previous draft was accepted whole
            (copy mode).
        ring_before: ``int32 [max_batch, D + 2]`` row ``b``: the ring, fill and match cap of
            a commit's request ``b`` before the commit (a deferred commit's request that
            ended inside the step gets them back, then only what it kept pushed; a commit
            whose corpora could not take the tokens gets them back whole).
    """

    def __init__(self, num_slots: int, depth: int, max_batch: int,
                 device: torch.device | str) -> None:
        self.recent = torch.zeros(num_slots, depth, dtype=torch.int32, device=device)
        self.recent_len = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.match_cap = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.scale = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.cap = torch.ones(num_slots, dtype=torch.int32, device=device)
        self.prev_full = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.ring_before = torch.zeros(max_batch, depth + 2, dtype=torch.int32, device=device)

    @property
    def depth(self) -> int:
        """``D``, the tokens a ring holds."""
        return self.recent.shape[1]

    def open(self, slot: int, initial_scale: float, draft_cap: int) -> None:
        """A new session's row: an empty ring, no match bound, its role's controller state."""
        self.recent_len[slot] = 0
        self.prev_full[slot] = 0
        self.match_cap[slot] = self.depth
        self.scale[slot] = initial_scale
        self.cap[slot] = draft_cap

    def clear(self, slot: int) -> None:
        """Clears a closed session's ring (its slot's next owner reads only ``recent_len``
        tokens of it, but no text outlives its session) and the last commit's copies of
        its batch's rings."""
        self.recent[slot] = 0
        self.recent_len[slot] = 0
        self.ring_before.zero_()

    def push_one(self, slot: int, toks: torch.Tensor) -> None:
        """Appends one session's ``toks [m]`` (on the ring's device) to its ring: a run as
        long as the ring replaces it (3 ops, as :func:`ring_push_torch` leaves it: the last
        ``D`` tokens, fill and match cap ``D``; a context or tool output usually is); a
        shorter one goes through :meth:`push` (~17 ops)."""
        D = self.depth
        if toks.numel() < D:
            self.push(torch.tensor([slot]), toks[None, :], None)
            return
        self.recent[slot] = toks[-D:]
        self.recent_len[slot] = D
        self.match_cap[slot] = D

    def push(self, slots: torch.Tensor, toks: torch.Tensor, num: torch.Tensor | None) -> None:
        """Appends ``toks [b, M]`` (the first ``num [b]`` of each row, all if None) to the
        rings of ``slots [b]``."""
        slots = slots.to(self.recent.device)
        num = torch.full((slots.numel(),), toks.shape[1], dtype=torch.int64,
                         device=slots.device) if num is None else num
        ring_push_torch(self.recent, self.recent_len, self.match_cap, slots, toks, num,
                        guard=False)

    def save_rings(self, slots: torch.Tensor) -> None:
        """The rings, fills and match caps of ``slots [b]`` into ``ring_before[:b]``, as the
        commit kernel saves them (a commit without a draft to commit: the rings it pushes
        go back if its corpora cannot take the tokens)."""
        D = self.depth
        before = self.ring_before[:slots.numel()]
        before[:, :D] = self.recent[slots]
        before[:, D] = self.recent_len[slots]
        before[:, D + 1] = self.match_cap[slots]

    def restore_rings(self, rows: torch.Tensor, slots: torch.Tensor, toks: torch.Tensor,
                      kept: torch.Tensor) -> None:
        """Puts back the rings that ``ring_before``'s ``rows [r]`` saved for ``slots [r]``,
        then pushes the first ``kept [r]`` of ``toks [r, M]`` (what a request that ended
        inside a deferred commit's step kept)."""
        before, D = self.ring_before[rows], self.depth
        self.recent[slots] = before[:, :D]
        self.recent_len[slots] = before[:, D]
        self.match_cap[slots] = before[:, D + 1]
        ring_push_torch(self.recent, self.recent_len, self.match_cap, slots, toks, kept,
                        guard=False)


class DraftStats:
    """What verification taught the drafter, as exponentially decayed counts over a prior.

    * tier weights: ``tier_drafts`` (nodes drafted) and ``tier_hits`` (accepted path
      tokens) ``float64 [T]`` per tier; a tier's weight is ``hits / drafts``, prior 1 / 2;
    * calibration: ``P(node accepted | its parent accepted)`` as ``calib_hits /
      calib_seen``, ``float64 [2 * T * (L + 1), K]``: row ``(mode * T + tier) * (L + 1) +
      match`` (mode 1: the request's previous draft was accepted whole; the tier of the
      node's candidate; the match length, at most ``L``), column the node's depth; prior
      ``(match + 1) / (match + 3)`` with weight 2 (a longer match is more likely to
      continue). Every reached node counts once in its cell, siblings alike, and a node's
      estimate is its candidate share times its cells: the branching counts twice, so the
      estimates run low (measured on the dev sessions at B = 16: 0.12 for nodes accepted
      24% of the time, 0.35 for 51%). Counting a node by its share of its parent's
      candidates instead makes them exact, and the batch budget then drafts more and worse:
      modelled speedup +0.7% at B = 16, -3.3% at 64 (the budget keeps the nodes whose
      estimates are highest, so those it keeps are overestimated; the low bias offsets
      that). ``bench/results/README.md``, session 57.

    The four live in one buffer, ``tables``, laid out as one commit's ``counts``; per
    commit :meth:`fold` computes ``tables = decay * tables + counts + (1 - decay) * prior``:
    the observations decay and the prior stays, so a calibration cell or a tier not drafted
    for a while returns to its prior (an unreached cell's estimate halved every ~700
    commits; an unused tier's counts would otherwise sink into float64's subnormals, where
    rounding moved its weight 0.5 -> 1.0 by ~74,000 commits).
    """

    TIER_DECAY = 0.99
    CALIB_DECAY = 0.999

    def __init__(self, num_tiers: int, max_match: int, max_draft_depth: int,
                 device: torch.device | str) -> None:
        T, K, dev = num_tiers, max_draft_depth, device
        L = torch.arange(max_match + 1, dtype=torch.float64, device=dev)[:, None]
        rows = 2 * T * (max_match + 1)
        n = rows * K
        self.tables = torch.cat([
            torch.full((T,), 2.0, dtype=torch.float64, device=dev),
            torch.ones(T, dtype=torch.float64, device=dev),
            torch.full((n,), 2.0, dtype=torch.float64, device=dev),
            (2.0 * (L + 1) / (L + 3)).expand(max_match + 1, K).repeat(2 * T, 1).reshape(-1)])
        self.tier_drafts, self.tier_hits = self.tables[:T], self.tables[T:2 * T]
        self.calib_seen = self.tables[2 * T:2 * T + n].view(rows, K)
        self.calib_hits = self.tables[2 * T + n:].view(rows, K)
        self.decay = torch.cat([
            torch.full((2 * T,), self.TIER_DECAY, dtype=torch.float64, device=dev),
            torch.full((2 * n,), self.CALIB_DECAY, dtype=torch.float64, device=dev)])
        self.prior = (1 - self.decay) * self.tables
        # one commit's counts (drafted and accepted per tier, calibration cells reached and
        # accepted), zeroed and folded into the tables every commit
        self.counts = torch.zeros_like(self.tables)

    def zero_counts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zeroes a commit's counts; returns their views ``(drafted [T], hits [T], seen,
        accepted [R * K])`` for the commit kernel to add to."""
        T, n = self.tier_drafts.numel(), self.calib_seen.numel()
        c = self.counts.zero_()
        return c[:T], c[T:2 * T], c[2 * T:2 * T + n], c[2 * T + n:]

    def fold(self) -> None:
        """Folds a commit's counts into the decayed tables (three ops)."""
        self.tables.mul_(self.decay).add_(self.counts).add_(self.prior)
