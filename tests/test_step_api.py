"""Continuous batching through ``SpecDecoder.submit`` / ``step``: requests join a running batch
at step boundaries and leave it when they end, and every greedy request still equals plain
greedy decoding token for token (tiny random Llama, real cl100k tokenizer, CPU)."""

import pytest
import torch

from agspec_gpu import CorpusTier, DecoderConfig, SamplingParams, SpecDecoder, StepOutput
from agspec_gpu.runners.hf import HFRunner
from agspec_gpu.drafter_config import DrafterConfig
from test_decoder import (VARIANTS, greedy, model, own_loop, prompts, record_hf_prefills,
                          record_prefills, seeded_sample, steer, tok)

VARIANT = VARIANTS[0]


def decoder(runner: str, **kw) -> SpecDecoder:
    cfg = dict(runner=runner, max_batch=3, max_sessions=8, page_size=8, kv_cache_tokens=4096)
    return SpecDecoder(model(VARIANT), tok(), DecoderConfig(**{**cfg, **kw}))


def run_until_idle(dec: SpecDecoder, log: list | None = None, submit_at: dict | None = None,
                   generator=None, max_steps: int = 500) -> dict[str, list[int]]:
    """Steps until nothing is running or queued (``submit_at[step]``: ``(sid, limit)`` or
    ``(sid, limit, submit kwargs)`` submitted before that step); returns each session's
    tokens, checks the events (each request ends once, every running one emits a token a
    step)."""
    submit_at = submit_at or {}
    last = max(submit_at, default=-1)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, int] = {}
    for i in range(max_steps):
        for sid, limit, *kw in submit_at.get(i, []):
            dec.submit(sid, max_new_tokens=limit, **(kw[0] if kw else {}))
        if i > last and not dec.running and not dec.queued:
            break
        events = dec.step(generator=generator)
        if log is not None:
            log.append((i, [e.session_id for e in events], list(dec.queued)))
        for e in events:
            assert isinstance(e, StepOutput) and e.session_id not in finished, e
            assert e.token_ids, e  # every running request emits at least one token a step
            assert (e.finish_reason is not None) == e.finished, e
            assert e.finish_reason in (None, "eos", "stop", "length"), e
            tokens.setdefault(e.session_id, []).extend(e.token_ids)
            if e.finished:
                finished[e.session_id] = i
    assert dec.step() == [] and set(finished) == set(tokens)
    return tokens


def fail_one_level_build(monkeypatch) -> list[int]:
    """Makes the next session-tier level build run out of memory, once (after its corpus
    took the tokens); returns the list that records the corpus length it failed at."""
    from agspec_gpu.index import IndexArena
    build, failed = IndexArena._maybe_index, []

    def oom(self, cid):
        c = self._corpora[cid]
        if not failed and c.n - c.tail_start >= self.config.tail_tokens:
            failed.append(c.n)
            raise torch.OutOfMemoryError("a level build (simulated)")
        return build(self, cid)

    monkeypatch.setattr(IndexArena, "_maybe_index", oom)
    return failed


def interrupt_leaving(keep):
    """``SessionKVCache.keep`` that a Ctrl-C interrupts as a finished request leaves the
    running batch (the keep of a whole batch's end goes through)."""
    def interrupted(self, runner_, sids, contexts, rows=None, **kw):
        if rows is not None:
            raise KeyboardInterrupt
        return keep(self, runner_, sids, contexts, rows, **kw)
    return interrupted


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_requests_join_and_leave_a_running_batch_losslessly(runner):
    """Three slots, five requests of ragged lengths submitted at different steps: the
    later ones wait in the queue until a request ends, then join (their prefill gives the
    running ones one plain-decoding token); every output equals plain greedy decoding, and
    drafts were accepted along the way."""
    P = [list(p) for p in prompts()]
    dec = decoder(runner)
    full = P[3]
    steer(dec, "t0", full + greedy(VARIANT, full, 60))  # drafts that are accepted whole
    sids = [dec.open_session("t0", "coder", full)] + [
        dec.open_session(f"t{i}", "coder", P[i]) for i in (0, 2, 5, 7)]
    limits = [60, 12, 30, 20, 25]
    submit_at = {0: [(sids[0], limits[0]), (sids[1], limits[1])],
                 2: [(sids[2], limits[2]), (sids[3], limits[3]), (sids[4], limits[4])]}
    log: list = []
    out = run_until_idle(dec, log, submit_at)
    for sid, p, n in zip(sids, [full] + [P[i] for i in (0, 2, 5, 7)], limits):
        assert out[sid] == greedy(VARIANT, p, n), sid
    # the batch held at most max_batch requests; requests waited, then joined
    assert max(len(ran) for _, ran, _ in log) == 3
    assert any(q for _, _, q in log)
    assert dec.stats["accepted"] > 0 and dec.stats["tokens"] > dec.stats["steps"]
    # the sessions kept their KV and continue with generate
    more = dec.generate(sids[:2], max_new_tokens=6)
    assert more[0] == greedy(VARIANT, full + out[sids[0]], 6)
    if runner == "paged":
        for sid in sids:
            dec.close_session(sid)
        cache = dec._paged.kv_cache
        assert cache.num_free_pages == cache.num_pages


