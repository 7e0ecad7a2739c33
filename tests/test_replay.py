"""Replay evaluator: acceptance arithmetic with known answers, the oracle bound, the report
layout, and the command line (``replay`` on a fixture, ``demo`` on a git repo made here)."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.gitlog import cat_n
from agspec_gpu.replay import (ReplayConfig, run_replay, session_responses, shard_sessions,
                               tokenize_sessions)
from agspec_gpu.replay_lanes import BatchedLane, HostLane, agspec_unavailable_reason
from agspec_gpu.accept import NO_TOKEN, teacher_forced_accept
from agspec_gpu.replay_stats import P_ACC_MAX_K, ReplayStats
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import Message, Session

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = {"drafter", "agent", "sessions", "messages", "target_tokens", "steps", "tau",
                 "acceptance_rate", "drafted_per_step", "empty_draft_share", "oracle_tau",
                 "draft_us_per_step", "commit_us_per_step"}
needs_agspec = pytest.mark.skipif(agspec_unavailable_reason() is not None,
                                  reason=f"agspec drafter missing: {agspec_unavailable_reason()}")

FILE_TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(12))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("cl100k")




def _copy_session(sid: str, agent: str = "mini-swe-agent", text: str = FILE_TEXT) -> Session:
    """The agent reads a file with ``cat -n``, then writes it back verbatim."""
    return Session(sid, agent, "", "test", (
        Message("system", "You are a software engineer."),
        Message("user", f"Task {sid}: rewrite calc.py."),
        Message("assistant", "THOUGHT: read it.\n\n```bash\ncat -n calc.py\n```"),
        Message("tool", cat_n(text)),
        Message("assistant", text),
    ))


# ----------------------------------------------------------------------------- acceptance


@pytest.mark.parametrize(("tree", "truth", "expected", "path"), [
    ([(5, -1), (7, 0), (9, 1)], [5, 7, 9, 1], 3, [0, 1, 2]),  # whole chain
    ([(5, -1), (7, 0), (9, 1)], [5, 7, 8, 1], 2, [0, 1, -1]),  # cut at depth 3
    ([(4, -1), (5, -1), (8, 0), (6, 1)], [5, 6, 0], 2, [1, 3, -1, -1]),  # second branch
    ([(5, -1), (7, 0), (9, 1)], [5, 7, NO_TOKEN], 2, [0, 1, -1]),  # message ends
    ([(5, -1), (7, 0), (9, 1)], [5, 7], 2, [0, 1, -1]),  # truth narrower than the tree
    ([(5, -1), (5, -1), (6, 1)], [5, 6], 2, [0, 2, -1]),  # duplicate siblings: deepest wins
    ([(3, -1)], [5], 0, [-1]),
])
def test_teacher_forced_accept_golden(tree, truth, expected, path):
    d = DraftBatch.from_lists([tree])
    got = teacher_forced_accept(d, torch.tensor([truth], dtype=torch.int32))
    assert got.num_accepted.tolist() == [expected]
    # duplicate siblings: the count is the longest path; the reported node per depth is the
    # lowest accepted index at that depth
    assert got.path_nodes[0, :len(path)].tolist()[:expected] == path[:expected]


def test_teacher_forced_accept_batch_matches_rows():
    rng = np.random.default_rng(0)
    trees = []
    for _ in range(17):
        n = int(rng.integers(0, 12))
        trees.append([(int(rng.integers(0, 3)), int(rng.integers(-1, j)) if j else -1)
                      for j in range(n)])
    truth = torch.from_numpy(rng.integers(0, 3, size=(17, 12)).astype(np.int32))
    batch = teacher_forced_accept(DraftBatch.from_lists(trees), truth).num_accepted.tolist()
    for b, t in enumerate(trees):
        one = teacher_forced_accept(DraftBatch.from_lists([t]), truth[b:b + 1])
        assert one.num_accepted.tolist() == [batch[b]]
        # reference: walk every node's ancestors
        best = 0
        for j in range(len(t)):
            chain, k = [], j
            while k >= 0:
                chain.append(t[k][0])
                k = t[k][1]
            chain.reverse()
            if chain == truth[b, :len(chain)].tolist():
                best = max(best, len(chain))
        assert batch[b] == best, (b, t)


def test_teacher_forced_accept_empty_batch():
    d = DraftBatch.from_lists([[], []])
    assert teacher_forced_accept(d, torch.zeros(2, 4, dtype=torch.int32)).num_accepted.tolist() \
        == [0, 0]


def test_teacher_forced_accept_names_a_truth_that_is_no_int_tensor():
    """A float truth was truncated silently (5.7 accepted a 5), a list raised
    AttributeError."""
    d = DraftBatch.from_lists([[(5, -1), (6, 0)]])
    for bad in (torch.tensor([[5.7, 6.2]]), [[5, 6]], torch.tensor([5, 6])):
        with pytest.raises(ValueError, match="truth"):
            teacher_forced_accept(d, bad)


# ----------------------------------------------------------------------------- known answers


class FutureHost:
    """A host drafter that knows the true streams: drafts the next ``k`` stream tokens.

    Keys are ``sid#n`` (:class:`HostLane`'s naming), so it finds the session's stream."""

    def __init__(self, streams: dict[str, np.ndarray], k: int) -> None:
        self.name, self.streams, self.k = f"future-k{k}", streams, k

    def begin(self, key, tenant, context, session=None):
        pass

    def propose(self, key, context):
        stream = self.streams[key.rsplit("#", 1)[0]]
        toks = stream[len(context):len(context) + self.k].tolist()
        return toks, list(range(-1, len(toks) - 1))

    def accept(self, key, tokens):
        pass

    def end(self, key):
        pass

    def end_session(self, session):
        pass


class FutureBatched:
    """A stub of ``agspec_gpu.drafter.Drafter``: batched, knows the streams, tags every
    node with source ``workspace/diff-context`` (tier 1, form 2 -> code 10)."""

    def __init__(self, streams, k, source=10):
        self.streams, self.k, self.source, self.pos = streams, k, source, {}

    def open_session(self, sid, tenant, role, prompt_ids):
        self.pos[sid] = len(prompt_ids)

    def extend(self, sid, tokens):
        self.pos[sid] += len(tokens)

    def propose(self, sids):
        trees = []
        for sid in sids:
            p = self.pos[sid]
            toks = self.streams[sid][p:p + self.k].tolist()
            trees.append([(t, j - 1) for j, t in enumerate(toks)])
        d = DraftBatch.from_lists(trees)
        d.maybe_source = torch.where(d.token_ids >= 0, self.source, -1).to(torch.int8)
        return d

    def observe(self, sids, output_ids, num_output, num_accepted, **kw):
        assert output_ids.dtype == torch.int32 and num_output.dtype == torch.int32
        assert kw["num_output_host"] == num_output.tolist()
        for sid, n in zip(sids, num_output.tolist()):
            self.pos[sid] += n

    def close_session(self, sid):
        del self.pos[sid]


class RecordingStore:
    def __init__(self):
        self.files = []

    def add_workspace_file(self, tenant, path, text, first_line=None):
        self.files.append((tenant, path, text, first_line))


