"""Teacher-forced replay of agent sessions through drafters: the acceptance evaluator.

Protocol (DESIGN.md "Evaluation"). Every message is tokenized as whole text with the real
tokenizer; a session's token stream is its messages' tokens in order. Before each assistant
message the drafter has seen everything before it; the message's tokens are the target's
greedy output. Each step the drafter proposes a tree; the accepted count is the longest
root-to-node path spelling the true next tokens, plus one bonus token (the true next token),
capped by the tokens left in the message; then the drafter observes what was emitted.

Sessions run as ONE continuous batch of at most ``batch_size`` sessions, new ones joining as
others finish, exactly as a server would run them: the batched agspec drafter gets one
``propose`` per step for the whole batch; host baselines are called per request inside the
same loop. Files the agent reads (tool outputs) and writes (its own messages) are captured
with :mod:`agspec_gpu.capture` and added to the tenant's workspace tier.

Example::

    sessions = load_paths("dev/swe_agent__claude-sonnet-4.jsonl.gz", limit=10)
    corpus = tokenize_sessions(sessions, load_tokenizer("cl100k"))
    report = run_replay(corpus, ["none", "pld-hf", "agspec"])
    print(report.rows[-1]["tau"])
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Hashable, Protocol, Sequence

import numpy as np

from agspec_gpu.checks import check_bool_fields, check_instance_field, check_int_fields
from agspec_gpu.cost_model import CostModel
from agspec_gpu.host import synchronize
from agspec_gpu.replay_lanes import (
    Lane,
    LaneContext,
    check_drafter_names,
    make_lane,
    make_oracle_lane,
)
from agspec_gpu.replay_stats import P_ACC_MAX_K, ReplayStats, add_replay_speedups
from agspec_gpu.tokenizer import Tokenizer
from agspec_gpu.trajectories import Session

__all__ = ["ReplayConfig", "TokenizedSession", "ReplayCorpus", "ReplayReport", "ReplayProgress",
           "tokenize_sessions", "run_replay", "replay_lane"]

TENANT_MODES = ("session", "agent")


# batch_size is the agspec drafter's max_batch: its state slots, per-step buffers and cost
# table (max_batch * (1 + max_nodes) entries, built on the host) are sized by it, and on a GPU
# it captures graphs for buckets up to it. 4096 builds in about a second on a CPU and is far
# above one GPU's verification batch; 10**9 would try to allocate 128 GB.
MAX_BATCH_SIZE = 4096
# the oracle searches corpora indexed to TierConfig's max_depth (32): no longer prefix can be
# found, so a larger k was capped silently while the report recorded it
MAX_ORACLE_K = 32


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """How a replay runs.

    Attributes:
        batch_size: most sessions in the continuous batch (the drafter's ``max_batch``).
        tenant_by: ``"session"`` (each session is its own tenant, so the history tier holds
            nothing) or ``"agent"`` (all sessions of one agent format share a tenant: its
            workspace and its history of earlier sessions). With ``"agent"`` each lane's
            tenant holds what that lane's own continuous batch has closed and read so far,
            which depends on the lane's speed: lanes may start a message with different
            tenant text, and the oracle (its own lane) is no per-step bound on the others.
        oracle: compute the oracle bound (needs ``agspec_gpu.tiers``; else reported null).
        oracle_k: the oracle accepts at most this many draft tokens per step.
        device: where agspec corpora and drafts live (``"cpu"`` or ``"cuda"``).
        global_corpus: a global corpus file from ``agspec-gpu build-global``; never built
            from the replayed sessions themselves.
        cost_model: verification cost model for the modelled speedup.
        workers: processes (one torch thread each). Above 1 the sessions are split into
            ``workers`` shards of about equal target tokens, each replayed as its own
            continuous batch of ``batch_size`` (as ``workers`` servers would run them), and
            the counters are summed. Only named drafters can run in workers.
    """

    batch_size: int = 64
    tenant_by: str = "session"
    oracle: bool = True
    oracle_k: int = 32
    device: str = "cpu"
    global_corpus: str | None = None
    cost_model: CostModel = field(default_factory=CostModel.default)
    workers: int = 1

    def __post_init__(self) -> None:
        check_int_fields(self, ("batch_size", "oracle_k", "workers"))
        check_bool_fields(self, ("oracle",))
        check_instance_field(self, "cost_model", CostModel)
        if not isinstance(self.device, str):
            raise ValueError(f"device: expected a str, got {self.device!r}")
        if not (self.global_corpus is None or isinstance(self.global_corpus, (str, os.PathLike))):
            raise ValueError(f"global_corpus: expected a path or None, got "
                             f"{self.global_corpus!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be in [1, {MAX_BATCH_SIZE}], got "
                             f"{self.batch_size}")
        if self.tenant_by not in TENANT_MODES:
            raise ValueError(f"tenant_by must be one of {TENANT_MODES}, got {self.tenant_by!r}")
        if not 1 <= self.oracle_k <= MAX_ORACLE_K:
            raise ValueError(f"oracle_k must be in [1, {MAX_ORACLE_K}] (the depth its corpora "
                             f"are indexed to), got {self.oracle_k}")


@dataclass(frozen=True)
class TokenizedSession:
    """One session as token ids.

    Attributes:
        sid: unique id within the corpus (the session id, ``#n``-suffixed if repeated).
        agent: agent format.
        roles: role of each message.
        bounds: ``int64 [M + 1]``: message ``i`` is ``tokens[bounds[i]:bounds[i + 1]]``.
        tokens: ``int32 [T]`` the session's token stream (a view into the corpus stream).
        offset: where ``tokens`` starts in :attr:`ReplayCorpus.stream`.
        maybe_files: per message, the files captured from it as ``(path, text, first_line)``;
            None when captures were not computed.
        session_id: the session's own id (``sid`` without the repeat suffix).
        task_id: the session's task (:attr:`agspec_gpu.trajectories.Session.task_id`; ``""``:
            its own id).
    """

    sid: str
    agent: str
    roles: tuple[str, ...]
    bounds: np.ndarray
    tokens: np.ndarray
    offset: int
    maybe_files: tuple[tuple[tuple[str, str, int | None], ...], ...] | None = None
    session_id: str = ""
    task_id: str = ""

    @property
    def task(self) -> str:
        """The task the session works on: what the cross-halves split is keyed by."""
        return self.task_id or self.session_id or self.sid

    @property
    def target_messages(self) -> list[int]:
        """Indices of the assistant messages with at least one token."""
        return [i for i, r in enumerate(self.roles)
                if r == "assistant" and self.bounds[i + 1] > self.bounds[i]]

    @property
    def target_tokens(self) -> int:
        """Tokens of its assistant messages (what the replay produces)."""
        return sum(int(self.bounds[i + 1] - self.bounds[i]) for i in self.target_messages)


@dataclass(frozen=True)
class ReplayCorpus:
    """Tokenized sessions sharing one token stream (so per-step gathers are one index op).

    ``agent_formats``: the agent formats reported, sorted; empty means those of ``sessions``
    (a shard keeps its whole corpus's, so shard counters line up).
    """

    sessions: tuple[TokenizedSession, ...]
    stream: np.ndarray
    tokenizer_name: str
    tokenizer_fingerprint: str
    agent_formats: tuple[str, ...] = ()

    @property
    def agents(self) -> tuple[str, ...]:
        return self.agent_formats or tuple(sorted({s.agent for s in self.sessions}))


def _captures(session: Session) -> tuple[tuple[tuple[str, str, int | None], ...], ...]:
    """Per message, the files to add to the workspace after it: what a tool output showed
    (parsed with the command of the latest assistant message) or what the agent wrote."""
    from agspec_gpu.capture import capture_agent_writes, capture_tool_output

    out, last_assistant = [], None
    for i, m in enumerate(session.messages):
        if m.role == "tool":
            files = capture_tool_output(last_assistant, m.content)
        elif m.role == "assistant":
            files, last_assistant = capture_agent_writes(m.content), m.content
        else:
            files = []
        # A file of unknown path still helps as text; it gets a name that no later file
        # version can collide with.
        out.append(tuple((f.path or f"<unnamed:{session.id}:{i}:{j}>", f.text, f.first_line)
                         for j, f in enumerate(files)))
    return tuple(out)


def tokenize_sessions(sessions: Sequence[Session], tokenizer: Tokenizer, *,
                      capture_files: bool = True) -> ReplayCorpus:
    """Tokenizes every message of every session as whole text (one batched call).

    Parameters
    ----------
    sessions : the sessions, in replay order.
    tokenizer : the real tokenizer; its fingerprint goes into the report.
    capture_files : also compute the workspace captures of every message (needed by the
        agspec drafters; the host baselines ignore them).
    """
    texts = [m.content for s in sessions for m in s.messages]
    ids = tokenizer.encode_batch(texts) if texts else []
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    stream = np.concatenate([np.asarray(x, dtype=np.int32) for x in ids] or
                            [np.zeros(0, dtype=np.int32)])
    msg_start = np.concatenate([[0], np.cumsum(lengths)])
    out, seen, k = [], {}, 0
    for s in sessions:
        M = len(s.messages)
        bounds = msg_start[k:k + M + 1] - msg_start[k]
        base = int(msg_start[k])
        n = seen.get(s.id, 0)
        seen[s.id] = n + 1
        out.append(TokenizedSession(
            sid=s.id if n == 0 else f"{s.id}#{n}", agent=s.agent,
            roles=tuple(m.role for m in s.messages), bounds=bounds,
            tokens=stream[base:base + int(bounds[-1])], offset=base,
            maybe_files=_captures(s) if capture_files else None, session_id=s.id,
            task_id=s.task_id))
        k += M
    return ReplayCorpus(tuple(out), stream, tokenizer.name, tokenizer.fingerprint)


class ReplayProgress(Protocol):
    """Progress hook: ``start`` once per pass, ``advance`` per finished assistant message."""

    def start(self, name: str, total_tokens: int) -> None: ...

    def advance(self, tokens: int) -> None: ...

    def stop(self) -> None: ...


@dataclass
class _Slot:
    s: TokenizedSession
    agent: int
    tenant: str
    msg: int = -1  # current assistant message, -1 before the first
    pos: int = 0  # next token to produce (session relative)
    end: int = 0  # end of the current message


def next_target_message(s: TokenizedSession, after: int, min_start: int = 0) -> int | None:
    """The index of the first assistant message with tokens after index ``after`` that
    starts at or after token ``min_start`` (None: there is none)."""
    for i in range(after + 1, len(s.roles)):
        lo, hi = int(s.bounds[i]), int(s.bounds[i + 1])
        if s.roles[i] == "assistant" and hi > lo and lo >= min_start:
            return i
    return None


def feed_until_message(s: TokenizedSession, after: int, lane: Lane, tenant: str,
                       prompt_end: int, min_start: int = 0) -> int | None:
    """Feeds a session's messages after index ``after`` to ``lane`` (context the model did
    not generate, files captured from them) up to :func:`next_target_message`; returns its
    index, None when there is none."""
    files = s.maybe_files
    target = next_target_message(s, after, min_start)
    for i in range(after + 1, len(s.roles) if target is None else target):
        lo, hi = int(s.bounds[i]), int(s.bounds[i + 1])
        if hi > lo and lo >= prompt_end:  # the prompt went in with open_session
            lane.extend(s.sid, s.tokens[lo:hi])
        if files is not None and lane.wants_files:
            for path, text, first_line in files[i]:
                lane.add_file(tenant, path, text, first_line)
    return target


def _advance(slot: _Slot, lane: Lane, prompt_end: int) -> bool:
    """Feeds the messages after ``slot.msg`` up to the next assistant message with tokens
    and starts it; False when the session has no more (the caller closes it)."""
    s = slot.s
    i = feed_until_message(s, slot.msg, lane, slot.tenant, prompt_end)
    if i is None:
        return False
    lo, hi = int(s.bounds[i]), int(s.bounds[i + 1])
    slot.msg, slot.pos, slot.end = i, lo, hi
    lane.start_message(s.sid, slot.tenant, s.tokens[:lo])
    return True


def replay_lane(corpus: ReplayCorpus, lane: Lane, config: ReplayConfig,
                progress: ReplayProgress | None = None) -> ReplayStats:
    """Replays every session of ``corpus`` through ``lane`` as one continuous batch.

    Returns the per-agent counters; the caller turns them into rows.
    """
    agents = corpus.agents
    agent_index = {a: i for i, a in enumerate(agents)}
    stats = ReplayStats(agents)
    todo = [s for s in corpus.sessions if s.target_messages]
    tenant_of = (lambda s: s.sid) if config.tenant_by == "session" else (lambda s: s.agent)
    sessions_left = Counter(tenant_of(s) for s in todo)  # tenant teardown after its last one
    if progress is not None:
        progress.start(lane.name, sum(s.target_tokens for s in todo))
    queue = iter(todo)
    active: list[_Slot] = []
    stream = corpus.stream
    while True:
        while len(active) < config.batch_size:
            s = next(queue, None)
            if s is None:
                break
            slot = _Slot(s, agent_index[s.agent], tenant_of(s))
            prompt_end = int(s.bounds[s.target_messages[0]])
            lane.open_session(s.sid, slot.tenant, s.agent, s.tokens[:prompt_end])
            stats.sessions[slot.agent] += 1
            _advance(slot, lane, prompt_end)  # True: the session has a target message
            stats.messages[slot.agent] += 1
            active.append(slot)
        if not active:
            break
        sids = [sl.s.sid for sl in active]
        start = np.array([sl.s.offset + sl.pos for sl in active], dtype=np.int64)
        remaining = np.array([sl.end - sl.pos for sl in active], dtype=np.int64)

        def truth(width: int, pad: int) -> np.ndarray:
            # int32 [B, width]: the next `width` true tokens of each row, `pad` past its
            # message end.
            cols = np.arange(width, dtype=np.int64)
            idx = start[:, None] + np.minimum(cols[None, :], np.maximum(remaining[:, None] - 1, 0))
            return np.where(cols[None, :] < remaining[:, None], stream[idx], pad).astype(np.int32)

        res = lane.step(sids, [sl.s.tokens[:sl.pos] for sl in active], truth, remaining)
        accepted = np.minimum(res.num_accepted, remaining)
        produced = np.minimum(accepted + 1, remaining)
        agent = np.array([sl.agent for sl in active], dtype=np.int64)
        output_ids = truth(int(produced.max()), -1)
        output_ids[np.arange(output_ids.shape[1])[None, :] >= produced[:, None]] = -1
        # the drafter's commit is drafter time too (synchronized, as the lane's propose)
        t0 = time.perf_counter()
        lane.observe(sids, output_ids, produced, accepted)
        if getattr(lane, "device", None) is not None:
            synchronize(lane.device)
        stats.add_step(agent, res.num_drafted, accepted, produced, res.draft_seconds,
                       res.maybe_sources, commit_seconds=time.perf_counter() - t0)

        still = []
        for slot, n in zip(active, produced.tolist()):
            slot.pos += n
            if slot.pos < slot.end:
                still.append(slot)
                continue
            s = slot.s
            lane.finish_message(s.sid)
            if progress is not None:
                progress.advance(int(s.bounds[slot.msg + 1] - s.bounds[slot.msg]))
            if s.maybe_files is not None and lane.wants_files:
                for path, text, first_line in s.maybe_files[slot.msg]:
                    lane.add_file(slot.tenant, path, text, first_line)
            if _advance(slot, lane, int(s.bounds[s.target_messages[0]])):
                stats.messages[slot.agent] += 1
                still.append(slot)
            else:
                lane.close_session(s.sid)
                sessions_left[slot.tenant] -= 1
                if sessions_left[slot.tenant] == 0:
                    lane.close_tenant(slot.tenant)
        active = still
    if progress is not None:
        progress.stop()
    return stats


@dataclass
class ReplayReport:
    """Rows (one per drafter and agent format, then ``"all"``) and the run's configuration,
    in the layout of DESIGN.md "Replay output"."""

    rows: list[dict]
    config: dict

    def to_json(self) -> dict:
        return {"results": self.rows, "config": self.config}


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: _jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return getattr(obj, "value", None) if hasattr(obj, "value") else str(obj)


def run_replay(corpus: ReplayCorpus, drafters: Sequence[str | tuple[str, Callable[[], Lane]]],
               tokenizer: Tokenizer, config: ReplayConfig | None = None, *,
               progress: ReplayProgress | None = None, inputs: Sequence[str] = (),
               cross_halves: Sequence[str | Path] | None = None,
               warm_responses: Sequence[np.ndarray] = ()) -> ReplayReport:
    """Replays ``corpus`` through each drafter and computes the report.

    Parameters
    ----------
    corpus : from :func:`tokenize_sessions` (with captures when an agspec drafter runs).
    drafters : names from :data:`agspec_gpu.replay_lanes.DRAFTER_NAMES`, or ``(name,
        factory)`` pairs building a custom :class:`~agspec_gpu.replay_lanes.Lane` (tests).
    tokenizer : the corpus's tokenizer (agspec stores tokenize workspace files with it).
    config : see :class:`ReplayConfig`.
    inputs : recorded in ``config["inputs"]`` (the paths the sessions came from).
    cross_halves : ``(global corpus of half 0, global corpus of half 1)``: the sessions of
        each half (:func:`agspec_gpu.tiers.session_half` of their task) replay against the
        global tier built from the *other* half, and the counters of both are summed, so a
        whole set is measured with a global tier without any session feeding its own, nor any
        other session of its task
        (``config.global_corpus`` is ignored).
    warm_responses : without ``cross_halves``, what ``suffix-decoding-warm``'s cache holds
        (token arrays, oldest first: the traffic ``config.global_corpus`` was built from,
        :func:`session_responses` of those sessions); with it, each half's warm cache holds
        the other half's responses.

    Returns
    -------
    :class:`ReplayReport`. Each oracle pass (one per distinct corpora configuration) runs
    once and its per-agent ``tau`` fills the ``oracle_tau`` of every row it bounds.
    """
    config = config or ReplayConfig()
    if tokenizer.fingerprint != corpus.tokenizer_fingerprint:
        raise ValueError(f"tokenizer {tokenizer.name!r} is not the one the corpus was "
                         f"tokenized with ({corpus.tokenizer_name!r})")
    check_drafter_names([d for d in drafters if isinstance(d, str)])
    if config.workers > 1 and not all(isinstance(d, str) for d in drafters):
        raise ValueError("workers > 1 runs named drafters only (custom lane factories "
                         "cannot be sent to another process)")
    t_wall = time.perf_counter()
    if cross_halves is None:
        parts = [(corpus, config, tuple(warm_responses))]
    elif len(warm_responses):
        raise ValueError("warm_responses: cross_halves warms each half with the other's")
    else:
        from agspec_gpu.tiers import session_half

        if len(cross_halves) != 2:
            raise ValueError("cross_halves: expected (global of half 0, global of half 1)")
        halves = [tuple(s for s in corpus.sessions if session_half(s.task) == h)
                  for h in (0, 1)]
        warm = "suffix-decoding-warm" in drafters
        # half h replays against the global tier built from the other half (and a warm
        # SuffixDecoding against the other half's responses)
        parts = [(replace(corpus, sessions=halves[h], agent_formats=corpus.agents),
                  replace(config, global_corpus=str(cross_halves[1 - h])),
                  session_responses(halves[1 - h]) if warm else ())
                 for h in (0, 1)]
    parts = [part for part in parts if part[0].sessions]
    if config.workers > 1 and parts:  # every part's shards in one pool of workers
        results = [_replay_sharded(parts, list(drafters), tokenizer, config.workers, progress)]
    else:
        results = [_replay_all(part, list(drafters), tokenizer, cfg_part, progress, warm)
                   for part, cfg_part, warm in parts]
    if not results:  # nothing to replay: the counters of an empty run
        results.append(_replay_all(corpus, drafters, tokenizer, config, progress))
    lanes_stats, oracle_stats, timing = _merge_results(results)
    wall = time.perf_counter() - t_wall
    oracle = {key: {r["agent"]: r["tau"] for r in st.rows("oracle", config.cost_model)}
              for key, st in oracle_stats.items()}

    rows = []
    for name, key, stats in lanes_stats:
        rows.extend(stats.rows(name, config.cost_model, oracle.get(key)))
    add_replay_speedups(rows)
    cfg = {
        "inputs": list(inputs),
        "drafters": [d if isinstance(d, str) else d[0] for d in drafters],
        "tokenizer": corpus.tokenizer_name,
        "tokenizer_fingerprint": corpus.tokenizer_fingerprint,
        "sessions": len(corpus.sessions),
        "batch_size": config.batch_size,
        "tenant_by": config.tenant_by,
        "device": config.device,
        "global_corpus": config.global_corpus if cross_halves is None else {
            "half 0 replayed against": str(cross_halves[1]),
            "half 1 replayed against": str(cross_halves[0])},
        "oracle": config.oracle,
        "oracle_k": config.oracle_k,
        "oracle_corpora": [_jsonable(k) for k in oracle],
        "p_acc_k": list(range(1, P_ACC_MAX_K + 1)),
        "cost_model": config.cost_model.to_json(),
        "speedup_model": "tau * cost(1) / (cost(1 + drafted_per_step) + the drafter's "
                         "propose and commit ms per step, timed on the replay's device)",
        "batch_speedup_model": "tau * cost(B) / cost(B * (1 + drafted_per_step)), B = "
                               "mean_batch (drafting time excluded)",
        "replay_speedup_model": "modelled_ms of the none lane / modelled_ms of the lane, "
                                "modelled_ms = sum over the lane's batched steps of "
                                "cost(rows + drafted) (drafting time excluded; null "
                                "without a none lane)",
        "draft_time": "wall time of propose per request step (a batched propose is shared "
                      "by its rows; host drafters: sum of their per-request calls)",
        "workers": config.workers,
        "lane_seconds": timing,
        "wall_seconds": wall,
    }
    return ReplayReport(rows, cfg)


LaneStats = list[tuple[str, Hashable | None, ReplayStats]]


def session_responses(sessions: Sequence[TokenizedSession]) -> tuple[np.ndarray, ...]:
    """The assistant messages of ``sessions``, in order: the responses a server that
    answered them holds."""
    return tuple(s.tokens[s.bounds[i]:s.bounds[i + 1]] for s in sessions
                 for i in s.target_messages)


def _replay_all(corpus: ReplayCorpus, drafters: Sequence, tokenizer: Tokenizer,
                config: ReplayConfig, progress: ReplayProgress | None,
                warm_responses: tuple = ()
                ) -> tuple[LaneStats, dict[Hashable, ReplayStats], dict[str, float]]:
    """Every drafter's pass, then one oracle pass per distinct corpora configuration
    (``warm_responses``: :attr:`LaneContext.warm_responses`)."""
    maybe_global = None
    if config.global_corpus is not None:
        from agspec_gpu.tiers import load_global_corpus

        maybe_global = load_global_corpus(config.global_corpus, tokenizer)
        maybe_global.check_disjoint(s.task for s in corpus.sessions)
    ctx = LaneContext(tokenizer, config.device, config.batch_size, maybe_global,
                      config.oracle_k, config.cost_model, warm_responses)
    has_files = all(s.maybe_files is not None for s in corpus.sessions)
    lanes_stats: LaneStats = []
    timing: dict[str, float] = {}
    for spec in drafters:
        name, factory = (spec, lambda n=spec: make_lane(n, ctx)) if isinstance(spec, str) \
            else spec
        lane = factory()
        if lane.wants_files and not has_files:
            raise ValueError(f"{name}: the corpus was tokenized with capture_files=False, "
                             f"but this drafter searches the workspace tier")
        t0 = time.perf_counter()
        stats = replay_lane(corpus, lane, config, progress)
        timing[name] = time.perf_counter() - t0
        lanes_stats.append((name, lane.oracle_key if config.oracle else None, stats))
    oracle: dict[Hashable, ReplayStats] = {}
    for _, key, _ in lanes_stats:
        if key is None or key in oracle:
            continue
        if not has_files:
            raise ValueError("the oracle searches the workspace tier, but the corpus was "
                             "tokenized with capture_files=False (or pass oracle=False)")
        t0 = time.perf_counter()
        name = f"oracle{len(oracle) + 1}"
        oracle[key] = replay_lane(corpus, make_oracle_lane(name, key, ctx), config, progress)
        timing[name] = time.perf_counter() - t0
    return lanes_stats, oracle, timing


def shard_sessions(corpus: ReplayCorpus, num_shards: int) -> list[ReplayCorpus]:
    """Splits the sessions into ``num_shards`` corpora of about equal target tokens
    (longest first, each to the lightest shard; order within a shard is kept)."""
    load = [0] * num_shards
    member: list[list[int]] = [[] for _ in range(num_shards)]
    sizes = [s.target_tokens for s in corpus.sessions]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = min(range(num_shards), key=lambda k: load[k])
        member[k].append(i)
        load[k] += sizes[i]
    return [replace(corpus, sessions=tuple(corpus.sessions[i] for i in sorted(m)),
                    agent_formats=corpus.agents) for m in member if m]


def _shard_worker(args: tuple) -> tuple:
    corpus, drafters, tokenizer, config, warm = args
    import torch

    torch.set_num_threads(1)
    return _replay_all(corpus, drafters, tokenizer, config, None, warm)


def _replay_sharded(parts: list[tuple[ReplayCorpus, ReplayConfig, tuple]], drafters: list[str],
                    tokenizer: Tokenizer, workers: int, progress: ReplayProgress | None
                    ) -> tuple[LaneStats, dict[Hashable, ReplayStats], dict[str, float]]:
    """:func:`_replay_all` on ``workers`` shards of each part (a corpus, its config and its
    warm responses: each shard's SuffixDecoding holds all of them, as one server would), all
    shards in one pool of ``workers`` processes, the largest first (so one part's slow shard
    overlaps the next part's); counters summed, lane seconds summed over the shards (CPU
    time, not wall)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    def size(c: ReplayCorpus) -> int:
        return sum(s.target_tokens for s in c.sessions)

    jobs = sorted(((shard, replace(cfg, workers=1), warm) for part, cfg, warm in parts
                   for shard in shard_sessions(part, workers)), key=lambda j: -size(j[0]))
    if progress is not None:
        progress.start(f"{len(jobs)} shards", sum(size(c) for c, _, _ in jobs))
    results = []
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        for res, (c, _, _) in zip(pool.map(_shard_worker, [(c, drafters, tokenizer, cfg, warm)
                                                           for c, cfg, warm in jobs]), jobs):
            results.append(res)
            if progress is not None:
                progress.advance(size(c))
    if progress is not None:
        progress.stop()
    return _merge_results(results)


def _merge_results(results: list[tuple]) -> tuple[LaneStats, dict[Hashable, ReplayStats],
                                                    dict[str, float]]:
    """Sums the counters (and lane seconds) of runs of the same drafters on other sessions."""
    lanes_stats, oracle, timing = results[0]
    for ls, orc, tm in results[1:]:
        for (_, _, acc), (_, _, st) in zip(lanes_stats, ls):
            acc.merge(st)
        for key, st in orc.items():
            if key in oracle:
                oracle[key].merge(st)
            else:
                oracle[key] = st
        for k, v in tm.items():
            timing[k] = timing.get(k, 0.0) + v
    return lanes_stats, oracle, timing
