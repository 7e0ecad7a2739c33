"""The batched retrieval drafter: one match per step for every request, then draft trees.

``propose`` takes each request's last ``max_depth`` tokens (a device ring of recent tokens),
matches them against every corpus the request may search (its session, its tenant's
workspace and history, the global tier) in one batched call, and turns the continuations
of the longest matches into a draft tree:

* candidates: the continuation windows after the ``P`` most recent occurrences of the
  longest match, per tier, weighted by a per-tier weight learned online from acceptance;
* the candidates form a trie; a node's estimated acceptance probability is the weighted
  share of candidates that pass through it (ties: shallower node, then the more recent
  candidate);
* nodes deeper than the controller's ``k_t`` (or than a request's own bound: the tokens it
  may still emit, less the bonus) are dropped, and the batch-level budget keeps
  the most probable nodes across the whole batch (or a per-request ``max_nodes``);
* chains (``tree=False``) follow the heaviest child at every node.

``observe`` commits what verification accepted: the accepted tokens join the session tier
and the recent-token ring, the controller's scale and the tier weights are updated.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import nvtx
import torch

from agspec_gpu.accept import NO_TOKEN, teacher_forced_accept
from agspec_gpu.checks import check_int_tensor, is_int
from agspec_gpu.controller import cost_table
from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.cuda_graph import batch_buckets
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.drafter_config import DrafterConfig
from agspec_gpu.drafter_graphs import StepGraphs, StepPlan
from agspec_gpu.drafter_state import DraftStats, SlotState
from agspec_gpu.host import HostWriter, cuda_index, device_guard, to_device
from agspec_gpu.kept_descriptors import KeptDescriptors
from agspec_gpu.kernels._launch import cast
from agspec_gpu.kernels.batch_budget import budget_keep
from agspec_gpu.kernels.candidate_rows import candidate_rows
from agspec_gpu.kernels.controller_commit import controller_commit
from agspec_gpu.kernels.depth_caps import depth_caps
from agspec_gpu.kernels.draft_nodes import best_first, emit_nodes
from agspec_gpu.kernels.drafter_commit import drafter_commit
from agspec_gpu.kernels.node_probs import node_probs
from agspec_gpu.kernels.suffix_match import MatchResult, suffix_match
from agspec_gpu.tiers import CorpusStore, CorpusTier

_NUM_TIERS = len(CorpusTier)
# the values that make a padding row of a graphed step inert (its slot: the spare one)
_DRAFT_PADS = {"tier": -1, "length": 0, "win": PAD_ID, "src": -1, "max_k": 0}
NO_BOUND = (1 << 62)  # a request's depth bound when it has none
# the propose step's inputs the match writes in place (a StepPlan's staged views), in its
# order, and the commit step's that observe writes in place
_MATCHED = ("length", "win", "src")
_COMMIT_STAGED = ("out", "path")
_COMMIT_PADS = {"out": 0, "nout": 0, "nacc": 0, "token_ids": PAD_ID, "parents": PAD_ID,
                "num_draft_tokens": 0, "maybe_source": -1, "nd": 0, "calib_row": 0,
                "path": -1, "bound": 0}


def _same(refs: tuple, args: tuple) -> bool:
    """Whether ``args`` are the very objects that ``refs`` (weak references, or None for a
    None) refer to."""
    return len(refs) == len(args) and all(
        a is None if r is None else r() is a for r, a in zip(refs, args))


class Drafter:
    """Batched drafter over a :class:`CorpusStore`.

    Args:
        store: the corpora (and tenant isolation).
        config: drafting parameters.
        max_batch: the most requests of one step (the batch buckets and the budget's cost
            table are sized for it).
        cost: verification cost model for the batch budget: one curve, or curves measured
            at several batch sizes (:class:`BatchCostModels`), of which a step of ``B``
            rows (its graph bucket's, padding included) steers by the one measured at the
            smallest batch ``>= B``, the bucket its verification runs in (a batch's drain
            and a half-full server verify in smaller buckets than a full one, at other
            prices).
        max_sessions: the most concurrently open sessions, idle ones included (default
            ``max_batch``); each holds a state slot (its recent-token ring and controller
            state, ``~4 * (max_depth + 8)`` bytes of device memory).

    Its calls run on the store's device whatever device is current (each makes that GPU
    current and restores the caller's).
    """

    def __init__(self, store: CorpusStore, config: DrafterConfig | None = None,
                 max_batch: int = 64, cost: CostModel | BatchCostModels | None = None,
                 max_sessions: int | None = None) -> None:
        max_sessions = max_batch if max_sessions is None else max_sessions
        if not (is_int(max_batch) and is_int(max_sessions)) or max_batch < 1 or max_sessions < 1:
            raise ValueError(f"max_batch and max_sessions must be ints >= 1, got {max_batch!r} "
                             f"and {max_sessions!r}")
        config = config or DrafterConfig()
        if config.min_match > store.config.max_depth:  # no match is ever that long
            raise ValueError(f"config.min_match={config.min_match} exceeds the corpora's "
                             f"max_depth={store.config.max_depth}: nothing would be drafted")
        self.store = store
        self.config = config
        self.max_batch, self.max_sessions = max_batch, max_sessions
        dev = store.arena.device
        # the device current in every public call (Triton launches and graph captures go to
        # the current device): below, only _step_graphs launches kernels
        self._cuda_index = cuda_index(dev)
        D = store.config.max_depth
        # per-slot state has one spare row (slot max_sessions): the padding rows of a step
        # replayed as a CUDA graph read and write it, never a real session's
        self.state = SlotState(max_sessions + 1, D, max_batch, dev)
        # a step's host lists (slots, tiers, the match's corpus descriptors): pinned staging,
        # one copy each; a half of 512 KiB holds ~50 steps' lists (~10 KB each) at 64 requests
        self._writer = HostWriter(1 << 20, dev)
        # the depth bounds of a graphed step whose requests have none
        self._no_bound = torch.full((max_batch,), NO_BOUND, dtype=torch.int64, device=dev)
        self._version: dict[str, int] = {}
        self._grid_key: tuple | None = None  # (store epoch, sids) of _grid, the last grid
        self._grid: tuple = ()
        # the last grid's slots, tiers and query slots on the device (written when the grid
        # is built, read by every step of its batch): int64 [max_batch * (1 + 2 * tiers)]
        self._grid_dev = torch.zeros(max_batch * (1 + 2 * _NUM_TIERS), dtype=torch.int64,
                                     device=dev)
        self._roles = {r.name: r for r in self.config.roles}
        self._slot: dict[str, int] = {}
        self._free = list(range(max_sessions - 1, -1, -1))
        # online calibration and tier weights, learned from what verification accepted
        self.stats = DraftStats(_NUM_TIERS, D, self.config.max_draft_depth, dev)
        # the last observe's accepted nodes' sources (a view: valid until the next observe)
        self.last_accepted_sources: torch.Tensor | None = None
        self._tier_bonus = torch.tensor(self.config.tier_bonus, dtype=torch.int32, device=dev)
        # the step graphs' batch buckets (StepGraphs.sizes), which choose the cost curve
        self._buckets = batch_buckets(max_batch)
        self._set_cost(cost)
        # proposals not yet observed, by their batch's session ids: an own loop's propose /
        # observe may interleave with a serving loop's steps of other sessions
        self._pending: dict[tuple[str, ...], tuple] = {}
        # on a GPU (unless configured off) both device halves of a step replay as CUDA graphs
        # per batch bucket, captured now so that no step pays for a capture
        self._graphs: tuple[StepGraphs, StepGraphs] | None = None
        # the match's outputs by (B, Rs): see _match_out
        self._match_outs: dict[tuple[int, int], tuple] = {}
        self._commit_plans: dict[tuple[int, int], tuple] = {}  # by (B, N): _commit_plan
        self._match_scratch: MatchResult | None = None
        # the match's descriptors, between steps (a deferred commit's tail may run past
        # tail_tokens by a step's tokens until it settles)
        self._kept = KeptDescriptors(dev, slack=self.config.max_draft_depth + 1)
        # a deferred observe, until its settle; a draft proposed ahead of its settle
        self._deferred: _Deferred | None = None
        self._ahead: _Ahead | None = None
        self._match_args: tuple = ()  # weak references to the last match's checked tensors
        self._commit_like = self._commit_example()  # the commit step's input shapes
        if self.config.cuda_graphs and dev.type == "cuda":
            self._graphs = self._step_graphs()

    def _set_cost(self, cost: CostModel | BatchCostModels | None) -> None:
        if cost is not None and not isinstance(cost, (CostModel, BatchCostModels)):
            raise ValueError(f"cost: expected a CostModel, BatchCostModels or None, got "
                             f"{type(cost).__name__}")
        self.cost = cost or CostModel.default()
        # every step's costs, per curve: B requests plus at most max_nodes nodes each
        curves = self.cost.curves if isinstance(self.cost, BatchCostModels) else \
            ((self.max_batch, self.cost),)
        self._cost_curves = BatchCostModels(curves)
        # per measured batch size: (its table, where a step of n nodes reads it)
        self._cost_tables = {
            size: (cost_table(c, self.state.recent.device, max(self.max_batch, c.table_base() or 0)
                              + self.max_batch * self.config.max_nodes), c.table_base())
            for size, c in curves}

    @property
    def commit_pending(self) -> bool:
        """Whether a deferred :meth:`observe` waits for its :meth:`settle`."""
        return self._deferred is not None

    @device_guard
    def check_between_steps(self, what: str) -> None:
        """RuntimeError naming ``what`` while a proposal waits for its observe or a deferred
        commit for its settle (a draft proposed ahead of a settle that no step took is
        dropped first: it was never to be verified)."""
        if self._ahead is not None and self._deferred is None:
            self._drop_ahead()
        if self._pending or self._deferred is not None:
            raise RuntimeError(f"{what}: a proposed step is not committed yet")

    @device_guard
    def set_cost(self, cost: CostModel | BatchCostModels | None) -> None:
        """Steers the batch budget by ``cost`` from the next propose on (a calibration's
        curves: see ``cost`` in the class's arguments; None: the built-in estimate).
        Rebuilds the cost tables and, on a GPU, captures the step graphs again (the
        propose graph reads its bucket's table); all or nothing: if a capture raises, the
        old prices and graphs stay. Between steps only (:meth:`check_between_steps`)."""
        self.check_between_steps("set_cost")
        old = (self.cost, self._cost_curves, self._cost_tables, self._graphs)
        try:
            self._set_cost(cost)
            if self._graphs is not None:
                self._graphs = self._step_graphs(use_graphs=self._graphs[0].use_graphs)
        except BaseException:
            self.cost, self._cost_curves, self._cost_tables, self._graphs = old
            raise
        if self._graphs is not old[3]:  # plans of the old graphs: let them (and their
            self._match_outs.clear()     # memory pools) go, not kept beside the new ones
            self._commit_plans.clear()

    @device_guard
    def _step_graphs(self, use_graphs: bool | None = None) -> tuple[StepGraphs, StepGraphs]:
        """The propose and commit halves as :class:`StepGraphs` (``use_graphs=False``: padded
        but eager, what the CPU tests compare with unpadded steps); graphs are captured here."""
        dev, B, pad = self.state.recent.device, self.max_batch, self.max_sessions
        graphs = (StepGraphs(self._draft_tensors, B, dev, _DRAFT_PADS | {"slots": pad},
                             state=[self.state.match_cap], use_graphs=use_graphs),
                  StepGraphs(self._commit_tensors, B, dev, _COMMIT_PADS | {"slots": pad},
                             state=self._commit_state(), use_graphs=use_graphs))
        graphs[0].prepare([self._draft_example(r) for r in range(1, _NUM_TIERS + 1)])
        graphs[1].prepare([self._commit_like])
        return graphs

    # ------------------------------------------------------------ lifecycle
    @device_guard
    def open_session(self, sid: str, tenant: str, role: str = "default",
                     prompt_ids: torch.Tensor | list[int] = ()) -> None:
        if not isinstance(role, str):
            raise ValueError(f"role: expected a str, got {type(role).__name__}")
        if role not in self._roles:
            raise ValueError(f"role {role!r} is unknown (known: {sorted(self._roles)})")
        if not self._free:
            raise ValueError(f"max_sessions={self.max_sessions} sessions are already open "
                             f"(close one, or raise max_sessions)")
        with nvtx.annotate("agspec.drafter.open_session", color="white"):
            self._open_session(sid, tenant, role, prompt_ids)

    def _open_session(self, sid: str, tenant: str, role: str,
                      prompt_ids: torch.Tensor | list[int]) -> None:
        ids = self.store.open_session(sid, tenant, prompt_ids)  # the ids, checked once
        slot = self._free.pop()
        self._slot[sid] = slot
        self._version[sid] = self.store.tenant_version(sid)
        p = self._roles[role]
        try:
            self.state.open(slot, p.initial_scale, min(p.draft_cap, self.config.max_draft_depth))
            self.state.push_one(slot, ids)
        except BaseException as exc:  # (a ring write out of memory): nothing stays open
            self.discard_session(sid, exc)
            raise

    @device_guard
    def discard_session(self, sid: str, error: BaseException) -> None:
        """Closes ``sid`` as if it had never opened, after ``error`` ended its opening (its
        text does not join the tenant's history); a failure to close is noted on
        ``error``, which the caller raises."""
        try:
            self._close_session(sid, history=False)
        except Exception as cleanup:  # noqa: BLE001 - noted on the error that matters
            error.add_note(f"then closing the session failed too: {cleanup!r}")

    @device_guard
    def extend(self, sid: str, tokens: torch.Tensor | list[int]) -> None:
        """Context the model did not generate (user / tool messages)."""
        with nvtx.annotate("agspec.drafter.extend", color="white"):
            t = self.store._as_tokens(tokens, "tokens")
            self.forget([sid])
            slot = self._slot_of(sid)
            before = self.store.session_lengths([sid])
            try:
                self.store.append_session(sid, t, checked=True)
            except BaseException:  # a level build after the corpus took them: the ring too
                if self.store.took([sid], before, [t.numel()])[0]:
                    self.state.push_one(slot, t)
                raise
            self.state.push_one(slot, t)

    @device_guard
    def append_generated(self, sids: list[str], output_ids: torch.Tensor,
                         num_output: torch.Tensor, num_output_host: Sequence[int] | None = None,
                         validate: bool = True) -> None:
        """Commits generated tokens that no draft proposed (e.g. the first token after a
        prefill): ``output_ids int32 [B, M]``, ``num_output int32 [B]``. With
        ``num_output_host`` (the counts as host ints) and ``validate=False`` (the caller
        vouches for the ids: its model's own) nothing is read back, as in :meth:`observe`."""
        self.forget(sids)
        self._observe(sids, output_ids, num_output, torch.zeros_like(num_output),
                      num_output_host, validate)

    @device_guard
    def close_session(self, sid: str) -> None:
        with nvtx.annotate("agspec.drafter.close_session", color="white"):
            self._close_session(sid)

    def _close_session(self, sid: str, history: bool = True) -> None:
        slot = self._slot_of(sid)
        self.settle()  # a deferred commit first (its counts read back)
        self._drop_ahead()
        self.forget([sid])
        try:
            self.store.close_session(sid, history)
        finally:  # closed there (an error past it: an eviction), or still open
            if not self.store.has_session(sid):
                del self._slot[sid]
                del self._version[sid]
                self.state.clear(slot)  # no text outlives its session
                self._free.append(slot)

    def _slot_of(self, sid: str) -> int:
        if sid not in self._slot:
            raise KeyError(f"session {sid!r} is unknown or closed")
        return self._slot[sid]

    # ------------------------------------------------------------ propose
    @device_guard
    def propose(self, sids: list[str], *, stable: bool = True,
                max_depths: Sequence[int] | None = None) -> DraftBatch:
        """Draft trees for ``sids`` (in that order). ``stable=False``, for a loop that
        verifies and commits a draft before it proposes again: with CUDA graphs the draft's
        tensors are views of the graph's buffers (no clones), overwritten by the next
        propose (of any bucket: the buckets' graphs share one memory pool). Returns
        :meth:`propose_ahead`'s draft of ``sids`` when it still stands (``stable=False``
        only).

        ``max_depths``: per request, the deepest node it may draft (host ints; a step emits
        at most its accepted depth plus the bonus token, so a request that may still emit
        ``r`` tokens, under its ``max_new_tokens`` or the model's context length, passes
        ``r - 1``; 0 or less drafts nothing); None: no bound but the controller's."""
        with nvtx.annotate("agspec.drafter.propose", color="green"):
            bounds = self._bounds(max_depths, len(sids))
            ahead = self._ahead
            if ahead is not None and not stable and ahead.stands(self, sids, bounds):
                self._ahead = None
                return ahead.draft
            self._drop_ahead()
            return self._propose(sids, stable, bounds)

    def _bounds(self, max_depths: Sequence[int] | None, num_requests: int
                ) -> tuple[int, ...] | None:
        """``max_depths`` checked, each clamped to ``[0, max_draft_depth]`` (a bound past a
        draft's window changes nothing); None when none binds."""
        if max_depths is None:
            return None
        if not isinstance(max_depths, (list, tuple)) or len(max_depths) != num_requests or \
                not all(is_int(m) for m in max_depths):
            raise ValueError(f"max_depths: expected a list of {num_requests} ints (one per "
                             f"request) or None, got {max_depths!r}")
        K = self.config.max_draft_depth
        if min(max_depths, default=K) >= K:
            return None
        return tuple(min(max(int(m), 0), K) for m in max_depths)

    def _drop_ahead(self) -> None:
        """Forgets the draft proposed ahead: not verified, so not to be committed either.
        (Its match also capped its sessions' next queries at its longest matches, a bound
        as good as the one it replaced: no longer match is possible there.)"""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._pending.get(ahead.key[1], (None,))[0] is ahead.draft:
            del self._pending[ahead.key[1]]

    @device_guard
    def propose_ahead(self, sids: list[str], max_depths: Sequence[int] | None = None) -> bool:
        """Proposes the next step of ``sids`` now, while their deferred commit waits for
        its settle: a loop calls it right behind ``observe(..., defer=True)``, before it
        waits for the step, so that the propose's host time runs while the device
        verifies. The next ``propose(sids, stable=False)`` returns this draft if nothing
        but the settle changed the corpora in between (its descriptor version moved by
        one: no level built, nothing else appended, opened or closed) and no session kept
        fewer tokens than queued; the draft then equals the one a propose after the
        settle makes. Otherwise that propose drafts afresh. With CUDA graphs it writes the
        buffers the current step's draft (``stable=False``) views: the loop queues every
        device read of that draft first (verification, acceptance, the commit's staging)
        and reads nothing of it afterwards.

        Returns whether it proposed: not when no deferred commit of ``sids`` (with the
        batch's match grid current) waits, or when its settle could build an index level
        (a session corpus's tail within a step's tokens of ``tail_tokens``: the loop
        would wait for a build it cannot know yet).

        ``max_depths`` (as :meth:`propose` takes them) bound this draft; the next propose
        takes it only if its own bounds are no tighter (a loop passes the bounds a step
        that accepts whole drafts leaves, which no step that ends no request tightens:
        the draft may then be shallower than a fresh one near a request's limit, never
        deeper than it may emit)."""
        bounds = self._bounds(max_depths, len(sids))
        d, arena = self._deferred, self.store.arena
        key = (self.store.epoch, tuple(sids))
        if d is None or d.key != key or self._grid_key != key or \
                arena.unsettled != d.ticket or self._kept.lengths(arena, key) is None:
            return False  # (without kept descriptors the match would settle: a read)
        grid = self._grid
        if arena.may_build(grid[1][::grid[3]],
                           min(d.out.shape[1], self.config.max_draft_depth + 1)):
            return False
        with nvtx.annotate("agspec.drafter.propose_ahead", color="green"):
            draft = self._propose(sids, stable=False, bounds=bounds)
        self._ahead = _Ahead(key, arena.descriptor_version + 1, draft, bounds)
        return True

    def _propose(self, sids: list[str], stable: bool = True,
                 bounds: tuple[int, ...] | None = None) -> DraftBatch:
        cfg, store = self.config, self.store
        dev = self.state.recent.device
        B = len(sids)
        if not 0 < B <= self.max_batch:
            raise ValueError(f"sids: {B} requests, a step takes 1 to max_batch="
                             f"{self.max_batch}")
        # the (request, corpus) grid of the match, rebuilt only when the batch or the store's
        # corpora changed (a running batch's steps reuse it: ~1.4 us a request otherwise)
        key = (store.epoch, tuple(sids))
        if key != self._grid_key:  # (else no tenant's text changed since it was built)
            _check_distinct(sids)
            self._grid_key = None  # (current once its stale sessions' caps are reset)
            self._grid = self._match_grid(sids)
            stale = [i for i, sid in enumerate(sids)
                     if self._version[sid] != store.tenant_version(sid)]
            if stale:  # a tenant's new text: its sessions' next matches may be longer
                st = self._grid[5][to_device(stale, torch.int64, dev)]
                self.state.match_cap[st] = store.config.max_depth
                for i in stale:
                    self._version[sids[i]] = store.tenant_version(sids[i])
            self._grid_key = key
        _, rows_cid, _, Rs, _, slots, tier, query_rows = self._grid
        arena = store.arena
        desc = self._kept.get(arena, self._writer, key, rows_cid, Rs)
        P, K = cfg.max_positions, cfg.max_draft_depth
        # the kernel directly: queries come from the validated ring, so the per-call checks
        # of IndexArena.match (host syncs) are not needed on this per-step path. One launch
        # on a GPU: each row reads its request's ring row in place (length capped by
        # match_cap) and writes its candidate windows [P, K], the K tokens after each
        # occurrence, read here because the arena's buffers move as it grows (a graph would
        # keep the old address)
        out, matched, plan = self._match_out(B, Rs, desc.max_levels)
        # checked once for the same tensors (the arena's buffers, the kept descriptors and
        # outputs, the grid's rows; the rest the drafter's own, made once): ~10 us a step
        args = (arena.tokens, arena.sa, arena.sa_key, arena.src, desc, query_rows, out)
        same = _same(self._match_args, args)
        state = self.state
        suffix_match(arena.tokens, arena.sa, desc, state.recent, state.recent_len,
                     max_depth=store.config.max_depth, max_positions=P, max_scan=cfg.max_scan,
                     sa_key=arena.sa_key, query_rows=query_rows, max_lengths=state.match_cap,
                     window=K, src=arena.src, out=out, checked=same)
        if not same:
            self._match_args = tuple(a if a is None else weakref.ref(a) for a in args)
        max_k = None if bounds is None else self._writer.write((bounds, torch.int64))[0]
        if plan is not None:
            if max_k is None:  # (a graph reads a bound for every request)
                max_k = self._no_bound[:B]
            out = self._graphs[0].run(plan, {"slots": slots, "tier": tier, "max_k": max_k},
                                      clone=stable)
        else:
            out = self._draft_tensors(slots, tier, **matched, max_k=max_k, num_requests=B)
        tok, parent, num, srcs, nd, node_row = out
        draft = DraftBatch(tok, parent, num, srcs)
        self.forget(sids)  # a session's newer proposal replaces its older ones
        # (the bounds go to the controller at the commit: a draft one cut keeps the scale)
        self._pending[tuple(sids)] = (draft, nd, node_row, bounds)
        return draft

    def _match_out(self, B: int, Rs: int, max_levels: int
                   ) -> tuple[MatchResult, dict[str, torch.Tensor], StepPlan | None]:
        """Where a step's match of ``B`` requests x ``Rs`` corpora writes, so that a step
        allocates nothing: ``(out, matched, plan)``, ``out`` the match's outputs and
        ``matched`` the propose step's ``length [B, Rs]``, ``win``, ``src [B, Rs, P, K]``,
        views of the same memory. With graphs that memory is the propose graph's input
        buffers (``plan``'s staged inputs: the match writes them in place); without (``plan``
        None), the drafter's own. Counts, positions and level ranges go to scratch rows for
        the largest batch, whose level columns grow (doubling) with the corpora's levels.
        Made once per ``(B, Rs)`` and level width."""
        cached = self._match_outs.get((B, Rs))
        if cached is not None and cached[3] is self._graphs and \
                cached[0].sa_lo.shape[1] >= max_levels:
            return cached[:3]
        dev, P, K = self.state.recent.device, self.config.max_positions, self.config.max_draft_depth
        rows = self.max_batch * _NUM_TIERS
        scratch = self._match_scratch
        if scratch is None or scratch.sa_lo.shape[1] < max_levels:
            levels = max(max_levels, 2 * (0 if scratch is None else scratch.sa_lo.shape[1]), 4)
            i64 = lambda *shape: torch.empty(shape, dtype=torch.int64, device=dev)  # noqa: E731
            scratch = self._match_scratch = MatchResult(
                torch.empty(rows, dtype=torch.int32, device=dev), i64(rows), i64(rows, P),
                i64(rows, levels), i64(rows, levels),
                torch.empty(rows, P, K, dtype=torch.int32, device=dev),
                torch.empty(rows, P, K, dtype=torch.int8, device=dev))
            self._match_outs.clear()
        Q, plan = B * Rs, None
        if self._graphs is not None:
            plan = self._graphs[0].plan(B, self._draft_example(Rs), staged=_MATCHED)
            matched = plan.staged
        else:
            matched = {"length": scratch.length[:Q].view(B, Rs),
                       "win": scratch.windows[:Q].view(B, Rs, P, K),
                       "src": scratch.window_sources[:Q].view(B, Rs, P, K)}
        out = MatchResult(matched["length"].view(Q), scratch.count[:Q], scratch.positions[:Q],
                          scratch.sa_lo[:Q], scratch.sa_hi[:Q], matched["win"].view(Q, P, K),
                          matched["src"].view(Q, P, K))
        self._match_outs[(B, Rs)] = (out, matched, plan, self._graphs)
        return out, matched, plan

    def _match_grid(self, sids: list[str]) -> tuple:
        """``(slot ids, corpus id per row, tier per row, Rs, query slot per row)`` of the
        match's ``[B, Rs]`` grid of (request, corpus) rows, ``Rs`` the most corpora of a
        request, then the slots ``int64 [B]``, tiers ``int64 [B, Rs]`` and query slots
        ``int64 [B * Rs]`` on the device (views of the drafter's grid buffer, valid until
        the next grid). A request with fewer corpora repeats its session corpus as tier -1
        rows, which have no query (slot -1: no match, no candidates)."""
        slot_ids = [self._slot_of(s) for s in sids]
        corpora = [self.store.corpora_of(s) for s in sids]
        Rs = max(len(c) for c in corpora)
        rows_cid, rows_tier, rows_slot = [], [], []
        for slot, c in zip(slot_ids, corpora):
            for r in range(Rs):
                tier_r, cid = c[r] if r < len(c) else (-1, c[0][1])
                rows_cid.append(cid)
                rows_tier.append(int(tier_r))
                rows_slot.append(slot if tier_r >= 0 else -1)
        B, Q = len(sids), len(rows_cid)
        self._writer.copy_to(self._grid_dev[:B + 2 * Q], slot_ids + rows_tier + rows_slot)
        g = self._grid_dev
        return (slot_ids, rows_cid, rows_tier, Rs, rows_slot, g[:B], g[B:B + Q].view(B, Rs),
                g[B + Q:B + 2 * Q])

    def forget(self, sids: Sequence[str]) -> None:
        """Drops the pending proposals that draft any of ``sids`` (their context moved on,
        or their caller proposed again: they are never to be observed)."""
        gone = set(sids)
        for key in [k for k in self._pending if not gone.isdisjoint(k)]:
            del self._pending[key]

    def _draft_example(self, rows: int) -> dict[str, torch.Tensor]:
        """One request's inputs of :meth:`_draft_tensors` with ``rows`` corpora (shapes)."""
        dev, P, K = self.state.recent.device, self.config.max_positions, self.config.max_draft_depth
        return {"slots": torch.zeros(1, dtype=torch.int64, device=dev),
                "tier": torch.zeros(1, rows, dtype=torch.int64, device=dev),
                "length": torch.zeros(1, rows, dtype=torch.int32, device=dev),
                "win": torch.zeros(1, rows, P, K, dtype=torch.int32, device=dev),
                "src": torch.zeros(1, rows, P, K, dtype=torch.int8, device=dev),
                "max_k": torch.zeros(1, dtype=torch.int64, device=dev)}

    def _draft_tensors(self, slots, tier, length, win, src, max_k, num_requests
                       ) -> tuple[torch.Tensor, ...]:
        """The device half of a propose, after the match (a CUDA graph per batch bucket on a
        GPU): ``slots int64 [B]``, per (request, corpus) row ``tier int64 [B, Rs]`` (-1: no
        corpus), match ``length int32 [B, Rs]``, candidate windows ``win int32 [B, Rs, P,
        K]`` and their sources ``src int8 [B, Rs, P, K]`` (-1 past a corpus), each request's
        depth bound ``max_k int64 [B]`` (None: none). Chooses the rows that supply
        candidates, weights them, and returns :meth:`_tree_tensors`'s outputs; writes the
        next match cap of ``slots``."""
        cfg = self.config
        Rs = win.shape[1]
        # the rows within candidate_slack of the best match (with the tier bonus) supply
        # candidates, at most max_candidate_rows per request: the trie below costs
        # O(C^2 K), and rows that supply nothing would only pad it. One kernel on a GPU.
        nslot = Rs if cfg.max_candidate_rows is None else min(Rs, cfg.max_candidate_rows)
        W, S, Wt, best, longest = candidate_rows(
            tier, length, win, src, self._tier_bonus, self.stats.tier_hits, self.stats.tier_drafts,
            num_slots=nslot, min_match=cfg.min_match, slack=cfg.candidate_slack)
        self.state.match_cap[slots] = longest  # the longest raw match caps the next query
        return self._tree_tensors(slots, W, S, Wt, best, max_k, num_requests)

    def _tree_tensors(self, slots, W, S, Wt, best, max_k, num_requests
                      ) -> tuple[torch.Tensor, ...]:
        """``(token_ids, parents, num_draft_tokens, sources, node depth, node calibration
        row)`` of ``B`` requests' candidate windows ``W int32 [B, C, K]`` (sources ``S``,
        weights ``Wt [B, C]``, match length ``best [B]``, depth bounds ``max_k int64 [B]`` or
        None). Shapes depend on ``(B, C, K)``
        only; ``num_requests`` (int, or a 0-d device tensor when ``B`` counts padding
        requests without candidates) is what the batch budget prices."""
        cfg = self.config
        B, C, K = W.shape
        # the trie's nodes and their estimated acceptance (path share among candidates x
        # calibrated chance that the path survives to the depth), within the controller's
        # depth cap (and each request's own bound): one kernel on a GPU
        state, stats = self.state, self.stats
        k, mode = depth_caps(slots, best, state.scale, state.cap, state.prev_full,
                             static_k=cfg.controller.static_k, max_k=max_k)
        key, rep, calib_row, mass = node_probs(
            W, S, Wt, best, mode, k, stats.calib_hits, stats.calib_seen,
            num_tiers=_NUM_TIERS, max_match=self.store.config.max_depth, min_prob=cfg.min_prob,
            calibrate=cfg.calibrate)  # key [B, C * K]: flat (c, d) -> c * K + d, -2: no node
        if not cfg.tree:
            chain = self._chain_mask(rep, mass, key.view(B, C, K) > -1.5)
            key = torch.where(chain.view(B, C * K), key, -2.0)
        # best-first order: probability descending, then the shallower node, then the lower
        # candidate index; at most max_nodes per request (static: no host sync on the count)
        N = min(cfg.max_nodes, C * K)
        order, ranked, keep_n = best_first(key, C, K, N, cfg.max_nodes)
        if cfg.batch_budget and cfg.controller.static_k is None:
            # every request keeps at most max_nodes: the batch's best B * N scores hold all it
            # may keep (padding rows score nothing: they never add gain, only cost). One
            # kernel on a GPU.
            table, base = self._budget_table(B)
            keep_n = budget_keep(ranked, keep_n, num_requests, table, table_base=base)
        # the kept nodes (topological: a parent never ranks below its child)
        tok, parent, srcs, nd, node_row = emit_nodes(order, keep_n, W, S, rep, calib_row)
        return tok, parent, keep_n.to(torch.int32), srcs, nd, node_row

    def _budget_table(self, rows: int) -> tuple[torch.Tensor, int | None]:
        """The batch budget's cost table for a step of ``rows`` requests and where it reads
        a step of ``n`` nodes (``table_base``): the curve measured at the smallest batch
        ``>=`` the step's bucket (powers of two and ``max_batch``; a padded step's rows are
        its bucket already, and a CUDA graph bakes in its bucket's table), so a padded and
        an unpadded step read the same curve whatever sizes were measured."""
        bucket = next((b for b in self._buckets if b >= rows), rows)
        return self._cost_tables[self._cost_curves.size_for(bucket)]

    @staticmethod
    def _chain_mask(rep, mass, is_node) -> torch.Tensor:
        """Nodes on the heaviest path (ties: lower candidate index)."""
        B, C, K = rep.shape
        dev = rep.device
        on = torch.ones(B, C, dtype=torch.bool, device=dev)  # candidates consistent so far
        out = torch.zeros(B, C, K, dtype=torch.bool, device=dev)
        cidx = torch.arange(C, device=dev)
        for d in range(K):
            node = is_node[:, :, d] & on
            m = torch.where(node, mass[:, :, d], -1.0)
            pick = torch.argmax(m, dim=1)  # first max = lowest index
            has = m.max(dim=1).values > -0.5
            out[:, :, d] = (cidx[None, :] == pick[:, None]) & has[:, None]
            on = on & (rep[:, :, d] == pick[:, None]) & has[:, None]
        return out

    # ------------------------------------------------------------ observe
    @device_guard
    def observe(self, sids: list[str], output_ids: torch.Tensor, num_output: torch.Tensor,
                num_accepted: torch.Tensor, *, num_output_host: Sequence[int] | None = None,
                validate: bool = True, path_nodes: torch.Tensor | None = None,
                num_verified: torch.Tensor | None = None, defer: bool = False) -> None:
        """Commits verification results for the last ``propose(sids)``.

        Args:
            output_ids: ``int32 [B, M]`` accepted draft tokens then the bonus, -1 padded.
            num_output: ``int32 [B]`` valid tokens per row (accepted + 1, or fewer: a
                request that ended inside the step), at most ``M``.
            num_accepted: ``int32 [B]`` draft tokens accepted (at most
                ``max_draft_depth``; more than ``num_output[b] - 1`` when the loop emitted
                fewer tokens than it verified: a request that ended inside the step).
            num_output_host: ``num_output`` as host ints, when the caller has them (a
                serving loop does: it emits the tokens); otherwise they are read back.
            validate: check that the committed ids are in the vocabulary (a read back of
                ``output_ids``); a caller whose ids come from the model may skip it.
            path_nodes: ``int [B, A]`` the accepted draft nodes in path order, ``-1``
                padded (``AcceptResult.accepted_nodes``, ``teacher_forced_accept(...)
                .path_nodes``), when the verifier has them: the drafter then does not search
                its tree for the accepted tokens again (a pointer-jumping pass, ~130 small
                kernels). Entries past ``num_accepted[b]`` are ignored.
            num_verified: ``int32 [B]``, when the loop verified fewer nodes than proposed
                (``DraftBatch.capped``: an opted-out request's 0, a draft fitted to the KV
                pool): the first ``num_verified[b]`` nodes in best-first order. The rest
                were never verified: they count neither as drafted nor as reached (the
                controller's depth, the tier weights, the calibration).

        With ``num_output_host`` and ``validate=False`` nothing is read back to the host,
        the periodic level builds of a corpus included (every ``tail_tokens`` appended
        tokens: the arena counts a level's size from the separators it records).

        ``defer=True`` (with ``validate=False`` and ``num_output_host`` None; ``num_output``
        at most ``max_draft_depth + 1``, the caller's contract, as for the ids) commits
        before the host has the counts: a loop queues it
        right behind its verification and acceptance, so the commit's host time runs while
        the device verifies, and passes the counts to :meth:`settle` once it has read them
        (or fewer: a request that ended inside the step). The device half and the session
        corpora's tokens are queued now; the corpora's lengths on the host and their level
        builds wait for :meth:`settle`. In between, a ``propose`` of the same ``sids``
        drafts from the committed state (the same longest matches; a level build that
        became due waits, its positions scanned as the tail's, all of them), and any call
        that needs the corpora's lengths reads the counts back first (one sync, the same
        state).
        """
        with nvtx.annotate("agspec.drafter.commit", color="red"):
            if defer:
                if validate or num_output_host is not None:
                    raise ValueError("defer: needs validate=False and no num_output_host "
                                     "(a deferred commit reads nothing back)")
                if len(sids) > self.max_batch:
                    raise ValueError(f"sids: a deferred commit takes at most max_batch="
                                     f"{self.max_batch} sessions, got {len(sids)}")
            self._observe(sids, output_ids, num_output, num_accepted, num_output_host,
                          validate, path_nodes, num_verified, defer)

    @device_guard
    def withdraw(self) -> None:
        """Settles a deferred commit with nothing kept, if one waits: its step failed
        before any session took its tokens. The corpora take none and the rings are as
        before it; its verification still counts (as :meth:`settle`'s cut keeps it)."""
        if self._deferred is not None:
            B, M = self._deferred.out.shape
            self.settle([0] * B, num_queued_host=[M] * B)

    def has_session(self, sid: str) -> bool:
        """Whether ``sid`` holds a slot here (opened, not yet closed)."""
        return sid in self._slot

    @device_guard
    def settle(self, num_output_host: Sequence[int] | None = None, *,
               num_queued_host: Sequence[int] | None = None) -> None:
        """Completes a deferred :meth:`observe`: ``num_output_host`` are the tokens each
        session keeps, as host ints (its ``num_output``, read back when None). Nothing to
        do when none waits, or when a call in between settled it already with the
        queued counts (reading them back).

        ``num_queued_host``: the deferred ``num_output`` as host ints, when a session kept
        fewer (a request that ended inside the step: EOS, a stop string; all zeros and the
        output width: a step that failed after the commit was queued). Such a session's
        corpus and recent-token ring then hold what it kept, as a plain observe of those
        counts leaves them; its verification still counts (controller, calibration, tier
        weights), as it would have had the step not failed.

        Raises:
            ValueError: counts of the wrong length, or more kept than queued (nothing
                changes).
            RuntimeError: a session keeps fewer tokens than queued, but a call in between
                settled the commit with the queued counts already (a loop may only
                ``propose`` the same sessions between a deferred observe and its settle).
        """
        d, self._deferred = self._deferred, None
        arena = self.store.arena
        counts = None if num_output_host is None else [int(n) for n in num_output_host]
        queued = None if num_queued_host is None else [int(n) for n in num_queued_host]
        cut: list[bool] = []
        if d is not None and counts is not None:
            B, M = d.out.shape
            if len(counts) != B or (queued is not None and len(queued) != B) or \
                    any(not 0 <= k <= (M if queued is None else q)
                        for k, q in zip(counts, queued or counts)):
                self._deferred = d
                raise ValueError(f"num_output_host: expected {B} counts in [0, {M}], each at "
                                 f"most num_queued_host's, got {counts} and {queued}")
            if queued is not None:
                cut = [k < q for k, q in zip(counts, queued)]
        elif counts is not None and queued is not None:  # none waits: a call in between
            cut = [k < q for k, q in zip(counts, queued)]  # settled it (close_session)
        if d is None or arena.unsettled != d.ticket:
            if any(cut):
                raise RuntimeError(
                    "settle: sessions kept fewer tokens than their deferred commit queued, "
                    "but a call in between settled it with the queued counts already: only "
                    "a propose of the same sessions may come between observe(defer=True) "
                    "and settle")
            return
        if any(cut):
            self._drop_ahead()  # (drafted from the rings as queued)
        try:
            # (past here the corpora hold the counts, even if a level build raises)
            arena.settle(counts, cut=cut)
        finally:
            if any(cut):  # their rings as before the commit, then only what they kept
                # (after the corpora: a ring that fails to follow costs drafts, never
                # tokens the context lacks)
                dev = d.out.device
                rows = to_device([b for b, c in enumerate(cut) if c], torch.int64, dev)
                kept = to_device([counts[b] for b, c in enumerate(cut) if c], torch.int64,
                                 dev)
                self.state.restore_rings(rows, d.slots[rows], d.out[rows].clamp(min=0),
                                         kept)
        if d.key is not None and not any(cut):  # kept descriptors grew on the device
            self._kept.appended(arena, d.key, d.version)

    def _observe(self, sids, output_ids, num_output, num_accepted, num_output_host=None,
                 validate=True, path_nodes=None, num_verified=None, defer=False) -> None:
        self.settle()  # a deferred commit the caller left (its counts read back)
        dev = self.state.recent.device
        # the batch's grid from its propose, while current: its slots and session corpora
        grid = self._grid if self._grid_key == (self.store.epoch, tuple(sids)) else None
        if grid is None:  # (a batch with a grid was checked when its grid was built)
            _check_distinct(sids)
            slots, = self._writer.write(([self._slot_of(s) for s in sids], torch.int64))
        else:
            slots = grid[5]
        B = len(sids)
        # integer tensors of the batch's rows (a float count would reach the arena's host
        # lengths), checked before anything changes
        check_int_tensor(output_ids, "output_ids", (B, None))
        for name, t in (("num_output", num_output), ("num_accepted", num_accepted),
                        ("num_verified", num_verified)):
            if t is not None:
                check_int_tensor(t, name, (B,))
        if path_nodes is not None:
            check_int_tensor(path_nodes, "path_nodes", (B, None))
        # (cast: the serving loop's tensors are these already, and a no-op .to() costs
        # ~2 us of a step's host time)
        out = cast(output_ids, torch.int32, dev)
        nout = cast(num_output, num_output.dtype, dev)
        nacc = cast(num_accepted, num_accepted.dtype, dev)
        M = out.shape[1]
        if num_output_host is not None and (len(num_output_host) != B or
                                            any(not 0 <= n <= M for n in num_output_host)):
            raise ValueError(f"num_output_host: expected {B} counts in [0, {M}], got "
                             f"{list(num_output_host)}")
        # validate before any state changes: a bad row must not half-commit the batch
        if validate:
            V = self.store.vocab_size
            used = torch.arange(M, device=dev)[None, :] < nout.to(torch.int64)[:, None]
            bad_ids, bad_out, bad_acc = torch.stack([
                (((out < 0) | (out >= V)) & used).any(), ((nout < 0) | (nout > M)).any(),
                ((nacc < 0) | (nacc > self.config.max_draft_depth)).any()]).tolist()
            if bad_out:
                raise ValueError(f"num_output: counts must be in [0, {M}] (output_ids' "
                                 f"columns)")
            if bad_acc:
                raise ValueError(f"num_accepted: counts must be in [0, "
                                 f"{self.config.max_draft_depth}] (max_draft_depth)")
            if bad_ids:
                raise ValueError(f"output_ids: token ids must be in [0, {V}) in the first "
                                 "num_output[b] columns of each row")
        pending = self._pending.pop(tuple(sids), None)
        self.forget(sids)
        if pending is not None:
            draft, nd, calib_row, bounds = pending
            # (written now: a staging ring's view does not outlive a few steps)
            bound = None if bounds is None else self._writer.write((bounds, torch.int64))[0]
            N, M, K1 = draft.max_nodes, out.shape[1], self.config.max_draft_depth + 1
            if num_verified is not None:  # the verified prefix of each best-first draft
                num = torch.minimum(draft.num_draft_tokens,
                                    cast(num_verified, torch.int32, dev))
                src = draft.maybe_source
                if src is not None:
                    src = torch.where(torch.arange(N, device=dev)[None, :] < num[:, None], src,
                                      -1)
                draft = replace(draft, num_draft_tokens=num, maybe_source=src)
            path = None
            if path_nodes is None:  # the path the accepted tokens spell in the draft
                cols = torch.arange(M, device=dev)[None, :]
                spelled = torch.where(cols < nacc.to(torch.int64)[:, None], out, NO_TOKEN)
                path = teacher_forced_accept(draft, spelled).path_nodes
            elif self._graphs is None:  # entries past num_accepted (<= N) are ignored
                path = path_nodes.to(dev, torch.int64)[:, :N]
                if path.shape[1] < N:
                    path = torch.nn.functional.pad(path, (0, N - path.shape[1]), value=-1)
            inputs = {"slots": slots, "out": out, "nout": cast(nout, torch.int32),
                      "nacc": cast(nacc, torch.int32), "token_ids": draft.token_ids,
                      "parents": draft.parents, "num_draft_tokens": draft.num_draft_tokens,
                      "maybe_source": draft.maybe_source, "nd": nd, "calib_row": calib_row,
                      "path": path_nodes if path is None else path, "bound": bound}
            if bound is None and self._graphs is not None:  # (a graph reads one per row)
                inputs["bound"] = self._no_bound[:B]
            if self._graphs is not None:  # one width: a draft accepts at most its depth
                # the accepted tokens and path nodes straight into the graph's input
                # buffers (K1 and N columns), padded there: no padded copies of them. The
                # bucket is this draft's width's (N; the path's as the nodes')
                plan = self._commit_plan(len(sids), N)
                for name in _COMMIT_STAGED:
                    self._graphs[1].write_columns(plan, name, inputs.pop(name))
                # a view of the graph's buffer (last_accepted_sources: until the next observe)
                (acc_src,) = self._graphs[1].run(plan, inputs, clone=False)
                W = max(M, 1)  # the eager step's width: one column per output token
                acc_src = acc_src[:, :W] if W <= K1 else \
                    torch.nn.functional.pad(acc_src, (0, W - K1), value=-1)
            else:
                (acc_src,) = self._commit_tensors(**inputs, num_requests=len(sids))
            self.last_accepted_sources = acc_src
        else:  # (saved, up to max_batch rows: put back if the corpora cannot take them)
            if B <= self.max_batch:
                self.state.save_rings(slots)
            self.state.push(slots, out.clamp(min=0), nout)
        if defer:  # the device's counts: the arena settles them later
            counts = nout
        elif num_output_host is None:
            counts = nout.tolist()
        else:
            counts = [int(n) for n in num_output_host]
        # validated above, or the caller vouches for the ids; one scatter for every session
        # (the kept descriptors' session lengths, while current, grow in the same launch)
        arena = self.store.arena
        version = arena.descriptor_version
        lengths = None if defer else self.store.session_lengths(sids)
        try:
            self.store.append_sessions(
                sids, out.contiguous(), counts,
                corpus_ids=None if grid is None else grid[1][::grid[3]],
                totals=None if grid is None else self._kept.lengths(arena, self._grid_key))
        except BaseException:
            # the corpora took nothing (deferred: their level builds wait for settle; else
            # their lengths tell): the rings as saved before the push, so the two stay in
            # step (the verification still counts, as settle's cut keeps it)
            if defer or (B <= self.max_batch and self.store.session_lengths(sids) == lengths):
                none = torch.zeros(B, dtype=torch.int64, device=dev)
                self.state.restore_rings(torch.arange(B, device=dev), slots, out.clamp(min=0),
                                         none)
            raise
        if defer:
            self._deferred = _Deferred(None if grid is None else self._grid_key, version,
                                       arena.unsettled, slots, out)
        elif grid is not None:
            self._kept.appended(arena, self._grid_key, version)

    def _commit_plan(self, B: int, N: int) -> StepPlan:
        """The commit step's plan for ``B`` requests' drafts of ``N`` node columns (made
        once per ``(B, N)``; the accepted tokens and path nodes staged)."""
        cached = self._commit_plans.get((B, N))
        if cached is None or cached[1] is not self._graphs:
            cached = self._commit_plans[(B, N)] = (self._graphs[1].plan(
                B, self._commit_example(N), staged=_COMMIT_STAGED), self._graphs)
        return cached[0]

    def _commit_example(self, N: int | None = None) -> dict[str, torch.Tensor]:
        """One request's inputs of :meth:`_commit_tensors` (shapes and dtypes) for drafts of
        ``N`` node columns (default: the widest a draft has)."""
        dev, cfg = self.state.recent.device, self.config
        if N is None:
            N = min(cfg.max_nodes, cfg.max_positions * (cfg.max_candidate_rows or _NUM_TIERS)
                    * cfg.max_draft_depth)
        i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=dev)  # noqa: E731
        i64 = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        return {"slots": i64(1), "out": i32(1, cfg.max_draft_depth + 1), "nout": i32(1),
                "nacc": i32(1), "token_ids": i32(1, N), "parents": i32(1, N),
                "num_draft_tokens": i32(1),
                "maybe_source": torch.zeros(1, N, dtype=torch.int8, device=dev),
                "nd": i64(1, N), "calib_row": i64(1, N), "path": i64(1, N), "bound": i64(1)}

    def _commit_state(self) -> list[torch.Tensor]:
        """The state :meth:`_commit_tensors` updates in place."""
        state = self.state
        return [state.prev_full, state.scale, self.stats.tables, state.recent,
                state.recent_len, state.match_cap]

    def _commit_tensors(self, slots, out, nout, nacc, token_ids, parents, num_draft_tokens,
                        maybe_source, nd, calib_row, path, bound, num_requests
                        ) -> tuple[torch.Tensor]:
        """The device half of a commit (a CUDA graph per batch bucket on a GPU): for the last
        draft (``token_ids``, ``parents``, ``maybe_source [B, N]``, ``num_draft_tokens
        [B]``, node depth ``nd`` and calibration row ``calib_row [B, N]``) and what
        verification accepted (``out int32 [B, M]`` accepted tokens then the bonus,
        ``nout``, ``nacc int32 [B]``, the accepted nodes ``path int64 [B, N]`` in path
        order, -1 padded) and the depth bounds it was drafted under (``bound int64 [B]``, or
        None), updates copy mode, controller scale, tier weights, calibration
        and the recent-token ring of ``slots``. Returns the accepted tokens' source tags
        ``int64 [B, M]``."""
        del num_requests  # the commit of a padding row changes nothing
        state, stats = self.state, self.stats
        # copy mode and the controller's scale: one kernel on a GPU
        c = self.config.controller
        controller_commit(slots, nd, num_draft_tokens, nacc, state.scale, state.cap,
                          state.prev_full, alpha=c.alpha, beta=c.beta, s_min=c.s_min,
                          s_max=c.s_max, bound=bound)
        # ring push, tier counts, calibration counts: one kernel on a GPU
        drafted, hits, seen, accepted = stats.zero_counts()
        acc_src = drafter_commit(slots, out, nout, nacc, maybe_source, parents,
                                 num_draft_tokens, nd, calib_row, path, state.recent,
                                 state.recent_len, state.match_cap, drafted, hits, seen,
                                 accepted, calib_depth=stats.calib_seen.shape[1],
                                 before=state.ring_before[:slots.numel()])
        # the decayed tables (tier weights: drafted nodes per tier vs accepted path tokens
        # per tier; calibration cells over their prior), laid out as the counts: three ops
        stats.fold()
        return (acc_src,)


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A deferred observe: its grid's key (None: no grid), the descriptor version before
    its append, the arena's ticket, its slots ``int64 [B]`` and accepted tokens ``int32
    [B, M]`` (the caller's buffer: valid until the loop's next step, which settles first)."""

    key: tuple | None
    version: int
    ticket: int | None
    slots: torch.Tensor
    out: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A draft proposed ahead of its batch's settle: the grid key it was drafted for, the
    descriptor version the settle leaves when it builds nothing, the draft, its requests'
    depth bounds (``Drafter._bounds``'s)."""

    key: tuple
    version: int
    draft: DraftBatch
    bounds: tuple[int, ...] | None

    def stands(self, d: "Drafter", sids: list[str], bounds: tuple[int, ...] | None) -> bool:
        """Whether this draft stands for a propose of ``sids`` under ``bounds`` now: the
        same batch and sessions, bounds no tighter than it was drafted under (it is then
        the draft a propose under its own bounds would make: at most that deep, so
        within the new ones), the settle done, nothing else changed the corpora since,
        and the draft still pending (no call in between forgot it)."""
        arena = d.store.arena
        within = bounds is None or (self.bounds is not None and
                                    all(a <= b for a, b in zip(self.bounds, bounds)))
        return (self.key == (d.store.epoch, tuple(sids)) and within and
                d._deferred is None and
                arena.unsettled is None and arena.descriptor_version == self.version and
                d._pending.get(self.key[1], (None,))[0] is self.draft)


def _check_distinct(sids) -> None:
    """A session's state (its ring, its corpus) takes one row of a step."""
    if len(set(sids)) != len(sids):
        raise ValueError(f"sids: each session at most once per step, got {list(sids)}")