def _assistant_lengths(corpus):
    return [int(s.bounds[i + 1] - s.bounds[i]) for s in corpus.sessions
            for i in s.target_messages]


@pytest.mark.parametrize("k", [1, 4, 32])
@pytest.mark.parametrize("batched", [False, True])
def test_future_drafter_tau_is_k_plus_one(tok, k, batched):
    sessions = [_copy_session(f"s{i}", text=FILE_TEXT * (i + 1)) for i in range(5)]
    corpus = tokenize_sessions(sessions, tok)
    streams = {s.sid: s.tokens for s in corpus.sessions}
    store = RecordingStore()
    lane = (BatchedLane("future", FutureBatched(streams, k), store) if batched
            else HostLane(FutureHost(streams, k)))
    # batch of 2: sessions join as others finish
    report = run_replay(corpus, [("future", lambda: lane)], tok,
                        ReplayConfig(batch_size=2, oracle=False))
    lengths = _assistant_lengths(corpus)
    steps = sum(math.ceil(n / (k + 1)) for n in lengths)
    row = report.rows[-1]
    assert row["agent"] == "all" and row["sessions"] == 5 and row["messages"] == 10
    assert row["target_tokens"] == sum(lengths)
    assert row["steps"] == steps
    assert row["tau"] == pytest.approx(sum(lengths) / steps)
    # every step accepts min(k, tokens left), so at least one, and k when k or more were left
    lefts = [n - j * (k + 1) for n in lengths for j in range(math.ceil(n / (k + 1)))]
    assert row["accepted_per_step"] == pytest.approx(sum(min(k, x) for x in lefts) / steps)
    assert row["p_acc"][0] == 1.0
    assert row["p_acc"][k - 1] == pytest.approx(sum(x >= k for x in lefts) / steps)
    # k drafted per step, fewer only at the very end of a session's stream
    assert sum(min(k, x) for x in lefts) / steps <= row["drafted_per_step"] <= k
    # batches of 2 (1 at the tail): the batch speedup prices 2 * (1 + drafted) tokens
    assert 1 < row["mean_batch"] <= 2
    cost = ReplayConfig().cost_model
    B = row["mean_batch"]
    assert row["modelled_batch_speedup"] == pytest.approx(
        row["tau"] * cost.step_ms(B) / cost.step_ms(B * (1 + row["drafted_per_step"])))
    # step by step: each batched step costs cost(rows + drafts); no none lane, no ratio
    assert row["modelled_ms"] >= steps / 2 * cost.step_ms(2)
    assert row["modelled_replay_speedup"] is None
    if batched:
        assert row["tier_share"] == {"workspace": 1.0}
        assert row["form_share"] == {"diff_ctx": 1.0}
        # the cat -n output of every session was captured into its own tenant's workspace
        assert sorted((t, p, x) for t, p, x, _ in store.files) == sorted(
            (s.id, "calc.py", FILE_TEXT * (i + 1)) for i, s in enumerate(sessions))
    else:
        assert row["tier_share"] == {} and row["attributed_accepted_share"] is None


def test_none_gives_tau_one(tok):
    corpus = tokenize_sessions([_copy_session("a"), _copy_session("b", agent="swe-agent")], tok)
    report = run_replay(corpus, ["none"], tok, ReplayConfig(oracle=False))
    by_agent = {r["agent"]: r for r in report.rows}
    assert set(by_agent) == {"mini-swe-agent", "swe-agent", "all"}
    for r in report.rows:
        assert r["tau"] == 1.0 and r["steps"] == r["target_tokens"]
        assert r["acceptance_rate"] is None and r["empty_draft_share"] == 1.0
        assert r["drafted_per_step"] == 0.0 and r["p_acc"] == [0.0] * P_ACC_MAX_K
        assert r["modelled_speedup"] == pytest.approx(1.0, abs=1e-3)
        assert r["modelled_batch_speedup"] == pytest.approx(1.0)
        assert 1 <= r["mean_batch"] <= 64
        # the lane's figure, on its "all" row only (agents share the batch)
        assert r["modelled_replay_speedup"] == (pytest.approx(1.0) if r["agent"] == "all"
                                                else None)
    assert by_agent["all"]["target_tokens"] == sum(_assistant_lengths(corpus))


def test_modelled_replay_time_sums_each_step(tok):
    """A step of B rows with d drafts costs cost(B + d): with one session at a time the
    none lane's time is one cost(1) per token, the future drafter's one cost(1 + k) per
    step, so their ratio is known."""
    sessions = [_copy_session(f"s{i}", text=FILE_TEXT) for i in range(2)]
    corpus = tokenize_sessions(sessions, tok)
    streams = {s.sid: s.tokens for s in corpus.sessions}
    k = 4
    report = run_replay(corpus, ["none", ("future", lambda: HostLane(FutureHost(streams, k)))],
                        tok, ReplayConfig(batch_size=1, oracle=False))
    cost = ReplayConfig().cost_model
    none = next(r for r in report.rows if r["drafter"] == "none" and r["agent"] == "all")
    fut = next(r for r in report.rows if r["drafter"] == "future" and r["agent"] == "all")
    assert none["modelled_ms"] == pytest.approx(none["steps"] * cost.step_ms(1))
    # every step drafts k tokens (each message is followed by more of its session's stream)
    assert round(fut["drafted_per_step"] * fut["steps"]) == k * fut["steps"]
    assert fut["modelled_ms"] == pytest.approx(fut["steps"] * cost.step_ms(1 + k))
    assert fut["modelled_replay_speedup"] == pytest.approx(
        none["modelled_ms"] / fut["modelled_ms"])
    assert none["modelled_replay_speedup"] == pytest.approx(1.0)
    # the histogram behind it: merge adds counts of steps by tokens verified
    a, b = ReplayStats(("x",)), ReplayStats(("x",))
    zero = np.zeros(1, dtype=np.int64)
    a.add_step(zero, np.array([3]), np.array([1]), np.array([2]), 0.0)
    b.add_step(np.zeros(2, dtype=np.int64), np.array([0, 30]), np.array([0, 2]),
               np.array([1, 3]), 0.0)
    a.merge(b)
    assert a.modelled_ms(cost) == pytest.approx(cost.step_ms(4) + cost.step_ms(32))


def test_batch_size_does_not_change_per_request_drafters(tok):
    sessions = [_copy_session(f"s{i}", text=FILE_TEXT[: 200 * (i + 1)]) for i in range(4)]
    corpus = tokenize_sessions(sessions, tok, capture_files=False)
    rows = [run_replay(corpus, ["pld-hf", "pld-vllm"], tok,
                       ReplayConfig(batch_size=b, oracle=False)).rows for b in (1, 3, 64)]
    strip = lambda rs: [{k: v for k, v in r.items()  # noqa: E731 - timing, batch differ
                         if k not in ("draft_us_per_step", "commit_us_per_step",
                                      "modelled_speedup", "batch_steps",
                                      "mean_batch", "modelled_batch_speedup",
                                      "modelled_ms", "modelled_replay_speedup")} for r in rs]
    assert strip(rows[0]) == strip(rows[1]) == strip(rows[2])
    pld = next(r for r in rows[0] if r["drafter"] == "pld-hf" and r["agent"] == "all")
    assert pld["tau"] > 1.5  # the copied file is found in the context


