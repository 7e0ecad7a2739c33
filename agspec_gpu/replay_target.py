"""Replay target: a real model's forward passes, a trajectory's tokens (end-to-end timing).

The end-to-end protocol of DESIGN.md "Evaluation". A transformer at realistic size runs every
forward pass for real -- the prefill of each request's context, one verification pass per
decode step over every request's root and draft nodes (tree attention over the real KV
lengths), the KV compaction of the accepted path -- while the token the target "predicts" at
each position is the trajectory's next token (teacher forcing). Time per step is the real
model's; acceptance is the trajectory's, so the weights may be random.

A request is one assistant message. Its context (the session's tokens before the message,
truncated to the last ``context_tokens``) is prefilled except its last token, which is the
first step's root; the message's tokens are the target output. Per step, for every active
request of the continuous batch:

1. propose: the drafter under test drafts a tree after the request's root;
2. verify: plan + forward of ``root + draft nodes``; the logits' argmax is computed (an
   engine pays for it) and replaced by the trajectory: a node is accepted iff its parent is
   and its token is the true token at its depth, plus the bonus token -- exactly greedy
   acceptance against a target whose argmax is the trajectory
   (:func:`agspec_gpu.accept.teacher_forced_accept`);
3. commit: the accepted nodes' KV moves behind the root (``kv_compact``), the drafter observes
   the emitted tokens, the last emitted token is the next root.

Steps whose drafts are all empty are plain decode steps; with a :class:`DecodeGraphs` they run
as a captured CUDA graph of the one-token step (FlashInfer's decode kernel), as a serving
engine runs them. The baseline ``none`` always takes that path; a speculative method takes it
whenever it has nothing to propose. The counting (steps, tokens, ``tau``) is the replay
evaluator's (:mod:`agspec_gpu.replay`), so both report the same acceptance.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np
import nvtx
import torch

from agspec_gpu.calibrate import SpanTimer
from agspec_gpu.checks import check_int_fields
from agspec_gpu.cost_model import BatchCostModels, CostModel, StepTokenCounts
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.host import HostReader, HostWriter, synchronize
from agspec_gpu.kernels.kv_compact import kv_compact
from agspec_gpu.replay import (ReplayCorpus, TokenizedSession, feed_until_message,
                               next_target_message)
from agspec_gpu.replay_lanes import BatchedLane, HostLane, OracleLane
from agspec_gpu.accept import NO_TOKEN, AcceptedPaths, teacher_forced_accept
from agspec_gpu.runners.graphs import DecodeGraphs
from agspec_gpu.runners.verify_graphs import VerifyGraphs
from agspec_gpu.tree import TreeMetadata


@contextmanager
def _phase(name: str, color: str):
    """An NVTX range (nsys) that is a ``torch.profiler`` range too: the e2e's ``--profile``
    trace shows the loop's phases (NVTX ranges do not reach it)."""
    with nvtx.annotate(name, color=color), torch.profiler.record_function(name):
        yield


@contextmanager
def _kv_freed_on_error(cache, held: Callable[[], Sequence]) -> Iterator[None]:
    """A run that raises frees the KV its requests still hold (``held()``: their sequence
    ids, read when it raises), so the runner's shared pool is as the run found it for the
    runs after (the e2e goes on past a failed profiling run)."""
    try:
        yield
    except BaseException:
        for seq_id in held():
            if cache.capacity(seq_id):
                cache.free(seq_id)
        raise


def protocol(context_tokens: int, dtype: str, prefill: str = "real") -> str:
    """The protocol statement every replay-target report carries."""
    ctx = (f"prefill of each request's context (truncated to the last {context_tokens} tokens)"
           if prefill == "real" else
           f"each request's context (the last {context_tokens} tokens) holds KV slots that "
           f"are allocated, not prefilled (decode time does not depend on cached values)")
    return (
        "replay target (teacher forcing): every forward pass is real -- " + ctx + ", one "
        "verification pass per decode step over the roots and every draft node with tree "
        "attention over the real KV lengths, KV compaction of the accepted path -- while the "
        "token the target predicts at each position is the trajectory's next token; a step "
        "emits the longest draft path matching the true continuation plus the bonus token. "
        f"Weights are random ({dtype}); acceptance is the trajectory's, time per step is the "
        "model's. Plain-decode steps (no draft in the batch) run as CUDA graphs where captured; "
        "steps with a draft too, padded to (requests, rows) buckets, unless --eager-verify. "
        "tokens_per_s = emitted tokens / wall time of the decode steps (prefill and the "
        "drafters' work between requests -- sessions opened and closed, context and files "
        "fed -- excluded, the same for every method; tokens_per_s_with_messages counts that "
        "work too); oracle: drafting time excluded (a bound).")


