"""A context's length limit (``DecoderConfig.max_model_len``, by default the model's): requests
end at ``"length"`` when their context is full, no draft node reaches a position the model
has not, and prompts or appends past it are refused with nothing changed.

GPT-2 embeds its positions in a table (``n_positions``): a position past it is an IndexError
on a CPU and a device assert on a GPU, so these tests fail loudly on a draft that reaches
past the limit. Outputs are compared with plain greedy decoding up to the limit.
"""

import functools

import pytest
import torch
import transformers

from agspec_gpu import DecoderConfig, DrafterConfig, SamplingParams, SpecDecoder
from agspec_gpu.accept import BatchSampling, accept_tree
from agspec_gpu.runners.common import model_max_length
from agspec_gpu.runners.hf import HFRunner, greedy_generate
from agspec_gpu.tokenizer import load_tokenizer
from tiny_models import tiny_model

VOCAB = 100277  # cl100k_base
LIMIT = 64


@functools.cache
def tok():
    return load_tokenizer("cl100k")


@functools.cache
def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                  n_positions=LIMIT, initializer_range=0.1)
    return transformers.GPT2LMHeadModel(cfg).eval()


@functools.cache
def llama() -> torch.nn.Module:
    return tiny_model("llama", "sdpa", VOCAB, max_positions=LIMIT)


def text(n: int, repeat: bool = False) -> list[int]:
    """``n`` tokens of real code (a repeated line when ``repeat``: the drafter's own text
    then drafts deep chains at once)."""
    line = "        self.stats[\"steps\"] += 1\n" if repeat else None
    ids = tok().encode(line * 40) if repeat else \
        tok().encode(open(transformers.__file__).read() * 2)
    assert len(ids) >= n
    return ids[:n]


def record_bounds(dec, monkeypatch) -> list:
    """``(max_depths, deepest node per request)`` of every propose."""
    seen, propose = [], dec.drafter.propose

    def wrapped(sids, max_depths=None, **kw):
        draft = propose(sids, max_depths=max_depths, **kw)
        seen.append((max_depths, draft.depths().amax(1).clamp(min=0).tolist()
                     if draft.max_nodes else [0] * len(sids)))
        return draft

    monkeypatch.setattr(dec.drafter, "propose", wrapped)
    return seen


def steer(dec, tenant: str, m, prompt: list[int], tail: int = 44) -> None:
    """Puts the last ``tail`` tokens of ``prompt`` and its greedy continuation, then other
    text, into the tenant's history: its sessions draft that continuation deep, and past
    the limit (a closed session that held it, no longer than the limit itself)."""
    cont = greedy_generate(m, prompt, LIMIT - len(prompt))
    held = (prompt + cont)[-tail:] + text(LIMIT - tail)
    dec.close_session(dec.open_session(tenant, "coder", held))


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_requests_end_at_the_models_length_and_drafts_stay_inside_it(runner, monkeypatch):
    """Prompts ragged up to the limit, their continuations drafted deep (from the tenant's
    history, past the limit): each request takes plain greedy's tokens up to a full
    context and ends at ``"length"``, whatever its ``max_new_tokens``; no draft node
    passes its request's room (GPT-2 would raise); a request of a full context ends at
    once; the others of its batch run on."""
    models = [gpt2(), llama()] if runner == "hf" else [llama()]
    for m in models:
        cfg = DecoderConfig(runner=runner, page_size=8, kv_cache_tokens=1024)
        dec = SpecDecoder(m, tok(), cfg)
        assert dec.max_model_len == LIMIT
        P = [text(40, repeat=True), text(9), text(LIMIT - 1, repeat=True), text(LIMIT),
             text(57, repeat=True), text(20)]
        limits = [100, 100, 100, 100, 3, 100]
        for i, p in enumerate(P):
            if len(p) < LIMIT:
                steer(dec, f"t{i}", m, p)
        bounds = record_bounds(dec, monkeypatch)
        sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
        out = dec.generate(sids, max_new_tokens=limits, eos_id=None)
        for sid, p, o, n in zip(sids, P, out, limits):
            room = LIMIT - len(p)
            assert o == greedy_generate(m, p, min(n, room)), (type(m).__name__, sid)
            st = dec.session_stats(sid)
            assert st.finish_reason == "length" and st.context_len == len(p) + len(o)
            assert st.context_len == LIMIT or n < room
        # the drafts were deep, and bounded where the room was short
        assert max(max(d) for _, d in bounds) >= 8
        assert any(d > 0 for m, ds in bounds if m is not None for d in ds)
        for max_depths, deepest in bounds:
            if max_depths is not None:
                assert all(d <= max(b, 0) for d, b in zip(deepest, max_depths)), bounds
        # a full context: its request ends at once, without a step
        again = dec.generate([sids[0], sids[3]], max_new_tokens=5, eos_id=None)
        assert again == [[], []] and dec.session_stats(sids[3]).finish_reason == "length"