def test_workers_sum_the_shards(tok):
    """Two processes, each a shard of the sessions: per-request drafters count exactly the
    same steps as one process (the shards keep every agent format's row)."""
    sessions = [_copy_session(f"s{i}", text=FILE_TEXT[: 150 * (i + 1)],
                              agent="swe-agent" if i == 4 else "mini-swe-agent")
                for i in range(5)]
    corpus = tokenize_sessions(sessions, tok, capture_files=False)
    shards = shard_sessions(corpus, 2)
    assert sorted(s.sid for c in shards for s in c.sessions) == sorted(
        s.sid for s in corpus.sessions)
    assert all(c.agents == corpus.agents for c in shards)
    sizes = [sum(_assistant_lengths(c)) for c in shards]
    assert max(sizes) - min(sizes) <= max(_assistant_lengths(corpus))
    one, two = (run_replay(corpus, ["none", "pld-hf"], tok,
                           ReplayConfig(batch_size=2, oracle=False, workers=w))
                for w in (1, 2))
    keys = ("drafter", "agent", "sessions", "messages", "target_tokens", "steps", "tau",
            "acceptance_rate", "drafted_per_step", "p_acc")
    assert [{k: r[k] for k in keys} for r in one.rows] == \
        [{k: r[k] for k in keys} for r in two.rows]
    assert two.config["workers"] == 2 and two.config["wall_seconds"] > 0
    with pytest.raises(ValueError, match="named drafters"):
        run_replay(corpus, [("x", lambda: None)], tok, ReplayConfig(oracle=False, workers=2))
    with pytest.raises(ValueError, match="workers"):
        ReplayConfig(workers=0)


def test_report_json_layout(tok):
    corpus = tokenize_sessions([_copy_session("a")], tok, capture_files=False)
    report = run_replay(corpus, ["none", "pld-hf"], tok, ReplayConfig(oracle=False),
                        inputs=["x.jsonl"])
    obj = json.loads(json.dumps(report.to_json()))  # plain JSON types only
    assert set(obj) == {"results", "config"}
    assert [(r["drafter"], r["agent"]) for r in obj["results"]] == [
        ("none", "mini-swe-agent"), ("none", "all"), ("pld-hf", "mini-swe-agent"),
        ("pld-hf", "all")]
    for r in obj["results"]:
        assert REQUIRED_KEYS <= set(r)
        assert len(r["p_acc"]) == P_ACC_MAX_K and r["oracle_tau"] is None
    assert obj["config"]["tokenizer"] == "cl100k" and obj["config"]["inputs"] == ["x.jsonl"]
    with pytest.raises(ValueError, match="capture_files=False"):
        run_replay(corpus, [("x", lambda: BatchedLane("x", None, None))], tok,
                   ReplayConfig(oracle=False))
    with pytest.raises(ValueError, match="unknown drafter"):
        run_replay(corpus, ["pld"], tok)


def test_config_validation():
    from agspec_gpu.replay import MAX_BATCH_SIZE

    for bad in (0, MAX_BATCH_SIZE + 1, 10**9):  # the drafter's buffers are sized by it
        with pytest.raises(ValueError, match=r"batch_size must be in \[1, 4096\]"):
            ReplayConfig(batch_size=bad)
    for bad in (0, 33, 4097):  # past the oracle's index depth: it was capped at 32 silently
        with pytest.raises(ValueError, match="oracle_k"):
            ReplayConfig(oracle_k=bad)
    from agspec_gpu.replay import MAX_ORACLE_K
    from agspec_gpu.tiers import TierConfig

    assert MAX_ORACLE_K == TierConfig().max_depth
    with pytest.raises(ValueError, match="tenant_by"):
        ReplayConfig(tenant_by="user")
    # types, named where they once failed deep inside (or, "no", ran with the oracle on)
    for kw in (dict(batch_size=1.5), dict(batch_size=True), dict(oracle_k=2.5),
               dict(workers=2.5), dict(workers=float("nan")), dict(oracle="no"),
               dict(cost_model="cost.json"), dict(device=None), dict(global_corpus=3)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ReplayConfig(**kw)
    from agspec_gpu.replay_target import ReplayTargetConfig

    for kw in (dict(max_message_tokens=float("nan")), dict(messages_per_session=float("nan")),
               dict(max_message_tokens=20.5), dict(context_tokens="4096"),
               dict(max_steps=None, prefill_chunk=None)):
        with pytest.raises(ValueError, match="|".join(kw)):
            ReplayTargetConfig(batch_size=2, **kw)
    assert type(ReplayConfig(batch_size=np.int64(3)).batch_size) is int


# ----------------------------------------------------------------------------- oracle bound

_WORDS = ("def", "return", "self", "x", "y", "+", "=", "(", ")", ":", "\n", "    ", "foo",
          "bar", "import", "os", "if", "else", "None", "[", "]", ",", "1", "2")


def _random_session(rng: np.random.Generator, i: int) -> Session:
    words = lambda n: " ".join(rng.choice(_WORDS, size=n))  # noqa: E731
    file_text = "".join(words(int(rng.integers(3, 9))) + "\n" for _ in range(8))
    msgs = [Message("system", "agent"), Message("user", words(10)),
            Message("assistant", "```bash\ncat -n a.py\n```"), Message("tool", cat_n(file_text))]
    history = file_text
    for _ in range(int(rng.integers(1, 4))):
        # copy spans of what came before, mixed with fresh words
        parts = []
        for _ in range(int(rng.integers(1, 4))):
            a = int(rng.integers(0, len(history)))
            parts.append(history[a:a + int(rng.integers(5, 80))])
            parts.append(words(int(rng.integers(0, 6))))
        text = "".join(parts)
        msgs += [Message("assistant", text), Message("tool", words(int(rng.integers(2, 20))))]
        history += text
    return Session(f"r{i}", "random", "", "test", tuple(msgs))


@needs_agspec
@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_oracle_bounds_every_drafter(seed):
    # suffix-decoding (with its cache) is left out: its cache holds other sessions'
    # responses, which are outside this session's corpora when every session is its own
    # tenant, so the bound does not apply to it.
    tok = load_tokenizer("cl100k")
    rng = np.random.default_rng(seed)
    corpus = tokenize_sessions([_random_session(rng, i) for i in range(3)], tok)
    names = ["none", "pld-hf", "pld-vllm", "suffix-decoding-nocache", "agspec",
             "agspec-static-k8"]
    names = [n for n in names if n != "suffix-decoding-nocache" or _has_arctic()]
    # and the other side: a drafter that knows the future (k = oracle_k) is never below it
    streams = {s.sid: s.tokens for s in corpus.sessions}
    future = ("future", lambda: HostLane(FutureHost(streams, 32)))
    report = run_replay(corpus, [*names, future], tok, ReplayConfig(batch_size=2))
    oracle = {r["agent"]: r["oracle_tau"] for r in report.rows if r["drafter"] == "none"}
    for r in report.rows:
        if r["drafter"] == "future":
            assert r["tau"] >= oracle[r["agent"]] - 1e-9
            continue
        assert r["oracle_tau"] is not None
        assert r["tau"] <= r["oracle_tau"] + 1e-9, r


class _EveryTenant(set):
    def __contains__(self, tenant) -> bool:
        return True


@needs_agspec
@pytest.mark.parametrize("tenant_by", ["session", "agent"])
def test_oracle_lane_windows_equal_step_by_step_lookups(tok, tenant_by):
    # the oracle lane plans windows of a message at once (message_prefix_lengths), and goes
    # step by step when a tenant's other text changes during a message (tenant_by="agent":
    # sessions of one agent format share a workspace); both give the per-step lookups' tau
    from agspec_gpu.replay import replay_lane
    from agspec_gpu.replay_lanes import LaneContext, make_oracle_lane, oracle_key

    rng = np.random.default_rng(7)
    corpus = tokenize_sessions([_random_session(rng, i) for i in range(6)], tok)
    config = ReplayConfig(batch_size=3, tenant_by=tenant_by)
    ctx = LaneContext(tok, batch_size=3, oracle_k=12)
    stats = []
    for stepwise in (False, True):
        lane = make_oracle_lane("oracle", oracle_key("agspec", ctx), ctx)
        if stepwise:
            lane._shared_tenants = _EveryTenant()
        stats.append(replay_lane(corpus, lane, config))
    planned, looked_up = stats
    assert planned.steps.tolist() == looked_up.steps.tolist()
    assert planned.accepted_hist.tolist() == looked_up.accepted_hist.tolist()
    assert planned.accepted.sum() > planned.steps.sum()  # the sessions copy text


def _has_arctic() -> bool:
    from agspec_gpu.baselines import suffix_decoding_available

    return suffix_decoding_available()


# ----------------------------------------------------------------------------- command line


def _write_fixture(path: Path, agents: tuple[str, ...] = ("mini-swe-agent", "aider")) -> None:
    """One :func:`_copy_session` per agent format, named a, b, ... (gzip JSONL: the JSON
    escapes keep a lone surrogate in ``agents``)."""
    recs = [{"id": s.id, "source": "test", "agent": s.agent, "model": "",
             "messages": [{"role": m.role, "content": m.content} for m in s.messages]}
            for s in (_copy_session(chr(ord("a") + i), agent) for i, agent in enumerate(agents))]
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)