def test_busy_sessions_bad_submissions_and_cancel():
    """A session with a submitted request is busy (generate, propose, append, submit raise
    naming it); bad arguments queue nothing; cancel drops a queued request and ends a
    running one (its tokens so far are plain greedy, its KV kept); closing a running
    session ends its request and frees it."""
    P = [list(p) for p in prompts()]
    dec = decoder("hf", max_batch=2)
    a, b, c, d = (dec.open_session(f"t{i}", "coder", P[i]) for i in (0, 2, 3, 6))
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.submit(a, max_new_tokens=-1)
    with pytest.raises(ValueError, match="eos_id"):
        dec.submit(a, eos_id=10**9)
    with pytest.raises(ValueError, match="stop"):
        dec.submit(a, stop=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.submit(a, max_new_tokens=0)
    with pytest.raises(KeyError):
        dec.submit("nobody")
    assert dec.queued == [] and dec.step() == []
    for s in (a, b, c):
        dec.submit(s, max_new_tokens=40, eos_id=None)
    assert dec.queued == [a, b, c]
    for call, name in ((lambda: dec.submit(a), "session_id"),
                       (lambda: dec.generate([b]), "session_ids"),
                       (lambda: dec.propose([c]), "session_ids"),
                       (lambda: dec.append(a, [1, 2]), "sid")):
        with pytest.raises(ValueError, match=f"^{name}: .*submitted request"):
            call()
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for e in dec.step():
            got.setdefault(e.session_id, []).extend(e.token_ids)
    assert dec.running == [a, b] and dec.queued == [c]
    assert [dec.session_stats(s).finish_reason for s in (a, b, c)] == [None] * 3
    dec.cancel(c)  # queued: dropped
    dec.cancel(a)  # running: leaves now, KV kept
    assert dec.running == [b] and dec.queued == []
    assert [dec.session_stats(s).finish_reason for s in (a, b, c)] == \
        ["cancelled", None, "cancelled"]
    st = dec.session_stats(a)  # it joined (its prefill's token), then two steps
    assert st.num_generated == len(got[a]) == st.num_step_tokens + 1 and st.num_steps == 2
    assert got[a] == greedy(VARIANT, P[0], len(got[a]), eos=None)
    assert dec._kv.kept_tokens(a) > 0
    assert dec.generate([a], max_new_tokens=5, eos_id=None)[0] == \
        greedy(VARIANT, P[0] + got[a], 5, eos=None)
    dec.generate([d], max_new_tokens=3)  # an idle session generates beside the batch
    dec.close_session(b)  # running: ended and freed
    assert dec.running == [] and dec._kv.kept_tokens(b) == 0
    assert dec.step() == []
    dec.cancel(a)  # idle: nothing to do


def test_a_failed_step_ends_the_running_requests_and_keeps_sessions_in_step(monkeypatch):
    """A step that raises ends the running requests (each session's context equals its
    session tier, its KV kept); queued requests stay queued and run next."""
    P = [list(p) for p in prompts()]
    dec = decoder("paged", max_batch=2)
    a, b, c = (dec.open_session(f"t{i}", "coder", P[i]) for i in (0, 3, 6))
    for s in (a, b, c):
        dec.submit(s, max_new_tokens=30, eos_id=None)
    dec.step()
    dec.step()
    propose = dec.drafter.propose
    monkeypatch.setattr(dec.drafter, "propose", lambda sids, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        dec.step()
    monkeypatch.setattr(dec.drafter, "propose", propose)
    assert dec.running == [] and dec.queued == [c]
    assert [dec.session_stats(s).finish_reason for s in (a, b, c)] == ["error", "error", None]
    for s in (a, b):
        ctx = dec._sessions[s].context
        held = dec.store.arena.corpus_tokens(dec.store.session(s).corpus).tolist()
        assert held == ctx and 0 < dec._kv.kept_tokens(s) <= len(ctx) - 1
    dec.submit(a, max_new_tokens=10, eos_id=None)
    log: list = []
    out = run_until_idle(dec, log)
    assert out[c] == greedy(VARIANT, P[6], 30, eos=None)
    ctx_a = dec._sessions[a].context
    assert ctx_a[-10:] == out[a] == greedy(VARIANT, ctx_a[:-10], 10, eos=None)
    assert dec.store.nbytes(tier=CorpusTier.SESSION, tenant="t0") > 0


def test_a_failed_join_prefill_drops_the_handed_over_views(monkeypatch):
    """``hf``: a join hands the running requests' KV to the new batch as views of the old
    batch's whole cache. If that prefill fails (say for memory), the views are dropped, not
    kept alive with the whole cache; those sessions prefill anew at their next request, and
    their output is still plain greedy decoding."""
    from agspec_gpu.runners.hf import HFRunner
    P = [list(p) for p in prompts()]
    dec = decoder("hf")
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[1])
    dec.submit(a, max_new_tokens=30, eos_id=None)
    dec.step()
    dec.step()
    prefill = HFRunner.prefill

    def oom(self, *args, **kw):
        raise MemoryError("no room for the joined batch")

    monkeypatch.setattr(HFRunner, "prefill", oom)
    dec.submit(b, max_new_tokens=5, eos_id=None)
    with pytest.raises(MemoryError):
        dec.step()
    monkeypatch.setattr(HFRunner, "prefill", prefill)
    assert dec.running == [] and dec.session_stats(a).finish_reason == "error"
    kept = dec._kv._kept[a]
    assert kept.tensors is None and not kept.views and dec._kv.kept_tokens(a) == 0
    ctx = list(dec._sessions[a].context)
    held = dec.store.arena.corpus_tokens(dec.store.session(a).corpus).tolist()
    assert held == ctx
    dec.submit(a, max_new_tokens=6, eos_id=None)
    dec.submit(b, max_new_tokens=5, eos_id=None)
    out = run_until_idle(dec)
    assert out[a] == greedy(VARIANT, ctx, 6, eos=None)
    assert out[b] == greedy(VARIANT, P[1], 5, eos=None)
    assert not any(k.views for k in dec._kv._kept.values())


def test_a_step_whose_batch_also_fails_to_end_raises_the_first_error_with_a_note(
        monkeypatch):
    """The error that failed the step is the one raised; a second one while ending the
    batch is noted on it, not raised in its place, and the batch is gone either way."""
    from agspec_gpu.running_batch import RunningBatch
    dec = decoder("paged", max_batch=2)
    a = dec.open_session("t0", "coder", list(prompts()[0]))
    dec.submit(a, max_new_tokens=30, eos_id=None)
    dec.step()
    monkeypatch.setattr(dec.drafter, "propose", lambda sids, **kw: 1 / 0)
    monkeypatch.setattr(RunningBatch, "end", lambda self, handover=False: [][0])
    with pytest.raises(ZeroDivisionError) as info:
        dec.step()
    assert any("ending the running batch failed too: IndexError" in n
               for n in info.value.__notes__)
    assert dec.running == [] and dec.queued == []


def four_outgrowing_the_pool() -> tuple[SpecDecoder, list[list[int]], list[str]]:
    """Four requests of 70 tokens submitted under optimistic admission to a pool of 40
    pages of 8: the newest is preempted once the batch outgrows it."""
    P = [list(prompts()[i]) for i in (1, 0, 4, 6)]
    dec = decoder("paged", kv_cache_tokens=8 * 40, max_batch=4, admission="optimistic",
                  drafter=DrafterConfig(max_nodes=8))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    for sid in sids:
        dec.submit(sid, max_new_tokens=70, eos_id=None)
    return dec, P, sids


def test_a_cancel_whose_batch_fails_to_end_leaves_no_batch_running(monkeypatch):
    """A cancel that ends the batch (its only request) and fails there (a Ctrl-C while its
    KV is kept) raises, and leaves no ended batch behind: the cancelled request never
    emits again, its session takes a new request, and the next one runs alone."""
    from agspec_gpu.session_kv import SessionKVCache
    P = [list(p) for p in prompts()]
    dec = decoder("hf", max_batch=2)
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[2])
    dec.submit(a, max_new_tokens=30, eos_id=None)
    dec.step()
    dec.step()
    ctx_a = list(dec._sessions[a].context)

    def interrupted(self, *args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(SessionKVCache, "keep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dec.cancel(a)
    monkeypatch.undo()
    assert dec.running == [] and dec.session_stats(a).finish_reason == "cancelled"
    dec.submit(b, max_new_tokens=5, eos_id=None)
    assert run_until_idle(dec) == {b: greedy(VARIANT, P[2], 5, eos=None)}
    assert dec._sessions[a].context == ctx_a
    dec.submit(a, max_new_tokens=4, eos_id=None)
    assert run_until_idle(dec) == {a: greedy(VARIANT, ctx_a, 4, eos=None)}



def test_a_failed_cancel_reports_the_other_requests_it_ended_to_the_loop(monkeypatch):
    """A cancel whose leaving fails ends the whole batch (as a failed step does) and raises
    in the cancelling thread; the other running requests ended with it: the loop's next
    step returns each of them finished with ``"error"`` (they had vanished from
    ``running`` unreported, a client waiting on them forever). The HF runner's row
    selection is all or nothing, so the KV of the ended batch is kept as far as it was."""
    from agspec_gpu.runners.hf import HFRunner
    P = [list(p) for p in prompts()]
    dec = decoder("hf", max_batch=3)
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[2])
    dec.submit(a, max_new_tokens=30, eos_id=None)
    rb = dec.submit(b, max_new_tokens=30, eos_id=None)
    streamed = []
    for _ in range(3):
        streamed += [t for o in dec.step() if o.session_id == b for t in o.token_ids]
    select = HFRunner.select_rows
    copied = []

    def out_of_memory(self, rows):
        copied.append(rows)
        raise torch.OutOfMemoryError("copying the padded cache (simulated)")

    monkeypatch.setattr(HFRunner, "select_rows", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        dec.cancel(a)
    monkeypatch.setattr(HFRunner, "select_rows", select)
    assert copied and dec.running == [] and dec.session_stats(b).finish_reason == "error"
    assert dec.step() == [StepOutput(b, [], True, "error", rb)]
    assert dec.step() == []
    ctx_b = list(dec._sessions[b].context)
    assert ctx_b == P[2] + streamed
    dec.submit(b, max_new_tokens=4, eos_id=None)
    assert run_until_idle(dec) == {b: greedy(VARIANT, ctx_b, 4, eos=None)}


def test_hf_row_selection_that_fails_leaves_the_batch_as_it_was():
    """``HFRunner.select_rows`` set the lengths before it copied the layers: a copy out of
    memory left the runner's lengths for the smaller batch over the old KV. (A layer whose
    keys raise when indexed stands in for the copy that fails: patching
    ``torch.Tensor.__getitem__`` would leave the tensor type a sequence for the process.)"""
    P = [list(p) for p in prompts()]
    runner = HFRunner(model(VARIANT))
    runner.prefill([P[0], P[2], P[1]])

    class Unindexable:
        def numel(self):
            return 1

        def __getitem__(self, key):
            raise torch.OutOfMemoryError("a layer's copy (simulated)")

    runner._cached_layers()[1].keys = Unindexable()
    before = (list(runner._lens_host), runner._seq_lens.clone(), runner._width,
              [(la.keys, la.values) for la in runner._cached_layers()])
    with pytest.raises(torch.OutOfMemoryError):
        runner.select_rows([2, 0])
    assert runner._lens_host == before[0] and torch.equal(runner._seq_lens, before[1])
    assert runner._width == before[2] and all(
        la.keys is k and la.values is v
        for la, (k, v) in zip(runner._cached_layers(), before[3]))

def test_a_preemption_that_fails_ends_the_preempted_request_too(monkeypatch):
    """An error while the newest request leaves the batch to wait (here: building the
    smaller batch's sampling rows) ends it with ``"error"`` beside the running ones,
    instead of leaving it neither queued, running nor ended."""
    from agspec_gpu.running_batch import RunningBatch
    dec, P, sids = four_outgrowing_the_pool()
    preempt, sampling, inside = RunningBatch.preempt, SpecDecoder._sampling, []

    def preempting(self):
        inside.append(True)
        try:
            return preempt(self)
        finally:
            inside.pop()

    def failing(self, *args, **kw):
        if inside:
            raise KeyboardInterrupt
        return sampling(self, *args, **kw)

    monkeypatch.setattr(RunningBatch, "preempt", preempting)
    monkeypatch.setattr(SpecDecoder, "_sampling", failing)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(200):
            dec.step()
    monkeypatch.undo()
    assert dec.running == [] and dec.queued == []
    assert [dec.session_stats(s).finish_reason for s in sids] == ["error"] * 4


@pytest.mark.parametrize("when", ["prefill", "step"])
def test_a_level_build_failing_after_the_tier_grew_keeps_context_and_tier_in_step(
        when, monkeypatch):
    """A session tier's level build that runs out of memory after its corpus took the
    emitted tokens (the first token after a prefill, or a verified step's): the step
    raises, the session's context takes the same tokens, so context and tier stay equal
    and the session goes on as plain greedy decoding. Those tokens are reported: the next
    ``step()`` returns them first (finished, ``"error"``), so the outputs spell the
    context, and the stats count them (they had been in the context, never returned)."""
    from agspec_gpu.tiers import TierConfig
    P = [list(p) for p in prompts()]
    tail = 6 if when == "prefill" else 16  # the 5-token prompt's first token fills it
    dec = decoder("hf", max_batch=2, tiers=TierConfig(tail_tokens=tail, max_depth=4))
    a = dec.open_session("t0", "coder", P[0])
    assert len(P[0]) == 5
    failed = fail_one_level_build(monkeypatch)
    rid = dec.submit(a, max_new_tokens=40, eos_id=None)
    got = []
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(40):
            got += [o.token_ids for o in dec.step()]
    monkeypatch.undo()
    last = dec.step()
    assert [(o.session_id, o.finished, o.finish_reason, o.request_id) for o in last] == \
        [(a, True, "error", rid)]
    assert dec.step() == [] and dec.running == [] and dec.queued == []
    got += [last[0].token_ids]
    ctx = list(dec._sessions[a].context)
    held = dec.store.arena.corpus_tokens(dec.store.session(a).corpus).tolist()
    assert failed == [len(ctx)] and held == ctx and len(ctx) > len(P[0])
    assert ctx == P[0] + [t for toks in got for t in toks]
    st = dec.session_stats(a)
    assert st.finish_reason == "error" and st.num_generated == len(ctx) - len(P[0]) == \
        st.num_step_tokens + 1  # (+ the prefill's token)
    assert dec.generate([a], max_new_tokens=6, eos_id=None) == [greedy(VARIANT, ctx, 6,
                                                                       eos=None)]
    held = dec.store.arena.corpus_tokens(dec.store.session(a).corpus).tolist()
    assert held == dec._sessions[a].context


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_a_join_that_fails_handing_the_batch_over_ends_the_joining_requests(runner,
                                                                          monkeypatch):
    """A join that fails while the running batch hands its KV over (a Ctrl-C there): the
    joining requests, already out of the queue, end with ``"error"`` beside the running
    ones, instead of being neither queued, running nor ended (a server loop stepping
    while anything runs or waits would never finish them). Both sessions go on losslessly."""
    from agspec_gpu.session_kv import SessionKVCache
    P = [list(p) for p in prompts()]
    dec = decoder(runner)
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[2])
    dec.submit(a, max_new_tokens=30, eos_id=None)
    dec.step()
    dec.step()
    dec.submit(b, max_new_tokens=10, eos_id=None)
    keep = SessionKVCache.keep

    def interrupted(self, *args, handover=False, **kw):
        if handover:
            raise KeyboardInterrupt
        return keep(self, *args, handover=handover, **kw)

    monkeypatch.setattr(SessionKVCache, "keep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dec.step()
    monkeypatch.undo()
    assert dec.running == [] and dec.queued == []
    assert [dec.session_stats(s).finish_reason for s in (a, b)] == ["error", "error"]
    ctx = [list(dec._sessions[s].context) for s in (a, b)]
    assert ctx[1] == P[2]
    for s in (a, b):
        dec.submit(s, max_new_tokens=6, eos_id=None)
    out = run_until_idle(dec)
    assert [out[a], out[b]] == [greedy(VARIANT, c, 6, eos=None) for c in ctx]


def test_a_kv_copy_out_of_memory_as_a_request_leaves_still_returns_the_step(monkeypatch):
    """``hf``: a request that ends leaves the batch with a copy of its KV; a copy that runs
    out of memory keeps nothing for that session (its next call prefills it) rather than
    failing the step, whose tokens are already in every session's context: each token a
    context took is one ``step`` returned, and the other request runs on."""
    P = [list(p) for p in prompts()]
    dec = decoder("hf")
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[2])
    dec.submit(a, max_new_tokens=8, eos_id=None)
    dec.submit(b, max_new_tokens=20, eos_id=None)
    session_kv = HFRunner.session_kv

    def oom(self, b_, length, *, copy=True):
        if copy:
            raise torch.OutOfMemoryError("no room for the leaving request's KV")
        return session_kv(self, b_, length, copy=copy)

    dec.step()
    monkeypatch.setattr(HFRunner, "session_kv", oom)
    out = run_until_idle(dec)
    monkeypatch.undo()
    assert dec._kv.kept_tokens(a) == dec._kv.kept_tokens(b) == 0
    for s, p, n in ((a, P[0], 8), (b, P[2], 20)):
        assert dec._sessions[s].context == p + greedy(VARIANT, p, n, eos=None)
        assert dec.session_stats(s).finish_reason == "length"
        assert out[s] == dec._sessions[s].context[len(p) + 1:]  # after the first step's
    before = dec.stats["prefill_tokens"]
    assert dec.generate([a], max_new_tokens=4, eos_id=None) == \
        [greedy(VARIANT, dec._sessions[a].context[:-4], 4, eos=None)]
    assert dec.stats["prefill_tokens"] - before == len(P[0]) + 8


def test_a_request_the_kv_pool_cannot_hold_beside_the_batch_waits_for_room():
    """Admission reserves KV: a long prompt submitted while a request runs waits in the
    queue (and the request behind it too: in order) instead of joining and running the
    batch out of pages, which would end both; it joins once the pool holds it. A request
    whose context fits nowhere, not even alone in an empty pool, is refused when submitted
    (a generate call of it runs none of its sessions): nothing queues, nothing changes.
    Every output is plain greedy decoding."""
    from agspec_gpu import KVCacheFull
    P = [list(p) for p in prompts()]
    long = sum(P, [])[:200]  # 26 of the pool's 32 pages of 8
    dec = decoder("paged", kv_cache_tokens=8 * 32, max_batch=3)
    a, b, c = (dec.open_session(f"t{i}", "coder", p)
               for i, p in enumerate((P[0], long, P[1])))
    huge = dec.open_session("t3", "coder", sum(P, [])[:300])  # more than the whole pool
    dec.submit(a, max_new_tokens=40, eos_id=None)
    first = dec.step()[0].token_ids
    dec.submit(b, max_new_tokens=10, eos_id=None)
    dec.submit(c, max_new_tokens=5, eos_id=None)  # it would fit, but waits behind B
    log: list = []
    out = run_until_idle(dec, log)
    waited = [i for i, ran, queued in log if queued == [b, c]]
    assert waited and all(ran == [a] for i, ran, _ in log if i in waited)
    assert not any(a in ran and b in ran for _, ran, _ in log)  # B never ran beside A
    assert first + out[a] == greedy(VARIANT, P[0], 40, eos=None)
    assert out[b] == greedy(VARIANT, long, 10, eos=None)
    assert out[c] == greedy(VARIANT, P[1], 5, eos=None)
    refused = rf"kv_cache_tokens: session '{huge}''s context \(300 tokens\)"
    with pytest.raises(KVCacheFull, match=refused):
        dec.submit(huge, max_new_tokens=5)
    assert dec.queued == [] and dec.session_stats(huge).finish_reason is None
    ctx = list(dec._sessions[c].context)
    with pytest.raises(KVCacheFull, match=refused):  # before C emits anything
        dec.generate([c, huge], max_new_tokens=5, eos_id=None)
    assert dec._sessions[c].context == ctx and dec.stats["prefills"] == 3
    dec.submit(a, max_new_tokens=5, eos_id=None)
    ctx = list(dec._sessions[a].context)
    assert run_until_idle(dec)[a] == greedy(VARIANT, ctx, 5, eos=None)


def test_a_step_short_of_pages_frees_idle_kv_first():
    """A generate call beside the running batch leaves its session's KV in the pool; when
    the batch's next step needs those pages, that idle KV is freed (least recently used
    first: the batch's growth outranks it, as at a join) rather than a draft cut to
    nothing and every running request ended by KVCacheFull; outputs stay plain greedy
    decoding, and the evicted session prefills again at its next call."""
    P = [list(prompts()[1]), sum((list(p) for p in prompts()), [])[:200]]  # 23, 200 tokens
    dec = decoder("paged", kv_cache_tokens=8 * 32)
    a, c = (dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P))
    dec.submit(a, max_new_tokens=100, eos_id=None)
    got = dec.step()[0].token_ids + dec.step()[0].token_ids
    # C's 200 tokens take 26 of the 32 pages and stay there when its call ends
    assert dec.generate([c], max_new_tokens=2, eos_id=None) == \
        [greedy(VARIANT, P[1], 2, eos=None)]
    assert dec._kv.kept_tokens(c) > 0
    out = run_until_idle(dec)
    assert got + out[a] == greedy(VARIANT, P[0], 100, eos=None)
    assert dec._kv.kept_tokens(a) > 100 and dec._kv.kept_tokens(c) == 0  # C made room
    ctx = list(dec._sessions[c].context)
    assert dec.generate([c], max_new_tokens=4, eos_id=None) == \
        [greedy(VARIANT, ctx, 4, eos=None)]