def test_max_new_tokens_bounds_the_last_steps_drafts(monkeypatch):
    """A request near its ``max_new_tokens`` drafts at most what it may still emit, less
    the bonus token (its last step verifies no node it could not take): its continuation
    steered in, the drafts reach their bounds; the output is plain greedy's."""
    m = llama()
    dec = SpecDecoder(m, tok(), DecoderConfig(max_model_len=LIMIT))
    p = text(20)
    steer(dec, "t", m, p, tail=54)  # the prompt's last 10 tokens, then its continuation
    bounds = record_bounds(dec, monkeypatch)
    emitted, seen = [0], []

    def on_tokens(sid, toks):
        emitted[0] += len(toks)
        seen.append((emitted[0], len(bounds)))

    sid = dec.open_session("t", "coder", p)
    out = dec.generate([sid], max_new_tokens=11, eos_id=None, on_tokens=on_tokens)
    assert out == [greedy_generate(m, p, 11)]
    before = dict((n_bounds, n) for n, n_bounds in seen)  # emitted before each propose
    for k, (max_depths, deepest) in enumerate(bounds):
        assert max_depths == [11 - before[k] - 1] and deepest[0] <= max_depths[0]
    assert any(d[0] == m[0] > 0 for m, d in bounds)  # a bound cut a draft
    assert dec.session_stats(sid).num_steps < 5  # deep, accepted drafts


def test_own_loop_drafts_inside_the_room_and_commit_ends_at_the_limit():
    """``propose`` drafts no node past the model's last position (``tree_inputs``'
    positions stay below the limit); ``commit`` ends a session whose context fills at
    ``"length"``; a propose of a full context raises naming it, nothing proposed."""
    m = gpt2()
    dec = SpecDecoder(m, tok())
    P = [text(50, repeat=True), text(20)]
    steer(dec, "t0", m, P[0])  # its continuation drafted deep, past the limit
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    runner = HFRunner(m)
    runner.prefill([p[:-1] for p in P])
    outs, deepest = [[], []], 0
    live = list(sids)
    while live:
        rows = [sids.index(s) for s in live]
        draft = dec.propose(live)
        inputs = dec.tree_inputs(live, draft)
        assert int(inputs.position_ids.max()) < LIMIT
        deepest = max(deepest, int(draft.depths().max()))
        logits = runner.verify_padded(draft, dec.root_ids(live))
        res = dec.commit(live, draft, logits)
        runner.commit(res)
        for b, (row, n) in zip(rows, zip(res.output_ids.tolist(), res.num_output.tolist())):
            outs[b] += row[:n]
        ended = [s for s in live if dec.session_stats(s).finish_reason == "length"]
        if ended:
            break
    full = sids[0]
    assert deepest >= 4 and dec.session_stats(full).context_len == LIMIT
    assert outs[0] == greedy_generate(m, P[0], LIMIT - len(P[0]))
    assert outs[1] == greedy_generate(m, P[1], len(outs[1]))
    with pytest.raises(ValueError, match=rf"session_ids: the contexts of \['{full}'\]"):
        dec.propose(sids)
    draft = dec.propose([sids[1]])  # the other session drafts on
    assert draft.batch_size == 1