def test_cli_refuses_an_output_that_names_one_of_its_inputs(tmp_path, capsys):
    """``replay X.jsonl --json X.jsonl`` replaced the trajectory with its report, ``--csv``
    the global corpus, ``build-global -o`` a source file: each is refused before the run,
    the input left as it was. Files inside an input directory count when the run reads
    them; others there may be written."""
    from agspec_gpu.cli import main

    fixture = tmp_path / "fixture.jsonl.gz"
    _write_fixture(fixture)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f():\n    return 1\n")
    glob = tmp_path / "g.agspec"
    assert main(["build-global", "--src", str(src), "-o", str(glob)]) == 0
    replay = ["replay", str(fixture), "--drafter", "none", "--no-progress", "--no-oracle"]
    before = {p: p.read_bytes() for p in (fixture, glob, src / "a.py")}
    for argv, named in [
        (replay + ["--json", str(fixture)], f"--json {fixture}: the same file as input"),
        (["replay", str(tmp_path), "--drafter", "none", "--no-progress", "--no-oracle",
          "--csv", str(fixture)], f"--csv {fixture}: the same file as input"),
        (replay + ["--global", str(glob), "--csv", str(glob)], "--csv"),
        (["build-global", "--src", str(src), "-o", str(src / "a.py")], "-o"),
        (["build-global", "--src", str(src / "a.py"), "-o", str(src / "a.py")], "-o"),
        (["profile", str(fixture), "-o", str(fixture), "--no-progress", "--no-oracle"], "-o"),
        (replay + ["--json", "/proc/out.json"], "not writable"),
    ]:
        capsys.readouterr()
        assert main(argv) == 2, argv
        assert named in capsys.readouterr().err.replace("\n", " "), argv
        assert all(p.read_bytes() == b for p, b in before.items()), argv
    assert main(["build-global", "--src", str(src), "-o", str(src / "g.agspec")]) == 0


def test_a_task_id_with_a_lone_surrogate_has_a_half():
    """A task id from a file name that is not UTF-8 (or a JSON ``\\ud800``) made
    ``session_half`` raise UnicodeEncodeError (``--half``, ``--cross-halves``,
    ``build-global --half`` exited naming no file); other ids keep their halves."""
    from agspec_gpu.tiers import session_half

    assert session_half("caf\udce9") in (0, 1) and session_half("t\ud800") in (0, 1)
    assert [session_half(t) for t in ("astropy__astropy-12907", "a", "b", "")] == [
        hashlib.sha1(t.encode()).digest()[0] & 1 for t in ("astropy__astropy-12907", "a", "b", "")]

def test_cli_replay_on_a_fixture(tmp_path):
    fixture = tmp_path / "fixture.jsonl.gz"
    _write_fixture(fixture)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "agspec_gpu", "replay", str(fixture), "--drafter", "none",
         "pld-hf", "--json", str(out), "--no-progress", "--max-sessions", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pld-hf" in proc.stdout and "tau" in proc.stdout
    obj = json.loads(out.read_text())
    assert obj["config"]["sessions"] == 1  # --max-sessions applies per path
    assert {(r["drafter"], r["agent"]) for r in obj["results"]} == {
        ("none", "mini-swe-agent"), ("none", "all"), ("pld-hf", "mini-swe-agent"),
        ("pld-hf", "all")}
    for r in obj["results"]:
        assert REQUIRED_KEYS <= set(r)


def test_cli_outputs_and_errors(tmp_path, capsys):
    from agspec_gpu.cli import main

    fixture = tmp_path / "fixture.jsonl.gz"
    _write_fixture(fixture)
    csv_path, png = tmp_path / "out.csv", tmp_path / "out.png"
    assert main(["replay", str(fixture), "--drafter", "none", "pld-vllm", "--no-oracle",
                 "--csv", str(csv_path), "--plot", str(png), "--no-progress",
                 "--tenant-by", "agent"]) == 0
    header = csv_path.read_text().splitlines()[0].split(",")
    assert {"drafter", "agent", "tau", "p_acc_1", "p_acc_32"} <= set(header)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--drafter", "none",
                 "--no-progress"]) == 2
    assert "no such file" in capsys.readouterr().err


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                   check=True, capture_output=True)