def test_generate_beside_a_batch_that_holds_the_pool_says_so():
    """A ``generate`` call cannot preempt the submitted requests' batch (each runs its own
    scheduler): when that batch holds the pages the call needs, KVCacheFull says how many
    the running requests hold, before any of the call's sessions runs (or, for a request
    that fits at first and outgrows the pages left, at its step, its tokens kept); the
    batch runs on,
    plain greedy, and the call succeeds once it ended."""
    from agspec_gpu import KVCacheFull
    P = [list(p) for p in prompts()]
    long = sum(P, [])[:200]  # 26 of the pool's 32 pages of 8
    dec = decoder("paged", kv_cache_tokens=8 * 32)
    a, b = dec.open_session("t0", "coder", long), dec.open_session("t1", "coder", P[3])
    dec.submit(a, max_new_tokens=20, eos_id=None)
    first = dec.step()[0].token_ids
    held = dec._paged.kv_cache.capacity(a) // 8
    small = dec.open_session("t3", "coder", P[0])
    with pytest.raises(KVCacheFull, match=f"beside the running requests' {held}"):
        # 97 tokens: 13 pages; the small session fits, but does not run first
        dec.generate([small, b], max_new_tokens=4, eos_id=None)
    assert dec._sessions[b].context == P[3] and dec._sessions[small].context == P[0]
    assert dec.running == [a] and dec.session_stats(small).finish_reason is None
    # a request whose context and first step fit beside the batch but whose growth does
    # not: its call runs until the pages left are spent, then its step says who holds them;
    # what it emitted stays in its session (plain greedy)
    c = dec.open_session("t2", "coder", P[1])
    with pytest.raises(KVCacheFull, match=f"held by this batch's 1 sessions, {held} by other"):
        dec.generate([c], max_new_tokens=60, eos_id=None)
    got = dec._sessions[c].context[len(P[1]):]
    assert 0 < len(got) < 60 and got == greedy(VARIANT, P[1], len(got), eos=None)
    assert dec.session_stats(c).finish_reason == "error" and dec.running == [a]
    assert first + run_until_idle(dec)[a] == greedy(VARIANT, long, 20, eos=None)
    assert dec.generate([b], max_new_tokens=4, eos_id=None) == \
        [greedy(VARIANT, P[3], 4, eos=None)]


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_finish_reasons_say_why_each_request_ended(runner):
    """Three requests in one batch end by their end token, a stop string and their limit;
    ``StepOutput.finish_reason`` says which, on the step that ends each (None before)."""
    P = [list(p) for p in prompts()]
    refs = [greedy(VARIANT, P[i], 12, eos=None) for i in (1, 4, 6)]
    k = next(i for i in range(3, 12) if refs[0][i] not in refs[0][:i])
    stop_text = tok().decode(refs[1][:5])
    dec = decoder(runner)
    a, b, c = (dec.open_session(f"t{i}", "coder", P[j]) for i, j in enumerate((1, 4, 6)))
    dec.submit(a, max_new_tokens=12, eos_id=refs[0][k])
    dec.submit(b, max_new_tokens=12, eos_id=None, stop=stop_text)
    dec.submit(c, max_new_tokens=7, eos_id=None)
    reasons: dict[str, str] = {}
    out: dict[str, list[int]] = {}
    while dec.running or dec.queued:
        for e in dec.step():
            assert e.session_id not in reasons
            out.setdefault(e.session_id, []).extend(e.token_ids)
            if e.finished:
                reasons[e.session_id] = e.finish_reason
            else:
                assert e.finish_reason is None
    assert reasons == {a: "eos", b: "stop", c: "length"}
    assert {s: dec.session_stats(s).finish_reason for s in reasons} == reasons
    assert out[a] == refs[0][:k + 1] and out[c] == refs[2][:7]
    assert out[b] == refs[1][:len(out[b])] and tok().decode(out[b]).endswith(stop_text)