def test_prompts_and_appends_past_the_limit_are_refused_with_nothing_changed():
    dec = SpecDecoder(gpt2(), tok(), DecoderConfig(max_model_len=48))
    with pytest.raises(ValueError, match="prompt_ids: 49 tokens exceed max_model_len=48"):
        dec.open_session("t", "coder", text(49), session_id="s")
    assert not dec.drafter.has_session("s")
    sid = dec.open_session("t", "coder", text(40))
    with pytest.raises(ValueError, match=r"token_ids: 9 tokens would pass max_model_len=48 "
                                         r"\(the session's context holds 40\)"):
        dec.append(sid, text(9))
    assert dec.session_stats(sid).context_len == 40
    dec.append(sid, text(8))  # exactly full: taken
    assert dec.session_stats(sid).context_len == 48
    with pytest.raises(ValueError, match="session_id: the session's context holds "
                                         "max_model_len=48 tokens"):
        dec.submit(sid, max_new_tokens=4)
    assert dec.generate([sid], max_new_tokens=4) == [[]]
    assert dec.session_stats(sid).finish_reason == "length"


def test_submitted_requests_end_at_the_limit():
    m = llama()
    dec = SpecDecoder(m, tok(), DecoderConfig(runner="paged", page_size=8,
                                              kv_cache_tokens=1024))
    P = [text(58, repeat=True), text(30)]
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    rids = [dec.submit(s, max_new_tokens=50, eos_id=None) for s in sids]
    got = {r: [] for r in rids}
    done = {}
    while len(done) < 2:
        for o in dec.step():
            got[o.request_id] += o.token_ids
            if o.finished:
                done[o.request_id] = o.finish_reason
    assert done == {rids[0]: "length", rids[1]: "length"}
    assert got[rids[0]] == greedy_generate(m, P[0], LIMIT - 58)
    assert got[rids[1]] == greedy_generate(m, P[1], LIMIT - 30)