def test_cli_demo_on_a_tiny_repo(tmp_path, capsys):
    from agspec_gpu.cli import main
    from agspec_gpu.gitlog import sessions_from_git

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    text = FILE_TEXT
    for i in range(3):
        (repo / "calc.py").write_text(text)
        _git(repo, "add", "calc.py")
        _git(repo, "commit", "-q", "-m", f"change {i}")
        text = text.replace(f"* {i} ", f"* {i + 1} ")
    out = tmp_path / "demo.json"
    assert main(["demo", str(repo), "--max-commits", "5", "--json", str(out),
                 "--no-progress"]) == 0
    obj = json.loads(out.read_text())
    drafters = {r["drafter"] for r in obj["results"]}
    assert {"none", "pld-hf"} <= drafters
    assert all(r["agent"] in ("git-history", "all") for r in obj["results"])
    assert all(r["sessions"] == 2 for r in obj["results"])  # the root commit gives none
    # sessions longer than the cap are left out (a clear error when none is left)
    sizes = sorted(sum(len(m.content) for m in s.messages) for s in sessions_from_git(repo))
    assert main(["demo", str(repo), "--max-session-chars", str(sizes[0]), "--json", str(out),
                 "--no-progress", "--drafter", "none", "--no-oracle"]) == 0
    assert all(r["sessions"] == 1 for r in json.loads(out.read_text())["results"])
    capsys.readouterr()
    assert main(["demo", str(repo), "--max-session-chars", str(sizes[0] - 1),
                 "--no-progress"]) == 2
    assert "--max-session-chars" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: usage error naming the option
        main(["demo", str(repo), "--max-session-chars", "0", "--no-progress"])
    assert exc.value.code == 2