# ----------------------------------------------------------------------------- buffers


class MetadataPool:
    """Planner buffers for the largest step, handed out trimmed to each step's row count.

    ``PagedLlamaRunner.forward`` runs every linear layer over ``meta.capacity_q`` rows, so a
    step's capacity should be its real row count ``B + num_draft_tokens`` (rounded up to 8),
    not the static worst case ``B * (1 + max_nodes)``; the buffers are allocated once.
    """

    def __init__(self, max_batch: int, max_nodes: int, max_pages_per_seq: int, page_size: int,
                 device: torch.device | str) -> None:
        self.max_nodes = max_nodes
        # with the prefix pages' buffers: a split runner plans them (a few KB)
        self._buf = TreeMetadata.empty(max_batch, max_nodes + 1, max_pages_per_seq, page_size,
                                       device, with_prefix=True)
        self._rows: dict[int, TreeMetadata] = {}  # by capacity: plan_tree keeps its views

    def rows(self, num_rows: int) -> TreeMetadata:
        """Buffers whose query-row capacity is ``num_rows`` rounded up to a multiple of 8
        (the same object for the same capacity: the planner's views of it are made once)."""
        cap = self._buf.capacity_q
        if num_rows > cap:
            raise ValueError(f"a step of {num_rows} rows exceeds the pool's {cap}")
        q = min(cap, -(-num_rows // 8) * 8)
        out = self._rows.get(q)
        if out is None:
            b = self._buf
            out = self._rows[q] = replace(b, input_ids=b.input_ids[:q],
                                          position_ids=b.position_ids[:q],
                                          kv_slots=b.kv_slots[:q])
        return out


# ----------------------------------------------------------------------------- drafters

# truth(width, pad) -> int32 [B, width]: the true next tokens of every active request,
# ``pad`` past the end of its target.
TruthFn = Callable[[int, int], np.ndarray]


def host_drafts_to_batch(drafts: Sequence[tuple[list[int], list[int]]],
                         device: torch.device | str) -> DraftBatch:
    """``(tokens, parents)`` host lists, one per request, as a padded :class:`DraftBatch`."""
    return DraftBatch.from_host(list(drafts), device)


def _on_device(draft: DraftBatch, writer: HostWriter) -> DraftBatch:
    """``draft`` on ``writer``'s device: a host drafter's tree in one staged copy (views of
    the writer's ring: verified and committed before they are reused), a device one as is."""
    if draft.token_ids.device == writer.device:
        return draft
    B, N = draft.token_ids.shape
    tok, par, num = writer.write(*((t.numpy().ravel(), torch.int32) for t in (
        draft.token_ids, draft.parents, draft.num_draft_tokens)))
    return DraftBatch(tok.view(B, N), par.view(B, N), num)


class HostProposer(HostLane):
    """A host baseline (``none``, ``pld-hf``, ``suffix-decoding``, ...): its per-request
    drafts padded into one host :class:`DraftBatch` each step (the verifier moves it to the
    device only when it has a token: a plain decode step never copies it)."""

    counts_draft_time = True

    def propose(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn
                ) -> DraftBatch:
        return host_drafts_to_batch([self.drafter.propose(self._keys[s], c)
                                     for s, c in zip(sids, contexts)], "cpu")


class PlainDecoding(HostProposer):
    """The baseline ``none``: an engine's plain decode step asks no drafter, so its steps
    pay for none: one empty host draft per batch size, made once, and no commit (the
    message work between requests still counts, as an engine does it too)."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter)
        self._empty: dict[int, DraftBatch] = {}

    def propose(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn
                ) -> DraftBatch:
        B = len(sids)
        if B not in self._empty:
            self._empty[B] = DraftBatch.from_lists([[] for _ in sids], "cpu")
        return self._empty[B]

    def observe(self, sids: list[str], output_ids: np.ndarray, num_output: np.ndarray,
                num_accepted: np.ndarray, path_nodes: torch.Tensor | None = None) -> None:
        pass


class AgspecProposer(BatchedLane):
    """The batched agspec drafter: one ``propose`` for the whole batch."""

    counts_draft_time = True

    def propose(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn
                ) -> DraftBatch:
        return self.drafter.propose(sids, stable=False)  # verified, committed, then the next

    @property
    def max_output(self) -> int:
        """Columns of the true continuation :meth:`commit_queued` reads (the most tokens a
        step emits)."""
        return self.drafter.config.max_draft_depth + 1

    def commit_queued(self, sids: list[str], truth: torch.Tensor, paths: AcceptedPaths,
                      remaining: torch.Tensor) -> None:
        """The step's commit, queued behind its acceptance before the loop reads that back
        (``Drafter.observe(defer=True)``: the drafter's host time runs while the device
        verifies): ``truth int32 [B, >= max_output]`` the true continuations, ``remaining
        [B]`` the tokens each request has left, both on the device. The loop then passes
        the emitted counts it read to :meth:`settle`."""
        rem = remaining.to(paths.num_accepted.dtype)
        nacc = torch.minimum(paths.num_accepted, rem)
        nout = torch.minimum(nacc + 1, rem)
        cols = torch.arange(self.max_output, device=truth.device)
        out = torch.where(cols[None, :] < nout[:, None], truth[:, :self.max_output], -1)
        self.drafter.observe(sids, out, nout, nacc, validate=False,
                             path_nodes=paths.path_nodes, defer=True)

    def settle(self, num_output: np.ndarray) -> None:
        """The counts of the last :meth:`commit_queued`, as the loop emitted them."""
        self.drafter.settle(num_output.tolist())


class OracleProposer(OracleLane):
    """The ceiling: drafts the longest prefix (at most ``k``) of the true continuation that
    occurs in the request's corpora (:meth:`OracleLane.prefix_lengths`), as a chain. Its
    lookup reads the future, so its time is not charged to the steps."""

    counts_draft_time = False

    def propose(self, sids: list[str], contexts: list[np.ndarray], truth: TruthFn
                ) -> DraftBatch:
        cont = torch.from_numpy(truth(self.k, PAD_ID)).to(self.device)
        found = torch.from_numpy(np.minimum(self.prefix_lengths(sids, truth), self.k)
                                 ).to(self.device)
        cols = torch.arange(self.k, device=self.device, dtype=torch.int32)
        keep = cols[None, :] < found[:, None]
        return DraftBatch(torch.where(keep, cont, PAD_ID).to(torch.int32),
                          torch.where(keep, cols[None, :] - 1, PAD_ID).to(torch.int32),
                          found.to(torch.int32))


def make_proposer(name: str, tokenizer, device: torch.device | str, max_batch: int, *,
                  cost: CostModel | BatchCostModels | None = None, global_corpus=None,
                  oracle_k: int = 32, warm_responses: Sequence[np.ndarray] = ()):
    """The drafter ``name`` as the replay-target loop drives it.

    Names: the host baselines of :data:`agspec_gpu.baselines.HOST_DRAFTERS`, the agspec
    variants of :data:`agspec_gpu.replay_lanes.AGSPEC_DRAFTERS`, ``agspec-nobudget`` (agspec
    without the batch-level budget) and ``oracle``. ``cost`` feeds agspec's batch budget (a
    curve per batch size: each step steers by its bucket's, as the replay prices it).
    ``warm_responses``: what ``suffix-decoding-warm``'s cache holds (the traffic agspec's
    ``global_corpus`` was built from, as a server that answered it would).

    Raises:
        ValueError: unknown name; ``suffix-decoding-warm`` without ``warm_responses``.
        ImportError: ``suffix-decoding*`` without arctic-inference.
    """
    from agspec_gpu.baselines import HOST_DRAFTERS, make_host_drafter
    from agspec_gpu.drafter import Drafter, DrafterConfig
    from agspec_gpu.replay_lanes import AGSPEC_DRAFTERS, agspec_overrides
    from agspec_gpu.tiers import CorpusStore, TierConfig

    if name == "none":
        return PlainDecoding(make_host_drafter(name))
    if name in HOST_DRAFTERS:
        return HostProposer(make_host_drafter(name, warm_responses))
    base = "agspec" if name in ("oracle", "agspec-nobudget") else name
    if base not in AGSPEC_DRAFTERS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_NAMES)}")
    tier_over, drafter_over = agspec_overrides(base)
    if name == "agspec-nobudget":
        drafter_over = {**drafter_over, "batch_budget": False}
    store = CorpusStore(tokenizer, TierConfig(**tier_over), device=device,
                        global_corpus=global_corpus)
    drafter = Drafter(store, DrafterConfig(**drafter_over), max_batch=max_batch, cost=cost)
    if name == "oracle":
        return OracleProposer(name, drafter, store, oracle_k, device)
    return AgspecProposer(name, drafter, store, device)


def _method_names() -> tuple[str, ...]:
    from agspec_gpu.baselines import HOST_DRAFTERS
    from agspec_gpu.replay_lanes import AGSPEC_DRAFTERS

    return HOST_DRAFTERS + AGSPEC_DRAFTERS + ("agspec-nobudget", "oracle")


METHOD_NAMES = _method_names()


# ----------------------------------------------------------------------------- the loop

# step_hook(step, [(kv sequence id, int32 tokens held in its KV cache), ...])
StepHook = Callable[[int, list[tuple[str, np.ndarray]]], None]


@dataclass(frozen=True, slots=True)
class ReplayTargetConfig:
    """How a replay-target run is shaped.

    Attributes:
        batch_size: most requests in the continuous batch.
        context_tokens: each request's context is truncated to its last this many tokens.
        max_message_tokens: a target message is cut after this many tokens (None: whole);
            the rest of the message stays context for the session's later messages.
        messages_per_session: assistant messages replayed per session (None: all).
        prefill: ``"real"`` (run the context through the model) or ``"skip"`` (allocate its
            KV slots only: decode time does not depend on the cached values, since the target
            output is replayed).
        prefill_chunk: tokens per sequence per prefill forward.
        tenant_by: ``"session"`` (each session its own tenant) or ``"agent"``.
        max_steps: stop after this many decode steps (smoke runs).
        order: the order sessions enter the batch: ``"longest-first"`` (by the target
            tokens the run replays of each, :func:`replayed_tokens`; ties keep the corpus
            order) or ``"given"`` (the corpus order). A run replays a fixed set of sessions
            at most ``batch_size`` at a time, and the batch drains once the queue is empty;
            admitting the longest first leaves short requests for the drain, so the batch
            stays nearer ``batch_size`` (the run's ``request_steps / steps``) -- the
            longest-processing-time rule of scheduling. Every method of a benchmark runs
            the same sessions in the same order.
    """

    batch_size: int
    context_tokens: int = 4096
    max_message_tokens: int | None = 1024
    messages_per_session: int | None = None
    prefill: str = "real"
    prefill_chunk: int = 512
    tenant_by: str = "session"
    max_steps: int | None = None
    order: str = "longest-first"

    def __post_init__(self) -> None:
        check_int_fields(self, ("batch_size", "context_tokens", "max_message_tokens",
                                "messages_per_session", "prefill_chunk", "max_steps"),
                         optional=("max_message_tokens", "messages_per_session", "max_steps"))
        if self.batch_size < 1 or self.context_tokens < 1 or self.prefill_chunk < 1:
            raise ValueError("batch_size, context_tokens and prefill_chunk must be >= 1")
        for name in ("max_message_tokens", "messages_per_session", "max_steps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")
        if self.prefill not in ("real", "skip"):
            raise ValueError(f"prefill must be 'real' or 'skip', got {self.prefill!r}")
        if self.tenant_by not in ("session", "agent"):
            raise ValueError(f"tenant_by must be 'session' or 'agent', got {self.tenant_by!r}")
        if self.order not in ("longest-first", "given"):
            raise ValueError(f"order must be 'longest-first' or 'given', got {self.order!r}")


def replayed_tokens(s: TokenizedSession, config: ReplayTargetConfig) -> int:
    """The target tokens a run with ``config`` replays of session ``s``: its requests'
    messages (the first ``messages_per_session`` assistant messages with tokens and
    context before them), each cut at ``max_message_tokens`` -- what :func:`_start_next`
    starts, message by message."""
    total, i, n = 0, -1, 0
    cap = config.max_message_tokens
    while config.messages_per_session is None or n < config.messages_per_session:
        i = next_target_message(s, i, min_start=1)
        if i is None:
            break
        size = int(s.bounds[i + 1]) - int(s.bounds[i])
        total += size if cap is None else min(size, cap)
        n += 1
    return total


@dataclass
class ReplayTargetResult:
    """Counters and times of one (method, batch size) run; times in seconds."""

    method: str
    batch_size: int
    sessions: int = 0
    messages: int = 0
    steps: int = 0  # batched decode steps
    plain_steps: int = 0  # of which had no draft in the batch (the plain decode step)
    request_steps: int = 0  # sum over steps of the requests in the batch
    tokens: int = 0  # emitted target tokens
    drafted: int = 0
    accepted: int = 0
    decode_s: float = 0.0  # wall time of the decode steps (oracle: less its lookup)
    # the steps with a full batch (batch_size requests), their tokens and wall time: the
    # throughput while the queue holds work, without the run's drain (whose last requests
    # step with a part-empty batch at nearly a full step's cost)
    full_steps: int = 0
    full_tokens: int = 0
    full_decode_s: float = 0.0
    full_step_tokens: StepTokenCounts = field(default_factory=StepTokenCounts)  # (priced)
    draft_s: float = 0.0
    verify_s: float = 0.0  # plan + forward + argmax + acceptance (CUDA events on a GPU)
    commit_s: float = 0.0
    # the drafter's commit (observe): host time, inside commit_s (its kernels' GPU time,
    # overlapped with the host, lands in the step's final synchronize)
    observe_s: float = 0.0
    # the drafter's host time queued before the loop waits for its step's acceptance (the
    # commit, AgspecProposer.commit_queued, and the next step's propose ahead when no
    # request can end in this one): it runs while the device verifies; observe_s then
    # holds the settle after the wait only. Of it, exposed: the steps' whose read of the
    # acceptance then waited under _HIDDEN_WAIT_S (the device was done, or nearly: their
    # queued time is counted whole, a bound; on a CPU every step's)
    drafter_queued_s: float = 0.0
    drafter_queued_exposed_s: float = 0.0
    # of drafter_queued_s, the next step's propose ahead: drafting work done in the commit
    # phase, so a draft column that reads draft_s alone would leave it out
    propose_ahead_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    # the drafter's work at message boundaries (a session opened or closed, the context and
    # files between two requests fed, a request started or finished) and the KV frees:
    # outside the steps, so outside decode_s (a GPU lane's work synchronized before it stops)
    message_s: float = 0.0
    # its host seconds by part ("open": sessions opened; "feed": the context and files
    # between two requests, requests started and finished; "close": sessions and tenants
    # closed; "kv_free": the finished requests' KV freed); message_s less their sum is the
    # wait for the device at its end
    message_parts: dict[str, float] = field(default_factory=dict)
    counts_draft_time: bool = True
    # steps by the tokens their forward verified (rows + drafts): the cost model's price of
    # the run, step by step, as the replay evaluator prices its lanes
    step_tokens: StepTokenCounts = field(default_factory=StepTokenCounts)

    @property
    def tau(self) -> float:
        """Tokens per request per step (accepted + bonus): the replay evaluator's ``tau``."""
        return self.tokens / self.request_steps if self.request_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0

    @property
    def tokens_per_s_with_messages(self) -> float:
        """Emitted tokens over the decode steps' wall time plus the work between requests
        (``message_s``; not for a lane whose drafting time is excluded: the oracle's)."""
        s = self.decode_s + (self.message_s if self.counts_draft_time else 0.0)
        return self.tokens / s if s else 0.0

    @property
    def full_batch_tokens_per_s(self) -> float:
        return self.full_tokens / self.full_decode_s if self.full_decode_s else 0.0

    def per_step_ms(self, seconds: float) -> float:
        return 1e3 * seconds / self.steps if self.steps else 0.0

    @contextmanager
    def message_part(self, part: str) -> Iterator[None]:
        """Adds the host time of the block to ``message_parts[part]`` (and marks it
        ``e2e.message.<part>`` for nsys and the profile trace)."""
        t0 = time.perf_counter()
        try:
            with _phase(f"e2e.message.{part}", color="white"):
                yield
        finally:
            self.message_parts[part] = self.message_parts.get(part, 0.0) + \
                time.perf_counter() - t0


@dataclass
class _Request:
    """A session in the batch and its current request (assistant message)."""

    s: TokenizedSession
    tenant: str
    msg: int = -1  # current assistant message
    pos: int = 0  # next target token (session relative)
    end: int = 0  # end of the (possibly cut) target
    msg_end: int = 0  # end of the whole message
    done_messages: int = 0
    kv_id: str = ""
    kv_start: int = 0  # the KV cache holds tokens[kv_start : kv_start + prefix_len]
    prefix_len: int = 0  # tokens in the KV cache
    root: int = 0  # last committed token, not in the KV cache yet


# a read of a step's acceptance that returns sooner found the device done (a small copy
# and its wait take ~20-50 us on a GPU's host when nothing is left to wait for)
_HIDDEN_WAIT_S = 2e-4


def _start_next(req: _Request, proposer, config: ReplayTargetConfig, prompt_end: int
                ) -> list[int] | None:
    """Feeds the messages after ``req.msg`` up to the next assistant message with tokens and
    starts it as a request; returns its context (None: the session has no more requests)."""
    s = req.s
    if config.messages_per_session is not None and \
            req.done_messages >= config.messages_per_session:
        return None
    # lo > 0: a request needs at least one context token to be its first root
    i = feed_until_message(s, req.msg, proposer, req.tenant, prompt_end, min_start=1)
    if i is None:
        return None
    lo, hi = int(s.bounds[i]), int(s.bounds[i + 1])
    cap = config.max_message_tokens
    cut = hi if cap is None else min(hi, lo + cap)
    req.msg, req.pos, req.end, req.msg_end = i, lo, cut, hi
    req.kv_id = f"{s.sid}#{i}"
    proposer.start_message(s.sid, req.tenant, s.tokens[:lo])
    req.kv_start = max(0, lo - config.context_tokens)
    ctx = s.tokens[req.kv_start:lo].tolist()
    req.root, req.prefix_len = ctx[-1], len(ctx) - 1
    return ctx[:-1]


def run_replay_target(runner, corpus: ReplayCorpus, proposer, config: ReplayTargetConfig, *,
                      pool: MetadataPool, graphs: DecodeGraphs | None = None,
                      verify_graphs: VerifyGraphs | None = None,
                      step_hook: StepHook | None = None) -> ReplayTargetResult:
    """Replays ``corpus`` through ``proposer`` on ``runner`` as one continuous batch.

    Parameters
    ----------
    runner : PagedLlamaRunner (its KV cache must hold ``batch_size`` requests).
    corpus : from :func:`agspec_gpu.replay.tokenize_sessions` (with captures for agspec).
    proposer : from :func:`make_proposer`.
    config : :class:`ReplayTargetConfig`.
    pool : planner buffers for the largest step (its ``max_nodes`` bounds every draft).
    graphs : plain-decode steps (no draft in the batch) run through it when given.
    verify_graphs : steps with a draft run through it when given (CUDA graphs of padded
        verification steps on a GPU); otherwise eagerly over ``pool``'s buffers.
    step_hook : called before each step with the step index and, per active request, its
        KV sequence id and the tokens its KV cache holds (profiling, tests).

    Returns
    -------
    :class:`ReplayTargetResult`. Every request's KV is freed again before it returns (or
    raises).
    """
    dev = runner.device
    B = config.batch_size
    res = ReplayTargetResult(proposer.name, B, counts_draft_time=proposer.counts_draft_time)
    todo = [s for s in corpus.sessions if s.target_messages]
    if config.order == "longest-first":  # (a stable sort: ties keep the corpus order)
        todo.sort(key=lambda s: -replayed_tokens(s, config))
    tenant_of = (lambda s: s.sid) if config.tenant_by == "session" else (lambda s: s.agent)
    sessions_left: dict[str, int] = {}
    for s in todo:
        sessions_left[tenant_of(s)] = sessions_left.get(tenant_of(s), 0) + 1
    queue = iter(todo)
    active: list[_Request] = []
    stream = corpus.stream
    verify_timer = SpanTimer(dev)
    reader = HostReader(B, dev)  # the draft sizes, then the accepted counts: one wait each
    # a step's host lists (roots, prefix lengths, a CPU drafter's trees, the trajectory's
    # tokens) through one pinned ring, as an engine stages its inputs
    writer = HostWriter(1 << 20, dev)
    cache = runner.kv_cache

    def close(req: _Request) -> None:
        proposer.close_session(req.s.sid)
        sessions_left[req.tenant] -= 1
        if sessions_left[req.tenant] == 0:
            proposer.close_tenant(req.tenant)

    def prefill(new: list[tuple[_Request, list[int]]]) -> None:
        real = [(r, ctx) for r, ctx in new if ctx]
        if not real:
            return
        with _phase("e2e.prefill", color="blue"):
            synchronize(dev)
            t0 = time.perf_counter()
            if config.prefill == "real":
                runner.prefill([r.kv_id for r, _ in real], [c for _, c in real],
                               chunk_size=config.prefill_chunk)
            else:
                cache.allocate_many([r.kv_id for r, _ in real], [len(c) for _, c in real])
            synchronize(dev)
            res.prefill_s += time.perf_counter() - t0
            res.prefill_tokens += sum(len(c) for _, c in real)

    def message_work_done(t0: float) -> None:
        """Counts the message-boundary work since ``t0`` (its device work included)."""
        synchronize(dev)
        res.message_s += time.perf_counter() - t0

    with torch.inference_mode(), _kv_freed_on_error(cache, lambda: [r.kv_id for r in active]):
        while config.max_steps is None or res.steps < config.max_steps:
            new: list[tuple[_Request, list[int]]] = []
            t_msg, opened = time.perf_counter(), res.sessions
            while len(active) < B:
                s = next(queue, None)
                if s is None:
                    break
                req = _Request(s, tenant_of(s))
                prompt_end = int(s.bounds[s.target_messages[0]])
                with res.message_part("open"):
                    proposer.open_session(s.sid, req.tenant, s.agent, s.tokens[:prompt_end])
                res.sessions += 1
                with res.message_part("feed"):
                    ctx = _start_next(req, proposer, config, prompt_end)
                if ctx is None:  # no target message with context before it
                    with res.message_part("close"):
                        close(req)
                    continue
                res.messages += 1
                new.append((req, ctx))
                active.append(req)
            if res.sessions > opened:
                message_work_done(t_msg)
            prefill(new)
            if not active:
                break
            if step_hook is not None:
                step_hook(res.steps, [(r.kv_id, r.s.tokens[r.kv_start:r.kv_start + r.prefix_len])
                                      for r in active])
            n_active = len(active)
            sids = [r.s.sid for r in active]
            kv_ids = [r.kv_id for r in active]
            start = np.array([r.s.offset + r.pos for r in active], dtype=np.int64)
            remaining = np.array([r.end - r.pos for r in active], dtype=np.int64)

            def truth(width: int, pad: int) -> np.ndarray:
                cols = np.arange(width, dtype=np.int64)
                idx = start[:, None] + np.minimum(cols[None, :],
                                                  np.maximum(remaining[:, None] - 1, 0))
                return np.where(cols[None, :] < remaining[:, None], stream[idx],
                                pad).astype(np.int32)

            t0 = time.perf_counter()
            with _phase("e2e.propose", color="green"):
                draft = proposer.propose(sids, [r.s.tokens[:r.pos] for r in active], truth)
                num_draft = np.array(reader.read(draft.num_draft_tokens)[0], dtype=np.int64)
            t1 = time.perf_counter()
            n_total = int(num_draft.sum())
            if n_total and draft.max_nodes > pool.max_nodes:
                raise ValueError(f"{proposer.name}: a draft of {draft.max_nodes} nodes exceeds "
                                 f"the planner's max_nodes={pool.max_nodes}")
            prefix_host = [r.prefix_len for r in active]
            with _phase("e2e.verify", color="yellow"):
                verify_timer.start()
                roots, prefix_t = writer.write(([r.root for r in active], torch.int32),
                                               (prefix_host, torch.int32))
                if n_total == 0 and graphs is not None:
                    logits = graphs.decode(kv_ids, roots, prefix_host)
                else:
                    draft = _on_device(draft, writer)
                    if verify_graphs is not None:
                        meta, logits = verify_graphs.verify(kv_ids, draft, roots, prefix_host,
                                                            num_draft)
                    else:
                        meta = runner.plan(kv_ids, draft, roots, prefix_t,
                                           prefix_lens_host=prefix_host, num_draft_host=num_draft,
                                           out=pool.rows(n_active + n_total))
                        logits = runner.forward(meta)
                # the target's own greedy choice, paid for as an engine would, then replaced
                # by the trajectory's tokens (the replay target)
                logits.argmax(dim=-1)
                paths = None
                queued = n_total and isinstance(proposer, AgspecProposer)
                if n_total:  # (wide enough for a queued commit's emitted tokens too)
                    W = max(draft.max_nodes, proposer.max_output if queued else 0)
                    true_np = truth(W, NO_TOKEN)
                    true_t, rem_t = writer.write((true_np.ravel(), torch.int32),
                                                 (remaining, torch.int32))
                    true_t = true_t.view(true_np.shape)
                    paths = teacher_forced_accept(draft, true_t)
                verify_timer.stop()
            with _phase("e2e.commit", color="red"):
                num_acc = np.zeros(n_active, dtype=np.int64)
                if paths is not None:  # the read queued first: it waits for no commit
                    reader.start(paths.num_accepted)
                if queued:  # before the host waits for the step: its host time overlaps
                    t_obs = time.perf_counter()
                    with _phase("e2e.drafter_queued", color="orange"):
                        proposer.commit_queued(sids, true_t, paths, rem_t)
                        # the next step's draft too, when no request can end in this one
                        # (it emits at most its draft's nodes and the bonus)
                        if bool((remaining > num_draft + 1).all()):
                            t_ahead = time.perf_counter()
                            proposer.drafter.propose_ahead(sids)
                            res.propose_ahead_s += time.perf_counter() - t_ahead
                    queued_s = time.perf_counter() - t_obs
                    res.drafter_queued_s += queued_s
                if paths is not None:
                    t_read = time.perf_counter()
                    num_acc = np.array(reader.wait()[0], dtype=np.int64)
                    if queued and time.perf_counter() - t_read < _HIDDEN_WAIT_S:
                        # the device had finished: (part of) the queued commit's host
                        # time ran past the step's device work; counted as exposed
                        res.drafter_queued_exposed_s += queued_s
                    A = int(num_acc.max())
                    if A:
                        kv_compact(cache.data, meta.kv_indptr, meta.kv_indices, prefix_t,
                                   paths.path_nodes[:, :A].to(torch.int32).contiguous())
                accepted = np.minimum(num_acc, remaining)
                produced = np.minimum(accepted + 1, remaining)
                out_ids = truth(int(produced.max()), -1)
                out_ids[np.arange(out_ids.shape[1])[None, :] >= produced[:, None]] = -1
                t_obs = time.perf_counter()
                with _phase("e2e.drafter_commit", color="orange"):
                    if queued:
                        proposer.settle(produced)
                    else:
                        proposer.observe(sids, out_ids, produced, accepted,
                                         path_nodes=None if paths is None else paths.path_nodes)
                observe_s = time.perf_counter() - t_obs
                for b, r in enumerate(active):
                    p = int(produced[b])
                    r.pos += p
                    r.prefix_len += p
                    r.root = int(out_ids[b, p - 1])
                synchronize(dev)
            t2 = time.perf_counter()
            res.steps += 1
            res.plain_steps += n_total == 0
            res.request_steps += n_active
            res.step_tokens.add(n_active + n_total, n_active)
            res.tokens += int(produced.sum())
            res.drafted += n_total
            res.accepted += int(accepted.sum())
            res.draft_s += t1 - t0
            res.observe_s += observe_s
            res.verify_s += verify_timer.seconds()
            step_s = (t2 - t0) if proposer.counts_draft_time else (t2 - t1)
            res.decode_s += step_s
            if n_active == B:  # a full batch: the steady state of a loaded server
                res.full_steps += 1
                res.full_tokens += int(produced.sum())
                res.full_decode_s += step_s
                res.full_step_tokens.add(n_active + n_total, n_active)
            res.commit_s += t2 - t1 - verify_timer.seconds()

            still: list[_Request] = []
            new = []
            t_msg = time.perf_counter()
            for r in active:
                if r.pos < r.end:
                    still.append(r)
                    continue
                s = r.s
                with res.message_part("kv_free"):
                    cache.free(r.kv_id)
                r.done_messages += 1
                with res.message_part("feed"):
                    proposer.finish_message(s.sid)
                    if r.end < r.msg_end:  # the cut-off rest of the message is context
                        proposer.extend(s.sid, s.tokens[r.end:r.msg_end])
                    if s.maybe_files is not None and proposer.wants_files:
                        for path, text, first_line in s.maybe_files[r.msg]:
                            proposer.add_file(r.tenant, path, text, first_line)
                    ctx = _start_next(r, proposer, config,
                                      int(s.bounds[s.target_messages[0]]))
                if ctx is None:
                    with res.message_part("close"):
                        close(r)
                else:
                    res.messages += 1
                    new.append((r, ctx))
                    still.append(r)
            if len(still) < len(active) or new:  # a request ended
                message_work_done(t_msg)
            active = still
            prefill(new)
        for r in active:  # stopped by max_steps
            proposer.finish_message(r.s.sid)
            if cache.capacity(r.kv_id):  # a request that has not run a step may hold no KV
                cache.free(r.kv_id)
            close(r)
    return res


# ----------------------------------------------------------------------------- cost model
