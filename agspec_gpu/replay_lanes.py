"""Drafters as the replay loop drives them: one small adapter ("lane") per kind.

The replay loop (``agspec_gpu.replay``) runs sessions as one continuous batch and talks to a
:class:`Lane`; a lane hides whether the drafter is

- batched on the device (:class:`BatchedLane`: ``agspec_gpu.drafter.Drafter`` and its
  :class:`~agspec_gpu.tiers.CorpusStore`, one ``propose`` per step for the whole batch),
- a host baseline driven one request at a time (:class:`HostLane`: the
  :class:`~agspec_gpu.baselines.HostDrafter` protocol, a request being one assistant message),
- or the oracle (:class:`OracleLane`: accepts the longest prefix of the true continuation
  found in the store's corpora, via :func:`agspec_gpu.oracle.message_prefix_lengths`).

:func:`make_lane` builds a lane from a drafter name (``none``, ``pld-hf``, ..., ``agspec``,
``agspec-no-emission``, ...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

import numpy as np
import torch

from agspec_gpu.host import HostWriter, synchronize
from agspec_gpu.baselines import HOST_DRAFTERS, HostDrafter, make_host_drafter
from agspec_gpu.corpus import BudgetExceeded
from agspec_gpu.cost_model import CostModel
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.accept import NO_TOKEN, teacher_forced_accept
from agspec_gpu.tokenizer import Tokenizer

# agspec-p10: nodes whose calibrated acceptance estimate is below 0.1 are not drafted, the
# pruning rule of SuffixDecoding's min_token_prob=0.1 (the acceptance-rate operating point)
AGSPEC_DRAFTERS = ("agspec", "agspec-p10", "agspec-no-emission", "agspec-no-workspace",
                   "agspec-static-k8", "agspec-static-k16", "agspec-static-k32")
DRAFTER_NAMES = HOST_DRAFTERS + AGSPEC_DRAFTERS

# truth(width, pad) -> int32 [B, width]: the true next tokens of every row, `pad` past the
# end of its message.
TruthFn = Callable[[int, int], np.ndarray]


@dataclass
class StepResult:
    """One batched step, on the host.

    Attributes:
        num_drafted: ``int64 [B]`` draft tokens proposed.
        num_accepted: ``int64 [B]`` draft tokens accepted (never past the message end).
        maybe_sources: ``int64 [B, D]`` source code (``tier*8 + form``) of each accepted
            token, ``-1`` elsewhere; None when the drafter does not say.
        draft_seconds: wall time of the proposal for the whole batch.
    """

    num_drafted: np.ndarray
    num_accepted: np.ndarray
    maybe_sources: np.ndarray | None
    draft_seconds: float


class Lane(Protocol):
    """A drafter as the replay loop drives it.

    Per session: ``open_session``; then, in message order, ``extend`` for context messages
    and ``start_message`` / steps / ``finish_message`` for each assistant message; finally
    ``close_session``; after a tenant's last session, ``close_tenant`` (teardown frees its
    workspace and history). A step is ``step`` then ``observe`` for every active session at once.
    ``oracle_key`` names the corpora whose oracle bounds this drafter (None: no oracle).
    """

    name: str
    oracle_key: Hashable | None
    wants_files: bool

    def open_session(self, sid: str, tenant: str, role: str, prompt: np.ndarray) -> None: ...

    def extend(self, sid: str, tokens: np.ndarray) -> None: ...

    def add_file(self, tenant: str, path: str, text: str, first_line: int | None) -> None: ...

    def start_message(self, sid: str, tenant: str, context: np.ndarray) -> None: ...

    def step(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn,
             remaining: np.ndarray) -> StepResult: ...

    def observe(self, sids: list[str], output_ids: np.ndarray, num_output: np.ndarray,
                num_accepted: np.ndarray, path_nodes: torch.Tensor | None = None) -> None: ...

    def finish_message(self, sid: str) -> None: ...

    def close_session(self, sid: str) -> None: ...

    def close_tenant(self, tenant: str) -> None: ...


def accept_on_host(draft: DraftBatch, truth: TruthFn
                   ) -> tuple[np.ndarray, np.ndarray | None, torch.Tensor]:
    """``(num_accepted, maybe_sources, path_nodes)`` of a draft against the true
    continuation (``path_nodes``: ``int64 [B, N]`` on the draft's device, -1 padded)."""
    width = draft.max_nodes
    t = torch.from_numpy(truth(width, NO_TOKEN)).to(draft.token_ids.device)
    paths = teacher_forced_accept(draft, t)
    num_acc = paths.num_accepted.cpu().numpy()
    if draft.maybe_source is None or width == 0:
        return num_acc, None, paths.path_nodes
    src = draft.maybe_source.long().gather(1, paths.path_nodes.clamp(min=0))
    src = torch.where(paths.path_nodes >= 0, src, -1)
    return num_acc, src.cpu().numpy(), paths.path_nodes


# ----------------------------------------------------------------------------- host drafters


class HostLane:
    """A :class:`~agspec_gpu.baselines.HostDrafter`, one request per assistant message.

    The request key of a session's ``n``-th assistant message is ``f"{sid}#{n}"``.

    Its drafts are padded into a :class:`DraftBatch` so that acceptance is computed by the
    same code as the batched drafter's. ``draft_seconds`` sums the ``propose`` calls of the
    batch's rows, which is what a server calling a host drafter per request pays.
    """

    wants_files = False

    def __init__(self, drafter: HostDrafter, name: str | None = None,
                 oracle_key: Hashable | None = None) -> None:
        self.drafter = drafter
        self.name = name or drafter.name
        self.oracle_key = oracle_key
        self._keys: dict[str, str] = {}  # sid -> key of its current request
        self._num_requests: dict[str, int] = {}

    def open_session(self, sid: str, tenant: str, role: str, prompt: np.ndarray) -> None:
        self._num_requests[sid] = 0

    def extend(self, sid: str, tokens: np.ndarray) -> None:
        pass  # a host drafter gets the whole context at start_message

    def add_file(self, tenant: str, path: str, text: str, first_line: int | None) -> None:
        pass

    def start_message(self, sid: str, tenant: str, context: np.ndarray) -> None:
        n = self._num_requests[sid]
        self._num_requests[sid] = n + 1
        key = self._keys[sid] = f"{sid}#{n}"
        self.drafter.begin(key, tenant, context, session=sid)

    def step(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn,
             remaining: np.ndarray) -> StepResult:
        seconds = 0.0
        drafts = []
        for sid, ctx in zip(sids, contexts):
            t0 = time.perf_counter()
            drafts.append(self.drafter.propose(self._keys[sid], ctx))
            seconds += time.perf_counter() - t0
        draft = DraftBatch.from_host(drafts)
        num_acc, _, _ = accept_on_host(draft, truth)
        return StepResult(draft.num_draft_tokens.numpy().astype(np.int64), num_acc, None,
                          seconds)

    def observe(self, sids: list[str], output_ids: np.ndarray, num_output: np.ndarray,
                num_accepted: np.ndarray, path_nodes: torch.Tensor | None = None) -> None:
        for b, sid in enumerate(sids):
            self.drafter.accept(self._keys[sid], output_ids[b, :num_output[b]].tolist())

    def finish_message(self, sid: str) -> None:
        self.drafter.end(self._keys.pop(sid))

    def close_session(self, sid: str) -> None:
        del self._num_requests[sid]
        self.drafter.end_session(sid)

    def close_tenant(self, tenant: str) -> None:
        pass  # host baselines keep no per-tenant state (SuffixDecoding's cache is global)


# ----------------------------------------------------------------------------- agspec


class BatchedLane:
    """The batched ``agspec_gpu.drafter.Drafter`` with its ``CorpusStore``.

    One ``propose`` per step for every active session; ``draft_seconds`` is its wall time
    (synchronized on a GPU). Accepted tokens are attributed to tiers and forms from the
    draft's ``maybe_source``.
    """

    wants_files = True

    def __init__(self, name: str, drafter: Any, store: Any, device: torch.device | str = "cpu",
                 oracle_key: Hashable | None = None) -> None:
        self.name = name
        self.drafter = drafter
        self.store = store
        self.device = torch.device(device)
        self.oracle_key = oracle_key
        self._roles = {r.name for r in getattr(getattr(drafter, "config", None), "roles", ())}
        self._last_path: tuple[list[str], torch.Tensor] | None = None  # step() -> observe()
        # the step's tokens and counts reach the device through a pinned ring, as a serving
        # loop's host lists do (a pageable copy blocks the host until the GPU catches up)
        self._writer = HostWriter(1 << 16, self.device)

    def open_session(self, sid: str, tenant: str, role: str, prompt: np.ndarray) -> None:
        # The agent format is the role when the drafter has a profile for it (profiles are
        # built per agent format from replay curves); otherwise the default profile.
        self.drafter.open_session(sid, tenant, role if role in self._roles else "default",
                                  prompt.tolist())

    def extend(self, sid: str, tokens: np.ndarray) -> None:
        self.drafter.extend(sid, tokens.tolist())

    def add_file(self, tenant: str, path: str, text: str, first_line: int | None) -> None:
        if self.store is not None:
            try:  # (a file past the workspace's whole budget is left out, as serving does)
                self.store.add_workspace_file(tenant, path, text, first_line=first_line)
            except BudgetExceeded:
                pass

    def start_message(self, sid: str, tenant: str, context: np.ndarray) -> None:
        pass  # the drafter already holds the context (open_session + extend + observe)

    def step(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn,
             remaining: np.ndarray) -> StepResult:
        synchronize(self.device)
        t0 = time.perf_counter()
        draft = self.drafter.propose(sids)
        synchronize(self.device)
        seconds = time.perf_counter() - t0
        num_acc, sources, path = accept_on_host(draft, truth)
        self._last_path = (list(sids), path)  # observe() passes it on: no second search
        return StepResult(draft.num_draft_tokens.cpu().numpy().astype(np.int64), num_acc,
                          sources, seconds)

    def observe(self, sids: list[str], output_ids: np.ndarray, num_output: np.ndarray,
                num_accepted: np.ndarray, path_nodes: torch.Tensor | None = None) -> None:
        if path_nodes is None and self._last_path is not None and self._last_path[0] == sids:
            path_nodes = self._last_path[1]  # this step's acceptance, found by step()
        self._last_path = None
        out, nout, nacc = self._writer.write((output_ids.ravel(), torch.int32),
                                             (num_output, torch.int32),
                                             (num_accepted, torch.int32))
        # trajectory tokens, counts on the host: the serving loop's sync-free commit
        self.drafter.observe(sids, out.view(output_ids.shape), nout, nacc,
                             num_output_host=num_output.tolist(), validate=False,
                             path_nodes=path_nodes)

    def finish_message(self, sid: str) -> None:
        pass

    def close_session(self, sid: str) -> None:
        self.drafter.close_session(sid)

    def close_tenant(self, tenant: str) -> None:
        if self.store is not None and hasattr(self.store, "close_tenant"):
            self.store.close_tenant(tenant)


_NEW_MESSAGE = object()  # a session whose message has no plan yet
_FIRST_WINDOW, _MAX_WINDOW = 256, 1 << 14  # positions of a message's oracle windows


@dataclass
class _OraclePlan:
    """The oracle's answers for a window of a message's positions."""

    lengths: np.ndarray  # int64 [w]: prefix length at each position of the window
    pos: int  # the next step's position, relative to the window's start
    version: int  # the tenant version of the corpora it saw
    num_windows: int  # windows planned for this message so far


class OracleLane(BatchedLane):
    """The oracle: each step accepts the longest prefix (at most ``k`` tokens) of the true
    continuation that occurs in the session's searchable corpora, then the bonus token.

    It keeps the same corpora as the drafter it bounds (a ``Drafter`` over the same
    ``CorpusStore`` config) but never proposes: generated tokens reach the session corpus
    through ``extend``, at the end of the message (or before a new plan). Per-step prefix
    lengths are monotone in the position (a suffix of an occurrence is an occurrence, and
    corpora only grow), so this greedy choice is the fewest-steps schedule: its ``tau``
    bounds every drafter whose drafts come from the same corpora and are at most ``k`` deep.
    Not SuffixDecoding's: its response cache is shared by every session of the shard, any
    tenant's, and can hold text these corpora do not (on dev, 9 to 69 steps in ten
    thousand, as the shard's sessions share text).

    The answers come a window of positions at a time
    (:func:`agspec_gpu.oracle.message_prefix_lengths`), windows doubling along a message.
    When other text joins the tenant's corpora before the message ends (another session of
    the tenant reads a file or closes, with ``tenant_by="agent"``), the rest of the message,
    and every later message of the tenant, is looked up step by step
    (``CorpusStore.oracle_prefix_len``).
    """

    wants_files = True

    def __init__(self, name: str, drafter: Any, store: Any, k: int,
                 device: torch.device | str = "cpu") -> None:
        if k < 1:
            raise ValueError(f"oracle k must be >= 1, got {k}")
        super().__init__(name, drafter, store, device, oracle_key=None)
        self.k = k
        self._plans: dict[str, _OraclePlan | None] = {}  # None: step by step
        self._emitted: dict[str, list[int]] = {}  # per session: tokens not yet in its corpus
        self._shared_tenants: set[str] = set()  # their text changed during a message

    def start_message(self, sid: str, tenant: str, context: np.ndarray) -> None:
        self._plans.pop(sid, None)

    def step(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn,
             remaining: np.ndarray) -> StepResult:
        num_acc = np.minimum(np.minimum(self.prefix_lengths(sids, truth), self.k), remaining)
        return StepResult(np.zeros(len(sids), dtype=np.int64), num_acc, None, 0.0)

    def prefix_lengths(self, sids: list[str], truth: TruthFn) -> np.ndarray:
        """``int64 [B]``: the longest prefix of each row's true continuation (``truth``,
        ``PAD_ID`` past its message end) found in its corpora: a plan's answer, or a
        per-step lookup."""
        plan_rows, lookup = [], []
        for b, sid in enumerate(sids):
            plan = self._plans.get(sid, _NEW_MESSAGE)
            if plan is _NEW_MESSAGE and self.store.tenant_of(sid) in self._shared_tenants:
                plan = self._plans[sid] = None
            if plan is not _NEW_MESSAGE and (plan is None or
                                             plan.version != self.store.tenant_version(sid)):
                if plan is not None:  # other text joined: per step from now on
                    self._plans[sid] = None
                    self._shared_tenants.add(self.store.tenant_of(sid))
                lookup.append(b)
            elif plan is _NEW_MESSAGE or plan.pos >= plan.lengths.size:
                plan_rows.append(b)
        found = np.zeros(len(sids), dtype=np.int64)
        if plan_rows:
            self._plan(sids, plan_rows, truth)
        if lookup:
            for b in lookup:
                self.flush(sids[b])
            cont = torch.from_numpy(truth(self.k, PAD_ID)[lookup]).to(self.device)
            found[lookup] = self.store.oracle_prefix_len([sids[b] for b in lookup],
                                                         cont).cpu().numpy()
        for b, sid in enumerate(sids):
            if (plan := self._plans[sid]) is not None:
                found[b] = plan.lengths[plan.pos]
        return found

    def _plan(self, sids: list[str], rows: list[int], truth: TruthFn) -> None:
        """Answers for the next window of positions of each row: ``_FIRST_WINDOW`` tokens,
        doubling with each window of a message up to ``_MAX_WINDOW`` (few windows when
        nothing else joins the corpora, little work lost when something does). A window's
        answers need the ``k`` tokens after it; the message ends at the first ``PAD_ID``."""
        from agspec_gpu.oracle import message_prefix_lengths

        done = [0 if (p := self._plans.get(sids[b], _NEW_MESSAGE)) is _NEW_MESSAGE
                else p.num_windows for b in rows]
        windows = [min(_FIRST_WINDOW << j, _MAX_WINDOW) for j in done]
        rest = truth(max(windows) + self.k, PAD_ID)
        arena = self.store.arena
        for b, window, j in zip(rows, windows, done):
            sid = sids[b]
            self.flush(sid)  # the window's lead-in is the session corpus's end
            lead = arena.corpus_tokens(self.store.session(sid).corpus)[-self.k:]
            cids = [cid for _, cid in self.store.corpora_of(sid)]
            n = min(int(np.argmin(np.append(rest[b], PAD_ID) >= 0)), window + self.k)
            lengths = message_prefix_lengths(arena, cids, lead.clone(),
                                             torch.from_numpy(rest[b, :n]), self.k)
            self._plans[sid] = _OraclePlan(lengths[:window].cpu().numpy(), 0,
                                           self.store.tenant_version(sid), j + 1)

    def observe(self, sids: list[str], output_ids: np.ndarray, num_output: np.ndarray,
                num_accepted: np.ndarray, path_nodes: torch.Tensor | None = None) -> None:
        for b, sid in enumerate(sids):
            self._emitted.setdefault(sid, []).extend(output_ids[b, :num_output[b]].tolist())
            plan = self._plans.get(sid)
            if plan is not None:
                plan.pos += int(num_output[b])

    def flush(self, sid: str) -> None:
        """Appends the tokens emitted since the last flush to the session corpus (the plan
        already holds what they add; a new plan reads the corpus)."""
        tokens = self._emitted.pop(sid, None)
        if tokens:
            self.drafter.extend(sid, tokens)

    def finish_message(self, sid: str) -> None:
        self.flush(sid)
        self._plans.pop(sid, None)

    def close_session(self, sid: str) -> None:
        self.flush(sid)  # its text joins the tenant's history whole
        self._plans.pop(sid, None)
        super().close_session(sid)

    def close_tenant(self, tenant: str) -> None:
        self._shared_tenants.discard(tenant)
        super().close_tenant(tenant)


# ----------------------------------------------------------------------------- factories


def agspec_unavailable_reason() -> str | None:
    """Why the agspec drafters cannot run here, or None when they can."""
    try:
        import agspec_gpu.drafter  # noqa: F401
        import agspec_gpu.tiers  # noqa: F401
    except ImportError as exc:
        return f"agspec_gpu.drafter / agspec_gpu.tiers cannot be imported ({exc})"
    return None


def agspec_overrides(name: str) -> tuple[dict, dict]:
    """``(TierConfig overrides, DrafterConfig overrides)`` of an agspec variant."""
    if name not in AGSPEC_DRAFTERS:
        raise ValueError(f"not an agspec drafter: {name!r} (one of {AGSPEC_DRAFTERS})")
    if name == "agspec-no-emission":
        from agspec_gpu.forms import EmissionForm

        return {"forms": (EmissionForm.RAW,)}, {}
    if name == "agspec-no-workspace":
        return {"use_workspace": False}, {}
    if name == "agspec-p10":
        return {}, {"min_prob": 0.1}
    if name.startswith("agspec-static-k"):
        from agspec_gpu.controller import ControllerConfig

        k = int(name.removeprefix("agspec-static-k"))
        return {}, {"controller": ControllerConfig(static_k=k)}
    return {}, {}


@dataclass(frozen=True)
class LaneContext:
    """What every lane of one replay shares.

    Attributes:
        tokenizer: the replay's tokenizer (the store tokenizes workspace files with it).
        device: where agspec corpora and drafts live.
        batch_size: the agspec drafter's ``max_batch``.
        maybe_global: a loaded ``agspec_gpu.tiers.GlobalCorpus`` shared by every store, or
            None (no global tier).
        oracle_k: depth cap of the oracle.
        cost_model: the agspec drafter's batch budget reads it.
        warm_responses: earlier traffic's responses (token arrays, oldest first) that the
            ``suffix-decoding-warm`` lane's cache holds before the replay: under cross-halves
            the other half's assistant messages, the sessions agspec's global tier holds.
    """

    tokenizer: Tokenizer
    device: str = "cpu"
    batch_size: int = 64
    maybe_global: Any = None
    oracle_k: int = 32
    cost_model: CostModel = field(default_factory=CostModel.default)
    warm_responses: tuple = ()


def _configs(name: str) -> tuple[Any, Any]:
    from agspec_gpu.drafter_config import DrafterConfig
    from agspec_gpu.tiers import TierConfig

    tier_over, drafter_over = agspec_overrides(name)
    try:
        return TierConfig(**tier_over), DrafterConfig(**drafter_over)
    except TypeError as exc:
        raise ValueError(f"{name}: the agspec configs do not take {tier_over} / "
                         f"{drafter_over} ({exc})") from exc


def _agspec_parts(name: str, ctx: LaneContext, tier_config: Any = None) -> tuple[Any, Any, Any]:
    reason = agspec_unavailable_reason()
    if reason is not None:
        raise ImportError(f"{name}: {reason}")
    from agspec_gpu.drafter import Drafter
    from agspec_gpu.tiers import CorpusStore

    tiers, dconf = _configs(name)
    tiers = tier_config if tier_config is not None else tiers
    store = CorpusStore(ctx.tokenizer, tiers, device=ctx.device, global_corpus=ctx.maybe_global)
    return tiers, store, Drafter(store, dconf, max_batch=ctx.batch_size, cost=ctx.cost_model)


def oracle_key(name: str, ctx: LaneContext) -> Hashable | None:
    """The corpora configuration whose oracle bounds drafter ``name`` (None: no oracle here).

    Host baselines get the default agspec corpora's oracle (one value per agent format), so
    every row of a table is compared with the same bound.
    """
    if agspec_unavailable_reason() is not None:
        return None
    tiers, _ = _configs(name if name in AGSPEC_DRAFTERS else "agspec")
    return tiers  # a frozen dataclass: hashable, and equal iff the corpora are built alike


def make_lane(name: str, ctx: LaneContext) -> Lane:
    """The lane of drafter ``name`` (one of :data:`DRAFTER_NAMES`).

    Raises:
        ValueError: unknown name.
        ImportError: the drafter's implementation is missing (arctic-inference for
            ``suffix-decoding*``; ``agspec_gpu.drafter`` for ``agspec*``).
    """
    if name in HOST_DRAFTERS:
        return HostLane(make_host_drafter(name, ctx.warm_responses),
                        oracle_key=oracle_key(name, ctx))
    if name in AGSPEC_DRAFTERS:
        tiers, store, drafter = _agspec_parts(name, ctx)
        return BatchedLane(name, drafter, store, ctx.device, oracle_key=tiers)
    raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DRAFTER_NAMES)}")


def make_oracle_lane(name: str, key: Hashable, ctx: LaneContext) -> OracleLane:
    """The oracle over the corpora configuration ``key`` (a ``TierConfig``)."""
    _, store, drafter = _agspec_parts("agspec", ctx, tier_config=key)
    return OracleLane(name, drafter, store, ctx.oracle_k, ctx.device)


def check_drafter_names(names: Sequence[str]) -> None:
    """Raises ValueError naming the first unknown drafter."""
    for n in names:
        if n not in DRAFTER_NAMES:
            raise ValueError(f"unknown drafter {n!r}; known: {', '.join(DRAFTER_NAMES)}")