def test_every_nvtx_colour_is_one_nvtx_knows_without_matplotlib():
    """Under a profiler nvtx looks a colour name up in its own table, and any other name in
    matplotlib (not a dependency): ``color="gray"`` raised TypeError at the first
    ``open_session`` under ``nsys`` where matplotlib was missing."""
    import re
    from pathlib import Path

    builtin = {"green", "blue", "yellow", "purple", "rapids", "cyan", "red", "white",
               "darkgreen", "orange"}  # nvtx 0.2's table
    root = Path(__file__).resolve().parent.parent
    used = {(str(f.relative_to(root)), c) for d in ("agspec_gpu", "kernels", "bench")
            for f in (root / d).rglob("*.py")
            for c in re.findall(r'color="([^"]*)"', f.read_text())}
    assert used and {c for _, c in used} & builtin
    assert not [u for u in used if u[1] not in builtin]


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_a_step_marks_its_phases_with_nvtx_ranges(runner, monkeypatch):
    """What nsys shows of a speculative step: propose, verify and commit in that order, the
    drafter's own part nested in propose and commit (the user's loop marks the same)."""
    import contextlib

    import nvtx

    ranges: list[tuple[int, str]] = []
    depth = [0]

    @contextlib.contextmanager
    def annotate(message=None, **kw):
        ranges.append((depth[0], message))
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    P = list(prompts()[3])
    dec = decoder(runner)
    steer(dec, "t0", P + greedy(VARIANT, P, 20, eos=None))
    sid = dec.open_session("t0", "coder", P)
    dec.submit(sid, max_new_tokens=12, eos_id=None)
    dec.step()  # the join: a prefill, no ranges of a speculative step
    monkeypatch.setattr(nvtx, "annotate", annotate)
    dec.step()
    assert ranges == [(0, "agspec.propose"), (1, "agspec.drafter.propose"),
                      (0, "agspec.verify"), (0, "agspec.commit"),
                      (1, "agspec.drafter.commit")]
    ranges.clear()
    sid2 = dec.open_session("t0", "coder", P)  # message-boundary work has its own ranges
    assert ranges == [(0, "agspec.drafter.open_session")]
    ranges.clear()
    draft = dec.propose([sid2])
    assert ranges == [(0, "agspec.propose"), (1, "agspec.drafter.propose")] and draft


def test_sampled_and_greedy_requests_share_a_batch():
    """A sampled request next to greedy ones (joining at different steps): the greedy ones
    stay plain greedy, the sampled one emits its limit; a seeded generator repeats it."""
    P = [list(p) for p in prompts()]
    runs = []
    for _ in range(2):
        dec = decoder("hf")
        a, b = dec.open_session("t0", "coder", P[3]), dec.open_session("t1", "coder", P[7])
        sampled = {"eos_id": None, "sampling": SamplingParams(temperature=0.9, top_k=50)}
        out = run_until_idle(dec, submit_at={0: [(a, 24, sampled)],
                                             3: [(b, 20, {"eos_id": None})]},
                             generator=torch.Generator().manual_seed(7))
        assert out[b] == greedy(VARIANT, P[7], 20, eos=None)
        assert len(out[a]) == 24
        runs.append(out[a])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_agent_turns_through_the_step_api(runner, monkeypatch):
    """The agent loop a server runs: a request finishes, its agent appends the tool output
    right away (the session is idle once step() returns) and submits its next turn while
    the other agent's request keeps running; every turn equals plain greedy decoding of the
    session's whole context, and the next turn prefills only the appended output."""
    P = [list(p) for p in prompts()]
    dec = decoder(runner, max_batch=2)
    tool = tok().encode("$ pytest -q\n1 failed, 3 passed in 0.31s\n")
    sids = [dec.open_session("t0", "coder", P[3]), dec.open_session("t1", "coder", P[6])]
    prefills = record_prefills(dec, monkeypatch) if runner == "paged" else \
        record_hf_prefills(monkeypatch)
    limits = {sids[0]: [8, 14, 6], sids[1]: [30]}
    turns = {s: [] for s in sids}
    context = {s: list(p) for s, p in zip(sids, (P[3], P[6]))}
    for s in sids:
        dec.submit(s, max_new_tokens=limits[s][0], eos_id=None)
    current = {s: [] for s in sids}
    for _ in range(200):
        if not dec.running and not dec.queued:
            break
        for e in dec.step():
            current[e.session_id] += e.token_ids
            if not e.finished:
                continue
            s = e.session_id
            assert current[s] == greedy(VARIANT, context[s], len(current[s]), eos=None)
            context[s] += current[s]
            turns[s].append(current[s])
            current[s] = []
            if len(turns[s]) < len(limits[s]):
                dec.append(s, tool)  # idle already: no error
                context[s] += tool
                dec.submit(s, max_new_tokens=limits[s][len(turns[s])], eos_id=None)
    assert [list(map(len, turns[s])) for s in sids] == [limits[s] for s in sids]
    assert dec._sessions[sids[0]].context == context[sids[0]]
    # a join prefills the prompts, then the tool output and the last token of a resubmitted
    # session, and one token (its root) of a running one
    assert prefills[0] == [len(P[3]), len(P[6])] and len(prefills) == 3
    assert all(c.count(len(tool) + 1) == 1 and set(c) <= {1, len(tool) + 1}
               for c in prefills[1:]), prefills
    assert any(len(c) == 2 for c in prefills[1:])  # joined a running request


def test_bench_continuous_smoke(tmp_path):
    """``bench/bench_continuous.py`` on two agents of two real turns each: both policies emit
    every turn's tokens, and the JSON has the fields the results README quotes."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_continuous

    out = tmp_path / "c.json"
    assert bench_continuous.main(["--agents", "2", "--turns", "2", "--max-turn", "6",
                                  "--max-prompt", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    limits = sum(sum(t) for t in report["turn_limits"])
    assert [r["tokens"] for r in report["rows"]] == [limits, limits]
    for r in report["rows"]:
        assert r["turns"] == 4 and r["forwards"] == r["verification_steps"] + \
            r["prefill_forwards"] and r["turn_latency_forwards_max"] >= 1
    # a server's limit, the client stopping each turn at its length; both admissions
    assert bench_continuous.main(["--agents", "2", "--turns", "2", "--max-turn", "6",
                                  "--max-prompt", "64", "--runner", "paged",
                                  "--max-new-tokens", "40", "--admission", "reserve",
                                  "optimistic", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["admission"], r["tokens"], r["turns"]) for r in report["rows"]] == \
        [(a, limits, 4) for a in ("reserve", "reserve", "optimistic", "optimistic")]
    assert report["max_new_tokens"] == 40 and all(r["preemptions"] == 0 for r in report["rows"])


def test_a_generate_call_never_evicts_a_running_requests_kv():
    """The page pool runs short while a submitted request runs: a ``generate`` call for
    another session frees idle sessions' KV only, never the running request's (the least
    recently prefilled here), which then runs on to plain greedy decoding's output."""
    P = [list(prompts()[i]) for i in (3, 6, 1)]  # 97, 140 and 23 tokens
    dec = decoder("paged", max_batch=2, kv_cache_tokens=8 * 45)
    cache = dec._paged.kv_cache
    a, b, c = (dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P))
    dec.submit(a, max_new_tokens=40, eos_id=None)
    got = list(dec.step()[0].token_ids)  # a's prefill: its KV is the oldest in the pool
    assert dec.generate([b], max_new_tokens=16, eos_id=None)[0] == \
        greedy(VARIANT, P[1], 16, eos=None)
    assert dec.generate([c], max_new_tokens=16, eos_id=None)[0] == \
        greedy(VARIANT, P[2], 16, eos=None)
    assert a in cache and b not in cache  # b, idle, made room
    while dec.running:
        got += dec.step()[0].token_ids
    assert got == greedy(VARIANT, P[0], 40, eos=None)