def test_cli_bad_inputs_are_named_without_a_traceback(tmp_path, capsys):
    """Bad trajectory records, cost models, devices, output paths and empty inputs: exit
    status 2 and a message naming the problem (an audit found tracebacks and silent empty
    tables for each)."""
    from agspec_gpu.cli import main

    good = {"id": "s", "source": "t", "agent": "a", "model": "",
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello there"}]}

    def traj(name, **over):
        path = tmp_path / name
        path.write_text(json.dumps({**good, **over}) + "\n")
        return str(path)

    cost = tmp_path / "cost.json"
    replay = ["replay", "--no-progress", "--drafter", "none", "--no-oracle"]
    cases = [
        (replay + [traj("m.jsonl", meta=5)], "'meta' must be an object"),
        (replay + [traj("r.jsonl", messages=[{"role": ["user"], "content": "x"}])],
         "role"),
        (replay + [str(tmp_path / "deep.jsonl")], "invalid JSON"),
        (replay + [traj("ok.jsonl"), "--cost-model", str(cost)], "cost model"),
        (replay + [traj("ok.jsonl"), "--device", "foo"], "--device"),
        (replay + [traj("q.jsonl", messages=[{"role": "user", "content": "x"}])],
         "no session with a non-empty assistant message"),
        (replay + [traj("all.jsonl", agent="all")], "'all' is reserved"),
        (["build-global", "--trajectories", traj("ok.jsonl"), "-o",
          str(tmp_path / "no" / "g.agspec")], "not a file path"),
        (["build-global", "--src", str(tmp_path / "empty"), "-o", str(tmp_path / "g")],
         "no text to index"),
        # output paths are checked before the run, naming the option
        (replay + [traj("ok.jsonl"), "--json", str(tmp_path / "no" / "r.json")],
         "--json " + str(tmp_path / "no" / "r.json") + ": not a file path"),
        (["profile", traj("ok.jsonl"), "-o", str(tmp_path)], "-o " + str(tmp_path)),
        (replay + [str(tmp_path / "empty"), traj("ok.jsonl")], "no trajectory files"),
    ]
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    (tmp_path / "empty").mkdir()
    for bad_cost in ('{"pts": []}', "[1, 2]", '{"points": [[1, 1], [2, NaN]]}'):
        cost.write_text(bad_cost)
        for argv, match in cases if bad_cost.startswith("{\"pts") else cases[3:4]:
            capsys.readouterr()
            assert main(argv) == 2, argv
            assert match in capsys.readouterr().err.replace("\n", " "), argv


def test_cli_replay_prices_by_its_batchs_curve(tmp_path):
    """``replay --cost-model`` with a calibration of several batch sizes (bench_e2e's
    file) prices and budgets by the curve of the smallest batch >= ``--batch-size`` (it
    once read the top level alone: the 1-request curve, whose draft tokens are nearly free
    at 16 requests); a file of one curve is that curve at any batch size."""
    from agspec_gpu.cli import main
    from agspec_gpu.cost_model import BatchCostModels, CostModel

    fixture = tmp_path / "fixture.jsonl.gz"
    _write_fixture(fixture)
    curves = BatchCostModels(tuple((b, CostModel(((b, 5.0 + b), (b + 64, 9.0 + 2 * b)),
                                                 f"at {b}", steps=True, requests=b))
                                   for b in (1, 4, 16)))
    cost = tmp_path / "cost.json"
    for text, batch, want in ((json.dumps(curves.to_json()), 3, curves.curve_for(4)),
                              (json.dumps(curves.to_json()), 16, curves.curve_for(16)),
                              (json.dumps(curves.curve_for(4).to_json()), 16,
                               curves.curve_for(4))):
        cost.write_text(text)
        out = tmp_path / "r.json"
        assert main(["replay", str(fixture), "--drafter", "none", "--no-progress",
                     "--no-oracle", "--batch-size", str(batch), "--cost-model", str(cost),
                     "--json", str(out)]) == 0
        assert CostModel.from_json(json.loads(out.read_text())["config"]["cost_model"]) == want


def test_cli_bad_arguments_exit_2_naming_the_argument(tmp_path, capsys, monkeypatch):
    """Every bad-input path exits 2 with the argument named (some raised SystemExit(msg),
    status 1); 1 is left to what the install lacks."""
    import agspec_gpu.cli as cli

    fixture = tmp_path / "fixture.jsonl.gz"
    _write_fixture(fixture)
    replay = ["replay", str(fixture), "--drafter", "none", "--no-progress", "--no-oracle"]
    not_a_repo = tmp_path / "plain"
    not_a_repo.mkdir()
    for argv, named in [
        (replay + ["--cross-halves", "--half", "0"], "--cross-halves"),
        (replay + ["--cross-halves", "--global", str(fixture)], "--cross-halves"),
        (["demo", str(not_a_repo), "--no-progress"], f"REPO {not_a_repo}: not a git repo"),
    ]:
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        assert named in capsys.readouterr().err.replace("\n", " "), argv
    with pytest.raises(SystemExit) as exc:  # argparse checks the range: usage error, 2
        cli.main(replay + ["--oracle-k", "0"])
    assert exc.value.code == 2 and "--oracle-k: must be in [1, 32]" in capsys.readouterr().err
    # the install, not the input: 1, still naming the option
    monkeypatch.setattr(cli, "agspec_unavailable_reason", lambda: "no triton here")
    assert cli.main(["replay", str(fixture), "--drafter", "agspec", "--no-progress"]) == 1
    assert "--drafter agspec: no triton here" in capsys.readouterr().err


def test_cli_checks_outputs_halves_and_devices_before_the_run(tmp_path, capsys):
    """What a run would only find out at its end, or never: two outputs on one file, a
    directory path, a plot format matplotlib cannot write, a device that is neither CPU
    nor CUDA, a --half that leaves no session, --cross-halves with one half empty, a
    profile's reserved agent format, --half without trajectories."""
    from agspec_gpu.cli import main

    fixture = tmp_path / "fixture.jsonl.gz"
    _write_fixture(fixture)  # session a in half 0, b in half 1
    out = tmp_path / "out.json"
    replay = ["replay", str(fixture), "--drafter", "none", "--no-progress", "--no-oracle"]
    reserved = tmp_path / "reserved.jsonl.gz"
    _write_fixture(reserved, ("default",))
    for argv, named in [
        (replay + ["--json", str(out), "--csv", str(tmp_path / "." / "out.json")],
         "--csv " + str(tmp_path / "." / "out.json") + ": the same file as --json"),
        (replay + ["--json", str(tmp_path / "newdir") + "/"], "not a file path"),
        (replay + ["--plot", str(tmp_path / "plot.txt")], "--plot " + str(tmp_path)),
        (replay + ["--device", "meta"], "--device meta: expected cpu, cuda or cuda:N"),
        (replay + ["--max-sessions", "1", "--half", "1"],
         "--half 1: none of the 1 sessions read is in half 1"),
        (replay + ["--max-sessions", "1", "--cross-halves"],
         "--cross-halves: all 1 sessions read are in half 0"),
        (["profile", str(reserved), "-o", str(out), "--no-progress", "--no-oracle"],
         "agent format 'default' is reserved"),
        (["build-global", "--src", str(tmp_path), "--half", "0", "-o", str(out)],
         "--half selects trajectory sessions"),
    ]:
        capsys.readouterr()
        assert main(argv) == 2, argv
        assert named in capsys.readouterr().err.replace("\n", " "), argv
        assert not out.exists() and not (tmp_path / "newdir").exists(), argv
    # a drafter named twice replays once; --half filters a profile's sessions as a replay's
    assert main(replay[:4] + ["pld-hf", "none", "--no-progress", "--no-oracle", "--json",
                              str(out)]) == 0
    rows = [(r["drafter"], r["agent"]) for r in json.loads(out.read_text())["results"]]
    assert len(rows) == len(set(rows)) == 6
    profiles = tmp_path / "profiles.json"
    assert main(["profile", str(fixture), "-o", str(profiles), "--half", "1", "--no-progress",
                 "--no-oracle", "--profile-drafter", "agspec-static-k8"]) == 0
    assert set(json.loads(profiles.read_text())["roles"]) == {"aider", "default"}  # b only


def test_cli_batch_size_is_capped_at_parse_time(tmp_path, capsys):
    """--batch-size sizes the drafter's buffers and cost table: 10**9 tried to allocate
    128 GB; now argparse refuses it before anything is read."""
    from agspec_gpu.cli import MAX_BATCH_SIZE, _parser, main

    for bad in (10**9, MAX_BATCH_SIZE + 1, 0):
        with pytest.raises(SystemExit) as exc:
            main(["replay", str(tmp_path / "never-read.jsonl"), "--batch-size", str(bad)])
        assert exc.value.code == 2
        assert f"--batch-size: must be in [1, {MAX_BATCH_SIZE}]" in capsys.readouterr().err
    for command in (["replay", "x"], ["demo"], ["profile", "x", "-o", "p.json"]):
        args = _parser().parse_args(command + ["--batch-size", str(MAX_BATCH_SIZE)])
        assert args.batch_size == MAX_BATCH_SIZE


def test_cli_prints_unprintable_agent_names_escaped(tmp_path, capsys):
    """A lone surrogate (a non-UTF-8 record) crashed the table on a strict UTF-8 stdout
    (capsys is one) and lost the JSON, CSV and plot; rich markup in a name crashed it too."""
    from agspec_gpu.cli import main

    fixture, out = tmp_path / "fixture.jsonl.gz", tmp_path / "out.json"
    _write_fixture(fixture, agents=("bad\udc80agent", "[/x]"))
    assert main(["replay", str(fixture), "--drafter", "none", "--no-oracle", "--no-progress",
                 "--json", str(out), "--csv", str(tmp_path / "out.csv"), "--plot",
                 str(tmp_path / "out.png")]) == 0
    table = capsys.readouterr().out
    assert "bad\\udc80" in table and "[/x]" in table
    agents = {r["agent"] for r in json.loads(out.read_text())["results"]}
    assert agents == {"bad\udc80agent", "[/x]", "all"}  # JSON keeps the name itself
    assert "bad\\udc80agent" in (tmp_path / "out.csv").read_text(encoding="utf-8")
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    # an error naming such a path prints too
    assert main(["replay", str(tmp_path / "\udcff[/y].jsonl"), "--no-progress"]) == 2
    assert "\\udcff[/y].jsonl: no such file" in capsys.readouterr().err


def test_cli_keeps_its_files_when_stdout_is_a_closed_pipe(tmp_path):
    """``agspec-gpu replay ... --json F | head -1``: the first write to the closed pipe made
    rich exit 1 before F was written. Now the run goes on quietly, writes F and exits 1 with
    nothing on stderr; with no file to write it stops at once."""
    fixture, out = tmp_path / "fixture.jsonl.gz", tmp_path / "out.json"
    _write_fixture(fixture)
    argv = [sys.executable, "-m", "agspec_gpu", "replay", str(fixture), "--drafter", "none",
            "--no-oracle", "--no-progress"]
    for extra in (["--json", str(out), "--csv", str(tmp_path / "out.csv")], []):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first line: every write fails
        try:
            proc = subprocess.run(argv + extra, stdout=write_end, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT, timeout=120)
        finally:
            os.close(write_end)
        assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert {r["agent"] for r in json.loads(out.read_text())["results"]} == {
        "mini-swe-agent", "aider", "all"}
    assert (tmp_path / "out.csv").read_text().startswith("drafter,")


@needs_agspec
def test_every_drafter_name_runs(tok):
    from agspec_gpu.replay_lanes import DRAFTER_NAMES

    # (suffix-decoding-warm needs cross-halves: its own test)
    names = [n for n in DRAFTER_NAMES if n != "suffix-decoding-warm" and
             (not n.startswith("suffix") or _has_arctic())]
    corpus = tokenize_sessions([_copy_session("a"), _copy_session("b", agent="swe-agent")], tok)
    report = run_replay(corpus, names, tok, ReplayConfig(batch_size=2, tenant_by="agent"))
    rows = {(r["drafter"], r["agent"]): r for r in report.rows}
    assert {d for d, _ in rows} == set(names)
    # three corpora configurations: default (host rows, agspec, static-k), no forms, no workspace
    assert len(report.config["oracle_corpora"]) == 3
    full = rows[("agspec", "all")]
    assert full["tau"] > 2 and full["tier_share"].get("workspace", 0) > 0.5
    # the drafter's time is its propose and its commit, each timed (the commit: observe)
    assert full["draft_us_per_step"] > 0 and full["commit_us_per_step"] > 0
    assert "workspace" not in rows[("agspec-no-workspace", "all")]["tier_share"]
    assert set(rows[("agspec-no-emission", "all")]["form_share"]) <= {"raw"}
    assert rows[("agspec-no-workspace", "all")]["oracle_tau"] <= full["oracle_tau"]
    # the pruned operating point never drafts more than the default on the same tokens
    p10 = rows[("agspec-p10", "all")]
    assert p10["drafted_per_step"] <= full["drafted_per_step"] and p10["tau"] > 1.5


def _id_in_half(prefix: str, half: int) -> str:
    from agspec_gpu.tiers import session_half

    return next(f"{prefix}{i}" for i in range(100) if session_half(f"{prefix}{i}") == half)


@needs_agspec
def _halves_fixture(tok, tmp_path: Path, sessions: list[Session]) -> tuple:
    """``sessions`` written as a trajectory file, the global corpus of each of its halves
    built from it, and the sessions tokenized: ``(corpus, [half 0's, half 1's], path)``."""
    from agspec_gpu.tiers import build_global_corpus

    path = tmp_path / "sessions.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps({"id": s.id, "source": "t", "agent": s.agent, "model": "",
                                  "messages": [{"role": m.role, "content": m.content}
                                               for m in s.messages]}) + "\n"
                      for s in sessions)
    halves = [tmp_path / f"h{h}.agspec" for h in (0, 1)]
    for h in (0, 1):
        build_global_corpus([], tok, halves[h], trajectories=[path], half=h)
    return tokenize_sessions(sessions, tok), halves, path