def test_the_limit_is_the_models_and_no_more():
    """None: the model's (a RoPE scaling factor stretches it); a smaller one is taken; a
    larger one, or one under 2, is refused by name."""
    assert SpecDecoder(gpt2(), tok(), DecoderConfig(max_model_len=32)).max_model_len == 32
    with pytest.raises(ValueError, match="config.max_model_len=65 exceeds the model's "
                                         "context length 64"):
        SpecDecoder(gpt2(), tok(), DecoderConfig(max_model_len=65))
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="max_model_len"):
            DecoderConfig(max_model_len=bad)

    class Holder:
        def __init__(self, config):
            self.config = config

    cases = [(transformers.GPT2Config(n_positions=64), 64),
             (transformers.Qwen2Config(max_position_embeddings=32768, rope_scaling={
                 "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
              131072),
             (transformers.LlamaConfig(max_position_embeddings=131072, rope_scaling={
                 "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), 131072),
             (transformers.LlamaConfig(max_position_embeddings=4096, rope_scaling={
                 "rope_type": "linear", "factor": 2.0}), 8192),
             (transformers.LlamaConfig(max_position_embeddings=4096, rope_scaling={
                 "rope_type": "dynamic", "factor": 2.0}), 4096),  # (refused by the runners)
             (transformers.MambaConfig(), None)]
    for config, want in cases:
        assert model_max_length(Holder(config)) == want, type(config).__name__


def test_a_commit_that_fills_the_context_ends_its_request():
    """A step that emits exactly the room left (a whole one-node chain and the bonus into
    two free positions) ends at ``"length"``, as ``generate`` ends it, not only a step
    that could have emitted past it."""
    from agspec_gpu import DraftBatch

    m = gpt2()
    dec = SpecDecoder(m, tok())
    p = text(LIMIT - 2)
    sid = dec.open_session("t", "coder", p)
    g = greedy_generate(m, p, 2)
    runner = HFRunner(m)
    runner.prefill([p[:-1]])
    dec.propose([sid])
    deep = DraftBatch.from_lists([[(g[0], -1), (g[1], 0), (g[1], 1)]])
    with pytest.raises(ValueError, match=rf"draft: the trees of \['{sid}'\] reach position "
                                         rf"{LIMIT}, past max_model_len={LIMIT}"):
        dec.tree_inputs([sid], deep)  # (a built draft: the root at 61, nodes 62, 63, 64)
    draft = DraftBatch.from_lists([[(g[0], -1)]])  # accepted: the model's own next token
    assert dec.tree_inputs([sid], draft).position_ids.tolist() == [[LIMIT - 3, LIMIT - 2]]
    res = dec.commit([sid], draft, runner.verify_padded(draft, dec.root_ids([sid])))
    assert res.num_output.tolist() == [2] and res.output_ids[0, :2].tolist() == g
    st = dec.session_stats(sid)
    assert (st.context_len, st.finish_reason) == (LIMIT, "length")


def test_the_drafters_bounds_are_checked_by_name():
    dec = SpecDecoder(gpt2(), tok())
    steer(dec, "t0", gpt2(), text(20), tail=54)  # (it drafts unbounded)
    sids = [dec.open_session(f"t{i}", "coder", text(20)) for i in range(2)]
    assert dec.drafter.propose(sids).num_draft_tokens.tolist()[0] > 0
    for bad in (5, (d for d in (1, 2)), {1: 0, 2: 0}, [1], [1, 2.0], [1, True], "12",
                torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="max_depths: expected a list of 2 ints"):
            dec.drafter.propose(sids, max_depths=bad)
    draft = dec.drafter.propose(sids, max_depths=(0, -4))
    assert draft.num_draft_tokens.tolist() == [0, 0]


def test_a_draft_its_bound_cut_leaves_the_controllers_scale():
    """A draft accepted whole to the depth its request's bound allowed (the room left, less
    one) says nothing of the scale, as a role cap's cut: the controller keeps it, where
    the same session's unbounded draft, accepted whole, grows it."""
    m = gpt2()
    grown = []
    for bound in ([3], None):
        dec = SpecDecoder(m, tok())
        p = text(20)
        steer(dec, "t", m, p, tail=54)  # the prompt's last 10 tokens, then its continuation
        sid = dec.open_session("t", "coder", p)
        slot = dec.drafter._slot_of(sid)
        dec.drafter.state.scale[slot] = 8.0  # deep: the bound binds
        draft = dec.drafter.propose([sid], max_depths=bound)
        depth = int(draft.depths().max())
        runner = HFRunner(m)
        runner.prefill([p[:-1]])
        res = accept_tree(draft, runner.verify_padded(draft, torch.tensor([p[-1]])),
                          BatchSampling.of([SamplingParams(0.0)], "cpu"))
        assert int(res.num_accepted[0]) == depth and depth >= 3  # accepted whole
        assert (depth == 3) == (bound is not None)
        for _ in range(64):  # the drafter's staging ring comes round before the commit
            dec.drafter._writer.write(([30] * 4096, torch.int64))
        dec.drafter.observe([sid], res.output_ids, res.num_output, res.num_accepted,
                            path_nodes=res.accepted_nodes)
        grown.append(float(dec.drafter.state.scale[slot]) / 8.0)
    assert grown[0] == 1.0 and grown[1] > 1.0, grown


def test_drafts_proposed_ahead_are_taken_under_looser_bounds():
    """Near their limits, requests draft ahead under the bounds a whole acceptance would
    leave; a step that accepts less leaves looser ones, under which the ahead draft
    stands (it is no deeper than they allow): none is proposed again, and the output is
    plain greedy's. (Taken only under equal bounds, 11 of 29 were proposed again.)"""
    m = tiny_model("llama", "sdpa", VOCAB, max_positions=4096)
    dec = SpecDecoder(m, tok(), DecoderConfig(max_batch=4))
    src = text(600)
    P = [src[i * 200: i * 200 + 30] for i in range(3)]
    for i, p in enumerate(P):  # continuations with every ninth token wrong: partial
        cont = greedy_generate(m, p, 70)  # acceptances
        cont = [t if j % 9 != 8 else (t + 1) % 1000 for j, t in enumerate(cont)]
        dec.close_session(dec.open_session(f"t{i}", "coder", p + cont))
    d, count = dec.drafter, {"ahead": 0, "bound": 0, "taken": 0}
    propose_ahead, propose = d.propose_ahead, d.propose

    def ahead(sids, max_depths=None):
        made = propose_ahead(sids, max_depths)
        count["ahead"] += made
        count["bound"] += made and min(max_depths) < d.config.max_draft_depth
        return made

    def proposed(sids, **kw):
        before = d._ahead
        out = propose(sids, **kw)
        count["taken"] += before is not None and out is before.draft
        return out

    d.propose_ahead, d.propose = ahead, proposed
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    limits = [60, 63, 66]
    out = dec.generate(sids, max_new_tokens=limits, eos_id=None)
    assert out == [greedy_generate(m, p, n) for p, n in zip(P, limits)]
    assert count["bound"] > 0 and count["taken"] == count["ahead"], count


def test_proposed_draft_given_other_sessions_is_checked_against_the_limit():
    """``tree_inputs`` trusts the draft ``propose`` returned only for the sessions it was
    proposed for, in their order: given another session (or the same ones reordered), a
    deep draft's positions would pass the model's last one (GPT-2: IndexError), so it is
    checked as a built draft and refused naming ``draft``."""
    m = gpt2()
    dec = SpecDecoder(m, tok())
    pa = text(20, repeat=True)
    steer(dec, "a", m, pa, tail=54)  # A drafts deep
    a, b = dec.open_session("a", "coder", pa), dec.open_session("b", "coder", text(60))
    for sids, order in (([a], [b]), ([a, b], [b, a])):
        draft = dec.propose(sids)
        assert int(draft.depths().max()) >= 5
        assert int(dec.tree_inputs(sids, draft).position_ids.max()) < LIMIT
        with pytest.raises(ValueError, match=r"draft: the trees of \['" + b + r"'\] reach"):
            dec.tree_inputs(order, draft)


@pytest.mark.parametrize("bound", ["max_model_len", "max_new_tokens"])
@pytest.mark.parametrize("api", ["generate", "step"])
def test_a_pool_that_holds_a_requests_whole_kv_runs_it_to_its_end(bound, api):
    """A request's last step drafts nothing (it may emit one token), so it needs no node
    slot: a page pool that holds exactly the request's KV (its context but the last token,
    which is never run) runs it to its end, under either bound; it ended at
    ``KVCacheFull`` one token early. A request of two tokens is admitted to such a pool
    (its one step verifies the root alone). Two requests whose whole KV fills the pool,
    admitted optimistically, run side by side without a preemption."""
    m = llama()
    limit, max_new = (57, 100) if bound == "max_model_len" else (LIMIT, 7)
    dec = SpecDecoder(m, tok(), DecoderConfig(runner="paged", max_model_len=limit, page_size=8,
                                              kv_cache_tokens=56))
    p = text(50)
    for speculate in (True, False):
        sid = dec.open_session("t", "coder", p)
        if api == "generate":
            out = dec.generate([sid], max_new_tokens=max_new, eos_id=None,
                               speculate=speculate)[0]
        else:
            dec.submit(sid, max_new_tokens=max_new, eos_id=None, speculate=speculate)
            out = []
            while dec.running or dec.queued:
                out += [t for o in dec.step() for t in o.token_ids]
        assert out == greedy_generate(m, p, 7)
        assert dec.session_stats(sid).finish_reason == "length"
        dec.close_session(sid)
    if bound != "max_model_len" or api != "step":
        return
    sid = dec.open_session("t", "coder", text(55))  # 55 + the root: the pool's 56 slots
    assert dec.generate([sid], max_new_tokens=2, eos_id=None) == [greedy_generate(m, text(55),
                                                                                  2)]
    dec = SpecDecoder(m, tok(), DecoderConfig(runner="paged", max_model_len=33, page_size=8,
                                              kv_cache_tokens=64, admission="optimistic",
                                              drafter=DrafterConfig(max_nodes=2)))
    P = [text(20), text(40)[20:40]]
    sids = [dec.open_session(f"t{i}", "coder", q) for i, q in enumerate(P)]
    rids = [dec.submit(s, max_new_tokens=100, eos_id=None, speculate=False) for s in sids]
    got = {r: [] for r in rids}
    while dec.running or dec.queued:
        for o in dec.step():
            got[o.request_id] += o.token_ids
    assert [got[r] for r in rids] == [greedy_generate(m, q, 33 - len(q)) for q in P]
    assert dec.stats["preemptions"] == 0