def test_optimistic_admission_runs_more_requests_and_preempts_the_newest():
    """``admission="optimistic"``: four requests whose limits the pool cannot hold together
    all start at once (``"reserve"`` runs three, the fourth waits); when the batch outgrows
    the pool, its newest request goes back to the head of the queue (ahead of a later
    submission) and rejoins once there is room. Every output, the preempted greedy one's
    and a seeded one's, is what plain decoding gives, and it took fewer steps."""
    P = [list(prompts()[i]) for i in (1, 0, 4, 6)]  # 23, 5, 1 and 140 tokens
    seeded = SamplingParams(temperature=0.8, seed=11)
    late = list(prompts()[5])
    steps = {}
    for admission in ("reserve", "optimistic"):
        dec = decoder("paged", kv_cache_tokens=8 * 40, max_batch=4, admission=admission,
                      drafter=DrafterConfig(max_nodes=8))
        sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
        e = dec.open_session("t4", "coder", late)
        kw = [dict(eos_id=None)] * 3 + [dict(eos_id=None, sampling=seeded)]
        log: list = []
        out = run_until_idle(dec, log, submit_at={
            0: [(s, 70, k) for s, k in zip(sids, kw)], 1: [(e, 8, dict(eos_id=None))]})
        for sid, p in zip(sids[:3], P):
            assert out[sid] == greedy(VARIANT, p, 70, eos=None), (admission, sid)
        assert out[sids[3]] == seeded_sample(VARIANT, P[3], 70, seeded, eos=None)
        assert out[e] == greedy(VARIANT, late, 8, eos=None)
        assert [dec.session_stats(s).finish_reason for s in sids + [e]] == ["length"] * 5
        steps[admission] = len(log)
        if admission == "reserve":
            assert log[0][1] == sids[:3] and dec.stats["preemptions"] == 0
            continue
        assert log[0][1] == sids and dec.stats["preemptions"] >= 1
        cut = next(i for i, ran, _ in log if sids[3] not in ran)
        assert log[cut][2] == [sids[3], e]  # preempted: at the head, ahead of e
        assert any(sids[3] in ran for _, ran, _ in log[cut:])  # it rejoined
    assert steps["optimistic"] < steps["reserve"], steps


@pytest.mark.parametrize("then", ["cancel", "close"])
def test_a_preempted_request_can_be_cancelled_or_closed_while_it_waits(then):
    """A preempted request waits like a queued one: ``cancel`` ends it at what it emitted
    (plain greedy so far; its session takes ``append`` and a new request, which continues
    as plain greedy decoding), ``close_session`` frees its KV; the others run on."""
    dec, P, sids = four_outgrowing_the_pool()
    out: dict[str, list[int]] = {s: [] for s in sids}
    last = sids[3]
    for _ in range(100):  # until the newest is preempted
        for e in dec.step():
            out[e.session_id] += e.token_ids
        if dec.queued:
            break
    assert dec.queued == [last] and len(dec.running) == 3
    assert 0 < len(out[last]) < 70 and out[last] == greedy(VARIANT, P[3], len(out[last]),
                                                           eos=None)
    if then == "cancel":
        dec.cancel(last)
        assert dec.session_stats(last).finish_reason == "cancelled" and not dec.queued
        tool = tok().encode("$ ls\n")
        dec.append(last, tool)
        ctx = P[3] + out[last] + tool
        dec.submit(last, max_new_tokens=6, eos_id=None)
    else:
        dec.close_session(last)
        assert last not in dec._paged.kv_cache and not dec.queued
    rest = run_until_idle(dec)
    for sid, p in zip(sids[:3], P):
        assert out[sid] + rest[sid] == greedy(VARIANT, p, 70, eos=None)
    if then == "cancel":
        assert rest[last] == greedy(VARIANT, ctx, 6, eos=None)


@pytest.mark.parametrize("seed", [1])
def test_random_requests_outgrowing_the_pool_stay_plain_decoding(seed):
    """Optimistic admission, random long requests of five sessions on a pool that holds
    two or three: requests are preempted and rejoin while others are cancelled or
    submitted anew; every greedy request's tokens are plain greedy decoding and every
    seeded one's plain seeded sampling."""
    import random

    rng = random.Random(seed)
    # (no top_k: two logits within float noise of each other at its boundary, a near tie
    # the batched runner and the one-token reference may break apart, move the CDF by a
    # token's probability; seen with top_k=50: a 4.8e-7 gap moved it by 2.4e-4)
    seeded = SamplingParams(temperature=0.9, seed=seed)
    which = (3, 6, 2, 5, 7)  # 97, 140, 60, 44 and 41 tokens; the pool: 320
    dec = decoder("paged", kv_cache_tokens=8 * 40, max_batch=4, admission="optimistic",
                  drafter=DrafterConfig(max_nodes=rng.choice([4, 8, 16])))
    sids = [dec.open_session(f"t{i % 2}", "coder", list(prompts()[i])) for i in which]
    ctx = {s: list(prompts()[i]) for s, i in zip(sids, which)}
    req: dict[str, tuple] = {}  # sid -> (context at submission, limit, params, tokens)
    ended = whole = 0
    for _ in range(400):
        busy = set(dec.running) | set(dec.queued)
        for s in sids:
            if s not in busy and rng.random() < 0.5 and ended < 12:
                if s in req:  # its request that ended: plain decoding's tokens
                    base, n, params, toks = req[s]
                    want = greedy(VARIANT, base, n, eos=None) if params is None else \
                        seeded_sample(VARIANT, base, n, params, eos=None)
                    assert toks == want[:len(toks)], (s, len(toks), n)
                    if dec.session_stats(s).finish_reason == "length":  # not cancelled
                        assert len(toks) == n, (s, len(toks), n)
                        whole += 1
                params = seeded if rng.random() < 0.3 else None
                n = rng.randint(20, 90)
                dec.submit(s, max_new_tokens=n, sampling=params, eos_id=None)
                req[s] = (list(ctx[s]), n, params, [])
        if busy and rng.random() < 0.03:
            s = rng.choice(sorted(busy))
            dec.cancel(s)
            ended += 1
        if not dec.running and not dec.queued:
            break
        for e in dec.step():
            req[e.session_id][3].extend(e.token_ids)
            ctx[e.session_id] += e.token_ids
            ended += e.finished
    for s, (base, n, params, toks) in req.items():  # the last request of each session
        want = greedy(VARIANT, base, n, eos=None) if params is None else \
            seeded_sample(VARIANT, base, n, params, eos=None)
        assert toks == want[:len(toks)], (s, len(toks), n)
        if dec.session_stats(s).finish_reason == "length":
            assert len(toks) == n, (s, len(toks), n)
            whole += 1
    assert whole >= 4  # requests that ran to their limit, each checked whole
    assert not dec.running and not dec.queued
    assert dec.stats["preemptions"] >= 2, dec.stats
    for s in sids:
        assert dec._sessions[s].context == ctx[s]


def test_preempting_several_requests_queues_them_in_their_batch_order():
    """When one step needs two requests out, the two newest go back to the head of the
    queue in their batch order (ahead of what waited before); never the last one."""
    from agspec_gpu.requests import Requests, SessionState
    from agspec_gpu.scheduler import Scheduler

    def reqs(sids):
        return Requests.build(sids, [SessionState("t", "coder", [1]) for _ in sids], 5,
                              None, (), True, None, 10, tok())

    class Live:
        def __init__(self, sids, room):
            self.reqs, self.room = reqs(sids), room

        def step_fits(self):
            return len(self.reqs.sids) <= self.room

        def preempt(self):
            row = self.reqs.row(len(self.reqs.sids) - 1)
            self.reqs.select(list(range(len(self.reqs.sids) - 1)))
            return row

    sched = Scheduler(4, None, None, None)
    sched.submit(reqs(["e"]))
    live = Live(["a", "b", "c", "d"], room=2)
    sched._preempt(live)
    assert live.reqs.sids == ["a", "b"] and sched.queued == ["c", "d", "e"]
    assert sched.num_preemptions == 2
    live = Live(["a"], room=0)  # a lone request is never preempted (its step raises)
    sched._preempt(live)
    assert live.reqs.sids == ["a"] and sched.num_preemptions == 2


def test_generate_with_optimistic_admission_preempts_within_the_call():
    """``generate`` runs its requests through its own scheduler: optimistic admission and
    preemption there too (counted in ``stats`` as they happen: a streaming callback sees
    them), the outputs plain greedy decoding."""
    P = [list(prompts()[i]) for i in (1, 0, 4, 6)]
    dec = decoder("paged", kv_cache_tokens=8 * 40, max_batch=4, admission="optimistic",
                  drafter=DrafterConfig(max_nodes=8))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    seen = []
    assert dec.generate(sids, max_new_tokens=70, eos_id=None,
                        on_tokens=lambda sid, toks: seen.append(dec.stats["preemptions"])) == \
        [greedy(VARIANT, p, 70, eos=None) for p in P]
    assert seen[-1] == dec.stats["preemptions"] >= 1