@needs_agspec
def test_a_global_corpus_holding_a_replayed_session_is_refused(tok, tmp_path):
    """A global corpus built from trajectories records their session ids: replaying any of
    them against it (a session drafting its own text) raises naming it; sessions it does
    not hold pass (the cross-halves test replays each half against the other's)."""
    from agspec_gpu.tiers import build_global_corpus, load_global_corpus
    from agspec_gpu.trajectories import load_paths

    path = tmp_path / "two.jsonl.gz"
    _write_fixture(path)  # sessions a and b
    corpus = tokenize_sessions(load_paths([path]), tok)
    both = tmp_path / "both.agspec"
    build_global_corpus([], tok, both, trajectories=[path])
    g = load_global_corpus(both, tok)
    assert g.session_ids == {"a", "b"}
    with pytest.raises(ValueError, match="global_corpus: holds sessions of 2 of the replayed"):
        run_replay(corpus, ["agspec"], tok, ReplayConfig(oracle=False, global_corpus=str(both)))
    g.check_disjoint(["c", "d"])


@needs_agspec
def test_halves_split_by_task_so_two_agents_on_one_task_share_a_half(tok, tmp_path):
    """Two agents' sessions of one SWE-bench instance fall in one half (the split hashes
    ``meta.instance_id``), a global corpus records the tasks it holds, and replaying another
    agent's session of a held task against it is refused."""
    from agspec_gpu.tiers import build_global_corpus, load_global_corpus, session_half

    msgs = (Message("user", "fix the bug in parse()"), Message("assistant", "cat parse.py"))
    # ids whose own halves differ, one task: the split follows the task
    a_id = _id_in_half("mini/", 0)
    b_id = _id_in_half("swe/", 1)
    task = _id_in_half("django__django-", 1)
    mk = lambda sid, meta: Session(sid, sid.split("/")[0], "", "t", msgs, meta)  # noqa: E731
    a, b = mk(a_id, {"instance_id": task}), mk(b_id, {"instance_id": task})
    assert a.task_id == b.task_id == task and session_half(a.task_id) == 1
    assert mk("aider/x", {}).task_id == "aider/x"
    path = tmp_path / "one-task.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"id": a.id, "source": "t", "agent": a.agent, "model": "",
                             "messages": [{"role": m.role, "content": m.content} for m in msgs],
                             "meta": {"instance_id": task}}) + "\n")
    out = tmp_path / "g.agspec"
    build_global_corpus([], tok, out, trajectories=[path], half=1)
    g = load_global_corpus(out, tok)
    assert g.session_ids == {a_id} and g.task_ids == {task}
    corpus = tokenize_sessions([b], tok)
    assert corpus.sessions[0].task == task
    with pytest.raises(ValueError, match=f"global_corpus: holds sessions of 1 .*{task}"):
        run_replay(corpus, ["agspec"], tok, ReplayConfig(oracle=False, global_corpus=str(out)))
    with pytest.raises(ValueError, match="no text to index"):
        build_global_corpus([], tok, tmp_path / "h0.agspec", trajectories=[path], half=0)


@pytest.mark.skipif(not _has_arctic(), reason="needs arctic-inference")
def test_warm_suffix_decoding_holds_the_other_half_responses_only(tok, tmp_path):
    """suffix-decoding-warm under cross-halves: its cache holds the other half's responses
    before the replay (D, half 0, and E, half 1, give one answer: each finds the other's),
    never its own half's (G's answer, half 0 only, is not found at G; F after it finds it
    in the run's own cache, as the cold lane does), and without cross-halves it has nothing
    to warm with."""
    rng = np.random.default_rng(8)
    words = lambda: " ".join(f"w{int(x)}" for x in rng.integers(0, 10**6, 150))  # noqa: E731
    t_d, t_g = words(), words()
    ids = {k: _id_in_half(k, h) for k, h in (("d", 0), ("e", 1), ("f", 0), ("g", 0))}

    def sess(k, answer):
        return Session(ids[k], f"{k}-agent", "", "test", (Message("user", f"task {k}"),
                                                          Message("assistant", answer)))

    sessions = [sess("d", t_d), sess("e", t_d), sess("g", t_g), sess("f", t_g)]
    corpus, halves, _ = _halves_fixture(tok, tmp_path, sessions)
    for workers in (1, 2):
        report = run_replay(corpus, ["suffix-decoding", "suffix-decoding-warm"], tok,
                            ReplayConfig(batch_size=1, oracle=False, workers=workers),
                            cross_halves=halves)
        tau = {(r["drafter"], r["agent"]): r["tau"] for r in report.rows}
        # d and e answer alike from opposite halves: each finds the other's answer warm
        for k in ("d", "e"):
            assert tau["suffix-decoding-warm", f"{k}-agent"] > 5 > 1.5 > \
                tau["suffix-decoding", f"{k}-agent"], tau
        # g's answer is only in its own half: not warm; f (after g, one at a time) finds
        # it in both lanes, from the run's own cache (one worker: g's and f's shards are
        # two servers with two)
        for lane in ("suffix-decoding", "suffix-decoding-warm"):
            assert tau[lane, "g-agent"] < 1.5, tau
            assert (tau[lane, "f-agent"] > 5) == (workers == 1), tau
    with pytest.raises(ValueError, match="suffix-decoding-warm: no earlier traffic"):
        run_replay(corpus, ["suffix-decoding-warm"], tok, ReplayConfig(oracle=False))
    # without cross-halves, the caller's warm responses (as bench_drafter.py passes the
    # other half's, beside a --global tier built from it)
    half1 = replace(corpus, sessions=tuple(s for s in corpus.sessions
                                           if s.session_id == ids["e"]))
    warm = session_responses([s for s in corpus.sessions if s.session_id == ids["d"]])
    assert len(warm) == 1 and len(half1.sessions) == 1
    report = run_replay(half1, ["suffix-decoding", "suffix-decoding-warm"], tok,
                        ReplayConfig(batch_size=1, oracle=False), warm_responses=warm)
    tau = {r["drafter"]: r["tau"] for r in report.rows if r["agent"] == "all"}
    assert tau["suffix-decoding-warm"] > 5 > 1.5 > tau["suffix-decoding"], tau
    with pytest.raises(ValueError, match="warm_responses: cross_halves warms"):
        run_replay(corpus, ["suffix-decoding-warm"], tok, ReplayConfig(oracle=False),
                   cross_halves=halves, warm_responses=warm)