@pytest.mark.parametrize("runner,seed", [("hf", 0), ("paged", 1)])
def test_random_interleavings_stay_plain_greedy(runner, seed):
    """Random submits, steps, cancels, appends and ``generate`` calls over five sessions
    (three run at once): every token any of them emits equals plain greedy decoding of the
    session's context at that point, and each session's context is what was appended and
    emitted, in order."""
    import random

    rng = random.Random(seed)
    P = [list(p) for p in prompts()]
    tool = tok().encode("$ ls\nsetup.py  src  tests\n")
    dec = decoder(runner)
    sids = [dec.open_session(f"t{i % 2}", "coder", P[i]) for i in (0, 2, 3, 5, 7)]
    ctx = {s: list(P[i]) for s, i in zip(sids, (0, 2, 3, 5, 7))}
    start = {}  # sid -> its context when its submitted request started

    def check(sid, toks):
        base = start.get(sid, ctx[sid])
        done = ctx[sid][len(base):] + toks
        assert done == greedy(VARIANT, base, len(done), eos=None), sid
        ctx[sid] += toks

    for _ in range(60):
        busy = set(dec.running) | set(dec.queued)
        idle = [s for s in sids if s not in busy]
        op = rng.random()
        if op < 0.3 and idle:
            s = rng.choice(idle)
            start[s] = list(ctx[s])
            dec.submit(s, max_new_tokens=rng.randint(1, 12), eos_id=None)
        elif op < 0.4 and busy:
            s = rng.choice(sorted(busy))
            dec.cancel(s)
            start.pop(s, None)
        elif op < 0.5 and idle:
            s = rng.choice(idle)
            dec.append(s, tool)
            ctx[s] += tool
        elif op < 0.6 and idle:
            batch = rng.sample(idle, min(len(idle), rng.randint(1, 3)))
            for s, out in zip(batch, dec.generate(batch, max_new_tokens=5, eos_id=None)):
                assert out == greedy(VARIANT, ctx[s], 5, eos=None), s
                ctx[s] += out
        else:
            for e in dec.step():
                check(e.session_id, e.token_ids)
                if e.finished:
                    start.pop(e.session_id)
    for s in sids:
        assert dec._sessions[s].context == ctx[s], s


def test_hf_join_hands_the_running_kv_over_without_a_copy(monkeypatch):
    """On the hf runner a join rebuilds the batch's cache: the running requests' KV goes
    to the new batch's prefill as views of the old cache (one copy, not two), even past
    the kept-KV budget (it is the new batch's at once), and the outputs stay plain greedy."""
    P = [list(p) for p in prompts()]
    dec = decoder("hf", kv_cache_tokens=64)  # a budget smaller than the running contexts
    a, b = dec.open_session("t0", "coder", P[3]), dec.open_session("t1", "coder", P[6])
    handed, prefill = [], HFRunner.prefill

    def recorded(self, input_ids, past=None):
        handed.append([kv is not None and kv.keys[0]._base is not None for kv in past])
        return prefill(self, input_ids, past)

    monkeypatch.setattr(HFRunner, "prefill", recorded)
    got = run_until_idle(dec, submit_at={0: [(a, 20, {"eos_id": None})],
                                         3: [(b, 10, {"eos_id": None})]})
    assert handed[:2] == [[False], [True, False]]  # a's KV handed over as a view at the join
    assert got[a] == greedy(VARIANT, P[3], 20, eos=None)
    assert got[b] == greedy(VARIANT, P[6], 10, eos=None)
    assert dec._kv.kept_tokens(a) == 0  # back under the budget once the batch ended


def test_own_loop_interleaves_with_served_requests():
    """An own loop's propose / commit of one session with the serving loop's steps and a
    ``generate`` of other sessions in between: the own loop drafts and commits as it does
    alone (same drafts, same controller state: its commits still feed the controller), and
    every session's output is plain greedy. A request or message of the proposed session
    itself supersedes its proposal: that commit raises."""
    P = [list(p) for p in prompts()]
    own = P[3]

    def run(interleave: bool):
        dec = decoder("hf")
        steer(dec, "t0", own + greedy(VARIANT, own, 40))
        a = dec.open_session("t0", "coder", own)
        b, c = (dec.open_session(f"t{i}", "coder", P[i]) for i in (0, 2))
        drafts, scales, served = [], [], {b: [], c: []}
        slot = dec.drafter._slot_of(a)

        def between(draft):
            drafts.append(draft.token_ids.tolist())
            if not interleave:
                return
            if len(drafts) == 1:
                dec.submit(b, max_new_tokens=12, eos_id=None)
            if len(drafts) == 4:
                served[c] += dec.generate([c], max_new_tokens=5, eos_id=None)[0]
            for e in dec.step():
                served[e.session_id] += e.token_ids

        def commit_hook(draft):  # the controller's state after the previous commit
            scales.append(dec.drafter.state.scale[slot].item())
            between(draft)

        runner = HFRunner(model(VARIANT))
        runner.prefill([own[:-1]])
        out = own_loop(dec, runner, [a], 8, between=commit_hook)[0]
        while dec.running:
            for e in dec.step():
                served[e.session_id] += e.token_ids
        return dec, (a, b, c), out, drafts, scales, served

    _, _, alone, drafts, scales, _ = run(False)
    dec, (a, b, c), out, drafts_i, scales_i, served = run(True)
    assert out == alone == greedy(VARIANT, own, len(out), eos=None)
    assert drafts_i == drafts and scales_i == scales and len(set(scales)) > 1
    assert served[b] == greedy(VARIANT, P[0], 12, eos=None)
    assert served[c] == greedy(VARIANT, P[2], 5, eos=None)
    for supersede in (lambda: dec.submit(a, max_new_tokens=2),
                      lambda: dec.append(a, [5, 6])):
        draft = dec.propose([a])
        supersede()
        run_until_idle(dec)
        with pytest.raises(ValueError, match="commit\\(\\) must follow propose"):
            dec.commit([a], draft, torch.zeros(1, 1 + draft.max_nodes, dec.vocab_size))


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_the_loops_drafter_commits_read_nothing_back(runner, monkeypatch):
    """Every drafter commit of a serving step, the first token after a join's prefill
    included, passes its counts from the host and skips validation (its ids are the model's
    own), or defers them (a speculative step's commit, queued before the step is read
    back) and settles them with the counts the host read: on a GPU a read or a check
    would wait for the device (the H100 run of 2026-12-05 caught the prefill's commit
    reading its counts and checking its ids)."""
    from agspec_gpu.drafter import Drafter
    from agspec_gpu.index import IndexArena

    calls, settles = [], []
    observe, settle = Drafter._observe, IndexArena.settle

    def recorded(self, sids, output_ids, num_output, num_accepted, num_output_host=None,
                 validate=True, path_nodes=None, num_verified=None, defer=False):
        calls.append(("deferred" if defer else num_output_host is not None, validate))
        return observe(self, sids, output_ids, num_output, num_accepted, num_output_host,
                       validate, path_nodes, num_verified, defer)

    def settled(self, counts=None, **kwargs):
        if self.unsettled is not None:
            settles.append(counts is not None)
        return settle(self, counts, **kwargs)

    monkeypatch.setattr(Drafter, "_observe", recorded)
    monkeypatch.setattr(IndexArena, "settle", settled)
    P = [list(p) for p in prompts()]
    dec = decoder(runner)
    sids = [dec.open_session("t", "coder", P[i]) for i in range(2)]
    run_until_idle(dec, submit_at={0: [(sids[0], 12)], 2: [(sids[1], 9)]})
    assert len(calls) > 4 and set(calls) == {(True, False), ("deferred", False)}, calls
    assert settles == [True] * calls.count(("deferred", False))  # no read back either


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_a_failed_step_reports_every_token_its_sessions_took(runner, monkeypatch):
    """Failure paths a fault-injection audit found out of step (every one now leaves each
    context equal to its prompt and what was reported, and the sessions go on as plain
    greedy decoding):

    * a level build that raises after the tiers took a ``generate`` step's tokens:
      ``on_tokens`` streams them (they had joined the context unreported);
    * a finished request whose KV keep raises as it leaves (a Ctrl-C): ``step()`` raises,
      the next one returns the failed step's outputs first;
    * a stop string's decode that raises in the step where another request reaches its
      limit: that request's step is taken back (``"error"``, not ``"length"`` with its
      last tokens missing);
    * the arena failing to take a deferred commit's tokens (a relocation out of memory):
      the drafter's recent-token ring is put back, in step with the context again;
    * and after each, no proposal of the failed step is left pending (it had held off
      ``set_cost`` and calibration)."""
    from agspec_gpu.index import IndexArena
    from agspec_gpu.session_kv import SessionKVCache
    from agspec_gpu.stops import StopMatcher
    from agspec_gpu.tiers import TierConfig
    P = [list(p) for p in prompts()]
    dec = decoder(runner, max_batch=2, tiers=TierConfig(tail_tokens=16, max_depth=4))
    for i in (0, 1):  # drafts that are accepted: several tokens a step
        steer(dec, f"t{i}", P[i] + greedy(VARIANT, P[i], 60))
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[1])
    streamed = {a: [], b: []}

    def in_step(sids):  # every context is its prompt and what was reported; nothing pending
        for s in sids:
            ctx = dec._sessions[s].context
            held = dec.store.arena.corpus_tokens(dec.store.session(s).corpus).tolist()
            assert held == ctx == P[0 if s == a else 1] + streamed[s], s
            ring = dec.drafter.state
            slot = dec.drafter._slot_of(s)
            n = int(ring.recent_len[slot])
            assert ring.recent[slot, ring.depth - n:].tolist() == ctx[len(ctx) - n:], s
        dec.drafter.check_between_steps("set_cost")

    failed = fail_one_level_build(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        dec.generate([a], max_new_tokens=40, eos_id=None,
                     on_tokens=lambda s, t: streamed[s].extend(t))
    monkeypatch.undo()
    assert failed and dec.session_stats(a).finish_reason == "error"
    in_step([a, b])

    interrupted = interrupt_leaving(SessionKVCache.keep)

    dec.submit(a, max_new_tokens=3, eos_id=None)
    dec.submit(b, max_new_tokens=30, eos_id=None)
    monkeypatch.setattr(SessionKVCache, "keep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            for o in dec.step():
                streamed[o.session_id] += o.token_ids
    monkeypatch.undo()
    # a next step that fails too (its join's prefill) keeps them for the one after it
    from agspec_gpu.running_batch import RunningBatch

    def no_prefill(self, generator):
        raise RuntimeError("a prefill (simulated)")

    c = dec.open_session("t2", "coder", P[2])
    dec.submit(c, max_new_tokens=3, eos_id=None)
    monkeypatch.setattr(RunningBatch, "prefill", no_prefill)
    with pytest.raises(RuntimeError, match="a prefill"):
        dec.step()
    monkeypatch.undo()
    late = dec.step()
    assert {(o.session_id, o.finish_reason) for o in late} == {(a, "length"), (b, "error")}
    for o in late:
        streamed[o.session_id] += o.token_ids
    assert dec.step() == []
    in_step([a, b])

    push, pushes = StopMatcher.push, [0]

    def failing_push(self, t):  # b's stop matching fails on its second step's token
        pushes[0] += self.stops != ()
        if pushes[0] == 2:
            raise RuntimeError("decode failed (simulated)")
        return push(self, t)

    before = dec.session_stats(a).num_generated
    monkeypatch.setattr(StopMatcher, "push", failing_push)
    with pytest.raises(RuntimeError, match="decode failed"):
        dec.generate([a, b], max_new_tokens=[2, 30], stop=[[], ["zzqq"]], eos_id=None,
                     on_tokens=lambda s, t: streamed[s].extend(t))
    monkeypatch.undo()
    st = dec.session_stats(a)
    assert st.finish_reason == "error" and st.num_generated - before == 1  # the prefill's
    in_step([a, b])

    append_rows = IndexArena.append_rows
    for deferred in (True, False):  # a step's commit, then a prefill's first token

        def relocation_fails(self, cids, tokens, counts, *args, **kw):
            if isinstance(counts, torch.Tensor) == deferred:
                raise torch.OutOfMemoryError("an arena relocation (simulated)")
            return append_rows(self, cids, tokens, counts, *args, **kw)

        dec.generate([a], max_new_tokens=2, eos_id=None,  # a step, then the failing one
                     on_tokens=lambda s, t: streamed[s].extend(t))
        monkeypatch.setattr(IndexArena, "append_rows", relocation_fails)
        with pytest.raises(torch.OutOfMemoryError):
            dec.generate([a, b], max_new_tokens=12, eos_id=None,
                         on_tokens=lambda s, t: streamed[s].extend(t))
        monkeypatch.undo()
        assert IndexArena.append_rows is append_rows
        in_step([a, b])
    for s in (a, b):
        ctx = list(dec._sessions[s].context)
        assert dec.generate([s], max_new_tokens=8, eos_id=None) == [greedy(VARIANT, ctx, 8)]


def test_own_loop_commit_whose_level_build_fails_keeps_the_step(monkeypatch):
    """An own loop's ``commit`` whose drafter settle raises after the session tier took the
    step's tokens (a level build out of memory): the context takes them too and the
    proposal is spent, so a retried commit is refused instead of appending them to the
    tier twice; the loop goes on as plain greedy decoding."""
    from agspec_gpu.tiers import TierConfig
    P = [list(p) for p in prompts()]
    dec = decoder("hf", max_batch=2, tiers=TierConfig(tail_tokens=16, max_depth=4))
    sid = dec.open_session("t0", "coder", P[5])
    runner = HFRunner(model(VARIANT))
    runner.prefill([P[5][:-1]])  # the last context token is the first root
    failed = fail_one_level_build(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(20):
            draft = dec.propose([sid])
            logits = runner.verify_padded(draft, dec.root_ids([sid]))
            res = dec.commit([sid], draft, logits)
            runner.commit(res)
    monkeypatch.undo()
    ctx = list(dec._sessions[sid].context)
    held = dec.store.arena.corpus_tokens(dec.store.session(sid).corpus).tolist()
    assert failed and held == ctx and ctx[len(P[5]):] == greedy(VARIANT, P[5],
                                                                  len(ctx) - len(P[5]))
    with pytest.raises(ValueError, match="commit\\(\\) must follow propose"):
        dec.commit([sid], draft, logits)
    assert dec.generate([sid], max_new_tokens=6, eos_id=None) == [greedy(VARIANT, ctx, 6)]


def test_a_cancelled_or_closed_session_gets_no_undelivered_output(monkeypatch):
    """A step that fails as its finished request leaves returns its outputs at the next
    step, except a session's that was cancelled, closed or given a new request in between
    (its client gone, or an output of the ended request that would read as the new
    one's)."""
    from agspec_gpu.session_kv import SessionKVCache
    P = [list(p) for p in prompts()]
    dec = decoder("hf", max_batch=3)
    a, b, c = (dec.open_session(f"t{i}", "coder", P[i]) for i in range(3))
    for s, n in ((a, 2), (b, 30), (c, 30)):
        dec.submit(s, max_new_tokens=n, eos_id=None)
    interrupted = interrupt_leaving(SessionKVCache.keep)

    monkeypatch.setattr(SessionKVCache, "keep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            dec.step()
    monkeypatch.undo()
    dec.cancel(b)
    dec.close_session(c)
    assert [o.session_id for o in dec.step()] == [a] and dec.step() == []
    with pytest.raises(KeyboardInterrupt):  # again, then a's session takes a new request
        dec.submit(a, max_new_tokens=2, eos_id=None)
        dec.submit(b, max_new_tokens=30, eos_id=None)
        monkeypatch.setattr(SessionKVCache, "keep", interrupted)
        for _ in range(10):
            dec.step()
    monkeypatch.undo()
    dec.submit(a, max_new_tokens=5, eos_id=None)
    out = dec.step()  # b's held-back output, and a's new request's first token
    assert [(o.session_id, o.finished) for o in out] == [(b, True), (a, False)]



@pytest.mark.parametrize("fault", ["corpus", "ring", "workspace"])
def test_an_open_that_fails_leaves_nothing_open(monkeypatch, fault):
    """An ``open_session`` that failed past its start (the session corpus's level build,
    the drafter's ring write, or the workspace build of the files its text shows, out of
    memory) left the session open in the store and drafter, unnamed to the caller: its
    slot, corpus and tenant held for good (max_sessions ran out after 8 such opens, the
    id could not be opened again, ``close_tenant`` refused). Nothing stays open now, and
    the failed session's text joins no history."""
    from agspec_gpu.capture import capture_tool_output
    from agspec_gpu.drafter_state import SlotState
    from agspec_gpu.index import IndexArena
    from agspec_gpu.tiers import CorpusStore
    from agspec_gpu.trajectories import load_sessions

    path = "/work/shared/data/trajectories/dev/swe_agent__claude-sonnet-4.jsonl.gz"
    shown = next(m.content for s in load_sessions(path, limit=3) for m in s.messages
                 if m.role == "tool" and capture_tool_output(None, m.content))
    dec = decoder("hf")
    ids = dec.tokenizer.encode(shown)[:300]

    def oom(*args, **kw):
        raise torch.OutOfMemoryError(f"{fault} (simulated)")

    target = {"corpus": (IndexArena, "append"), "ring": (SlotState, "push_one"),
              "workspace": (CorpusStore, "add_workspace_file")}[fault]
    monkeypatch.setattr(*target, oom)
    for _ in range(dec.config.max_sessions + 2):
        with pytest.raises(torch.OutOfMemoryError):
            dec.open_session("acme", "coder", ids, session_id="s0", text=shown)
        assert not dec._sessions and not dec.drafter.has_session("s0") and \
            not dec.store.has_session("s0") and not dec.store.arena._corpora
    monkeypatch.undo()
    assert len(dec.drafter._free) == dec.config.max_sessions
    hist = dec.store._tenants.get("acme")
    assert hist is None or hist.history is None
    dec.close_tenant("acme")
    sid = dec.open_session("acme", "coder", P0 := list(prompts()[1]), session_id="s0")
    assert dec.generate([sid], max_new_tokens=4) == [greedy(VARIANT, P0, 4)]


def test_paged_pool_operations_that_fail_leave_state_a_retry_goes_on_from(monkeypatch):
    """Faults a helper's audit of the paged path found leaving it half changed: a page
    table write that failed after the host had taken the pages (they stayed mapped to the
    null page, where a retry wrote its KV: not greedy decoding), a free that failed (the
    session's kept-KV record outlived its pages: every later call of the session raised),
    and a batch's row selection whose device copy failed (its dropped rows freed, its
    device prefix the old one's). Each raises, and what follows is greedy decoding with
    every page back in the pool at the end."""
    import agspec_gpu.runners.paged_batch as paged_batch
    from agspec_gpu.kv_cache import PagedKVCache
    P = [list(p) for p in prompts()]
    dec = decoder("paged", kv_cache_tokens=8 * 24)  # a's KV or b's, not both
    cache = dec._paged.kv_cache
    a, b = dec.open_session("t0", "coder", P[3]), dec.open_session("t1", "coder", P[6])
    index_copy = torch.Tensor.index_copy_

    def table_write_fails(self, *args):
        monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy)
        raise torch.OutOfMemoryError("the page table's write (simulated)")

    free = cache.num_free_pages
    monkeypatch.setattr(torch.Tensor, "index_copy_", table_write_fails)
    with pytest.raises(torch.OutOfMemoryError):
        dec.generate([a], max_new_tokens=6, eos_id=None)
    monkeypatch.undo()
    assert cache.num_free_pages == free and a not in cache
    assert dec.generate([a], max_new_tokens=6, eos_id=None) == [greedy(VARIANT, P[3], 6,
                                                                       eos=None)]
    pool_free = PagedKVCache.free

    def free_fails(self, seq_id):
        monkeypatch.setattr(PagedKVCache, "free", pool_free)
        raise KeyboardInterrupt

    monkeypatch.setattr(PagedKVCache, "free", free_fails)
    with pytest.raises(KeyboardInterrupt):  # b needs a's pages: a's KV is dropped
        dec.generate([b], max_new_tokens=6, eos_id=None)
    monkeypatch.undo()
    assert dec._kv.kept_tokens(a) == 0
    ctx_a = list(dec._sessions[a].context)
    assert dec.generate([a], max_new_tokens=4, eos_id=None) == [greedy(VARIANT, ctx_a, 4,
                                                                       eos=None)]
    to_device = paged_batch.to_device

    def copy_fails(*args, **kw):
        monkeypatch.setattr(paged_batch, "to_device", to_device)
        raise torch.OutOfMemoryError("the kept rows' prefix (simulated)")

    for sid in (a, b):
        dec.close_session(sid)
    assert cache.num_free_pages == cache.num_pages
    dec = decoder("paged")  # room for both
    cache = dec._paged.kv_cache
    b, c = dec.open_session("t1", "coder", P[6]), dec.open_session("t2", "coder", P[1])
    dec.submit(c, max_new_tokens=1, eos_id=None)
    dec.submit(b, max_new_tokens=30, eos_id=None)
    monkeypatch.setattr(paged_batch, "to_device", copy_fails)
    with pytest.raises(torch.OutOfMemoryError):
        dec.step()  # both join; c ends and leaves the batch, whose row selection fails
    monkeypatch.undo()
    assert dec.running == [] and dec.session_stats(b).finish_reason == "error"
    ctx_b = list(dec._sessions[b].context)
    dec.submit(b, max_new_tokens=5, eos_id=None)
    assert run_until_idle(dec)[b] == greedy(VARIANT, ctx_b, 5, eos=None)
    for sid in (b, c):
        dec.close_session(sid)
    assert cache.num_free_pages == cache.num_pages


def test_a_generate_interrupted_outside_a_steps_handling_ends_its_batch(monkeypatch):
    """An error a ``generate`` call's own scheduler raised before a step's handling (its
    admission check, here a Ctrl-C while two requests run and a third waits) failed the
    requests but left the call's batch running: its sessions' KV stayed in use for good,
    never freed as idle, and a later call was refused for want of pages although nothing
    ran. The batch ends as a failed step's does."""
    from agspec_gpu.session_kv import SessionKVCache
    P = [list(p) for p in prompts()]
    dec = decoder("paged", max_batch=2, kv_cache_tokens=8 * 40)
    a, b, c = (dec.open_session(f"t{i}", "coder", P[j]) for i, j in enumerate((3, 1, 0)))
    fits = SessionKVCache.fits

    def interrupted(self, *args):
        if any(k.in_use for k in self._kept.values()):
            monkeypatch.setattr(SessionKVCache, "fits", fits)
            raise KeyboardInterrupt
        return fits(self, *args)

    monkeypatch.setattr(SessionKVCache, "fits", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dec.generate([a, b, c], max_new_tokens=[30, 4, 4])
    monkeypatch.undo()
    assert not any(k.in_use for k in dec._kv._kept.values())
    assert all(dec.session_stats(s).finish_reason in ("error", "length") for s in (a, b, c))
    x = dec.open_session("tx", "coder", P[6])
    assert dec.generate([x], max_new_tokens=6, eos_id=None) == [greedy(VARIANT, P[6], 6,
                                                                       eos=None)]
    ctx = list(dec._sessions[a].context)
    assert dec.generate([a], max_new_tokens=4, eos_id=None) == [greedy(VARIANT, ctx, 4,
                                                                       eos=None)]


def test_an_end_of_a_finished_batch_that_fails_leaves_no_kv_in_use(monkeypatch):
    """A Ctrl-C as the batch whose requests all finished ends (``RunningBatch.end``,
    keeping each session's KV) left the session's KV marked in use for good: no batch ran
    it, yet it counted as a running batch's and a later call was refused for pages."""
    from agspec_gpu.running_batch import RunningBatch
    P = [list(p) for p in prompts()]
    dec = decoder("paged", kv_cache_tokens=8 * 40)
    a = dec.open_session("t0", "coder", P[3])
    end = RunningBatch.end

    def interrupted(self, *args, **kw):
        monkeypatch.setattr(RunningBatch, "end", end)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunningBatch, "end", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dec.generate([a], max_new_tokens=4, eos_id=None)
    monkeypatch.undo()
    assert not any(k.in_use for k in dec._kv._kept.values()) and dec.running == []
    x = dec.open_session("tx", "coder", P[6])
    assert dec.generate([x], max_new_tokens=5, eos_id=None) == [greedy(VARIANT, P[6], 5,
                                                                       eos=None)]

def test_closing_appending_and_workspace_faults_leave_no_half_state(monkeypatch):
    """Faults a second audit found leaving state half-changed: a close whose corpus
    compaction runs out of memory (the session is closed everywhere: no zombie that no
    retry could close and that kept its tenant from ``close_tenant``), an idle tenant's
    eviction failing half-way (every corpus of it freed, none orphaned), a workspace
    rebuild whose append fails (the next propose of a cached batch raised KeyError on the
    freed corpus), an ``append`` whose level build fails after the tier took the tokens
    (the context takes them too), and an own loop's commit whose ring restore fails after
    the tier took a cut step (the step counts; no deferred commit left to be settled later
    at the full counts)."""
    from agspec_gpu.corpus import DocumentCorpus
    from agspec_gpu.drafter_state import SlotState
    from agspec_gpu.index import IndexArena
    from agspec_gpu.tiers import TierConfig
    P = [list(p) for p in prompts()]
    dec = decoder("hf", max_batch=3, tiers=TierConfig(idle_budget_tokens=300,
                                                      workspace_budget_tokens=400,
                                                      tail_tokens=16, max_depth=4))

    def in_step(s):
        held = dec.store.arena.corpus_tokens(dec.store.session(s).corpus).tolist()
        assert held == dec._sessions[s].context, s

    compact = IndexArena._compact

    def no_room(self, shrink=False, renumber=False):
        if shrink:
            raise torch.OutOfMemoryError("a compaction (simulated)")
        return compact(self, shrink, renumber)

    a = dec.open_session("A", "coder", P[3])
    dec.add_workspace_file(a, "big.py", "\n".join(f"v{i} = f({i})" for i in range(9)))
    dec.close_session(a)  # A idle: a workspace and a history
    hist = dec.store._tenants["A"].hist.cid
    c, d = dec.open_session("C", "coder", P[2]), dec.open_session("C", "coder", [1, 2, 3])
    monkeypatch.setattr(IndexArena, "_compact", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        dec.close_session(d)  # closes d, then evicts A: freeing A's workspace compacts
    monkeypatch.undo()
    assert d not in dec._sessions and not dec.drafter.has_session(d) and \
        not dec.store.has_session(d)
    assert "A" not in dec.store._tenants and hist not in dec.store.arena._corpora
    with pytest.raises(KeyError, match="unknown or closed"):
        dec.close_session(d)
    g = dec.open_session("C", "coder", [4, 5, 6])

    def not_freed(self, cid):  # before anything is freed: the session stays open
        raise RuntimeError("a free (simulated)")

    monkeypatch.setattr(IndexArena, "free", not_freed)
    with pytest.raises(RuntimeError, match="a free"):
        dec.close_session(g)
    monkeypatch.undo()
    assert g in dec._sessions and dec.drafter.has_session(g) and dec.store.has_session(g)
    corpus = dec.store.session(g).corpus
    dec.close_session(g)  # closed by a retry, its corpus freed, its text in history once
    assert not dec.store.has_session(g) and corpus not in dec.store.arena
    assert len([k for k in dec.store._tenants["C"].hist._docs if k[0] == g]) == 1

    e = dec.open_session("C", "coder", P[0])
    dec.add_workspace_file(c, "z.py", "def f(x):\n    return x * 7919\n" * 4)
    dec.generate([c, e], max_new_tokens=3)  # the batch's match grid is cached
    rebuild, append, armed = DocumentCorpus._rebuild, IndexArena.append, []

    def rebuilding(self):
        armed.append(True)
        try:
            return rebuild(self)
        finally:
            armed.clear()

    def appending(self, *args, **kw):
        if armed:
            raise torch.OutOfMemoryError("a rebuild's append (simulated)")
        return append(self, *args, **kw)

    monkeypatch.setattr(DocumentCorpus, "_rebuild", rebuilding)
    monkeypatch.setattr(IndexArena, "append", appending)
    with pytest.raises(torch.OutOfMemoryError):
        dec.add_workspace_file(c, "big.txt", "\n".join(f"line {i}: {i * 7}" for i in range(9)))
    monkeypatch.undo()
    ctx = [list(dec._sessions[s].context) for s in (c, e)]
    assert dec.generate([c, e], max_new_tokens=4) == [greedy(VARIANT, x, 4) for x in ctx]

    failed = fail_one_level_build(monkeypatch)
    tool = dec.tokenizer.encode("x = 1\n" * 12)
    n = len(dec._sessions[c].context)
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(4):
            dec.append(c, tool)
    monkeypatch.undo()
    assert failed and len(dec._sessions[c].context) > n
    in_step(c)

    steer(dec, "C", P[3] + greedy(VARIANT, P[3], 60))  # drafts accepted: a step is cut
    f = dec.open_session("C", "coder", P[3])
    runner = HFRunner(model(VARIANT))
    runner.prefill([P[3][:-1]])
    draft = dec.propose([f])
    logits = runner.verify_padded(draft, dec.root_ids([f]))

    def no_restore(self, *args, **kw):
        raise RuntimeError("a ring restore (simulated)")

    monkeypatch.setattr(SlotState, "restore_rings", no_restore)
    with pytest.raises(RuntimeError, match="a ring restore"):
        dec.commit([f], draft, logits, max_new_tokens=1)
    monkeypatch.undo()
    assert not dec.drafter.commit_pending and len(dec._sessions[f].context) == len(P[3]) + 1
    in_step(f)
    ctx = list(dec._sessions[f].context)
    assert dec.generate([f], max_new_tokens=5) == [greedy(VARIANT, ctx, 5)]
    in_step(f)