def test_cross_halves_never_feed_a_session_its_own_half(tok, tmp_path):
    """Each half replays against the global tier of the other half: A (half 0) copies text
    only B (half 1) holds, B copies text only C (half 0) holds, and C's text is nowhere but
    in C itself and so in the global tier of its own half, which C must never see."""
    rng = np.random.default_rng(7)
    words = lambda: " ".join(f"w{int(x)}" for x in rng.integers(0, 10**6, 120))  # noqa: E731
    t_a, t_b, r_c = words(), words(), words()
    ia, ib, ic = _id_in_half("a", 0), _id_in_half("b", 1), _id_in_half("c", 0)

    def sess(sid, agent, user, answer):
        return Session(sid, agent, "", "test", (Message("user", user),
                                                Message("assistant", answer)))

    sessions = [sess(ia, "a-agent", "go", t_a), sess(ib, "b-agent", "see " + t_a, t_b),
                sess(ic, "c-agent", "see " + t_b, r_c)]
    corpus, halves, path = _halves_fixture(tok, tmp_path, sessions)
    report = run_replay(corpus, ["agspec"], tok, ReplayConfig(batch_size=2),
                        cross_halves=halves)
    tau = {r["agent"]: r["tau"] for r in report.rows}
    orc = {r["agent"]: r["oracle_tau"] for r in report.rows}
    assert tau["a-agent"] > 5 and tau["b-agent"] > 5  # found in the other half's tier
    # its own half is never searched (the oracle still finds a few tokens of the random
    # words' digits in other text)
    assert tau["c-agent"] < 1.5 and orc["c-agent"] < 2.5 < 5 < orc["a-agent"]
    assert {r["sessions"] for r in report.rows if r["agent"] == "all"} == {3}
    assert set(report.config["global_corpus"]) == {"half 0 replayed against",
                                                   "half 1 replayed against"}
    # two workers: both halves' shards share one pool, each with its own half's tier
    two = run_replay(corpus, ["agspec"], tok, ReplayConfig(batch_size=2, workers=2),
                     cross_halves=halves)
    tau2 = {r["agent"]: r["tau"] for r in two.rows}
    assert tau2["a-agent"] > 5 and tau2["b-agent"] > 5 and tau2["c-agent"] < 1.5
    assert {r["sessions"] for r in two.rows if r["agent"] == "all"} == {3}
    # the CLI builds both global tiers itself
    from agspec_gpu.cli import main

    out = tmp_path / "x.json"
    assert main(["replay", str(path), "--cross-halves", "--drafter", "agspec", "--no-progress",
                 "--no-oracle", "--json", str(out)]) == 0
    rows = {r["agent"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["c-agent"]["tau"] < 1.5 < 5 < rows["a-agent"]["tau"]
    assert main(["replay", str(path), "--cross-halves", "--half", "0", "--no-progress"]) == 2
    # --max-sessions cuts the global tiers as it cuts the replay (as a warm SuffixDecoding's
    # cache is cut): C, not loaded, held B's answer, so B finds it nowhere
    assert main(["replay", str(path), "--cross-halves", "--drafter", "agspec", "--no-progress",
                 "--no-oracle", "--max-sessions", "2", "--json", str(out)]) == 0
    rows = {r["agent"]: r for r in json.loads(out.read_text())["results"]}
    assert "c-agent" not in rows and rows["b-agent"]["tau"] < 1.5 < 5 < rows["a-agent"]["tau"]


def test_merge_rows_of_disjoint_runs_equals_one_run(tok):
    from agspec_gpu.replay_report import merge_rows

    sessions = [_copy_session(f"m{i}", text=FILE_TEXT[: 120 * (i + 2)],
                              agent="aider" if i % 3 == 0 else "mini-swe-agent")
                for i in range(6)]
    corpus = tokenize_sessions(sessions, tok, capture_files=False)
    cfg = ReplayConfig(batch_size=2, oracle=False)
    names = ["none", "pld-hf", "pld-vllm"]
    whole = run_replay(corpus, names, tok, cfg).rows
    parts = [run_replay(c, names, tok, cfg).rows for c in shard_sessions(corpus, 2)]
    merged = merge_rows(parts, cfg.cost_model)
    assert [(r["drafter"], r["agent"]) for r in merged] == \
        [(r["drafter"], r["agent"]) for r in whole]
    for m, w in zip(merged, whole):
        for key in ("sessions", "messages", "target_tokens", "steps"):
            assert m[key] == w[key], key
        for key in ("tau", "acceptance_rate", "drafted_per_step", "empty_draft_share",
                    "accepted_per_step"):
            assert m[key] == pytest.approx(w[key]), key
        assert m["p_acc"] == pytest.approx(w["p_acc"])
        assert m["mean_batch"] > 0 and m["modelled_batch_speedup"] > 0
        # the batch figures are the lane's on every agent row, as in a replay: summed over
        # the parts' "all" rows, also the parts without this agent (they were summed over
        # the agent's parts only)
        lane = next(r for r in merged if r["drafter"] == m["drafter"] and r["agent"] == "all")
        assert m["batch_steps"] == lane["batch_steps"] == sum(
            next(r["batch_steps"] for r in p if r["drafter"] == m["drafter"]
                 and r["agent"] == "all") for p in parts)
        assert m["mean_batch"] == pytest.approx(lane["mean_batch"])
        # verification time adds up over disjoint replays; the ratio is the merged times'
        assert m["modelled_ms"] == pytest.approx(sum(
            next(r["modelled_ms"] for r in p if r["drafter"] == m["drafter"]
                 and r["agent"] == "all") for p in parts))
        assert (m["modelled_replay_speedup"] > 0) if m["agent"] == "all" else \
            m["modelled_replay_speedup"] is None
    # a part with no steps for a lane (its sessions had no assistant message): nothing to
    # add (its None per-step figures once raised a TypeError)
    empty = [{**r, "steps": 0, "target_tokens": 0, "accepted_per_step": None,
              "drafted_per_step": None} for r in parts[0]]
    again = merge_rows([*parts, empty], cfg.cost_model)
    assert [r["steps"] for r in again] == [r["steps"] for r in merged]
