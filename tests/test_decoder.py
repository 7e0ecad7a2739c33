"""SpecDecoder end to end: the public contract on tiny random Llama / Qwen2 models (fp32, CPU)
with the real cl100k tokenizer (vocab 100277, so the models' vocabulary matches it).

The reference is plain greedy decoding, one request at a time
(:func:`agspec_gpu.runners.hf.greedy_generate`); speculative ``generate`` must equal it token
for token whatever the drafts were. Drafts are steered through the tenant's history tier: a
closed session whose prompt holds ``P + continuation`` makes the drafter propose exactly that
continuation (token ids, no re-tokenization) to a later session of the same tenant that
opens with ``P``. That gives drafts that are fully accepted, rejected at the first token, and
trees where a non-first branch wins, without changing the reference context.

Per-step outputs are observed through ``on_tokens`` (one call per step: the first call is
the prefill's token, then ``accepted + 1`` tokens per verification step, cut at the end).
"""

import functools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import agspec_gpu
import agspec_gpu.host
from agspec_gpu import (CorpusTier, DecoderConfig, DraftBatch, DrafterConfig, SamplingParams,
                        SessionStats, SpecDecoder)
from agspec_gpu.draft_batch import PAD_ID
from agspec_gpu.kv_cache import KVCacheFull
from agspec_gpu.runners.hf import HFRunner, greedy_generate
from agspec_gpu.runners.paged_batch import PagedBatch
from agspec_gpu.tiers import TierConfig
from agspec_gpu.tokenizer import load_tokenizer
from tiny_models import VARIANTS, record_fit_width, tiny_model

transformers = pytest.importorskip("transformers")

VOCAB = 100277  # cl100k_base: 100256 ranks + special tokens up to 100276
NEW = 40




@functools.cache
def tok():
    return load_tokenizer("cl100k")


def _tiny(arch: str, attn: str, vocab: int = VOCAB) -> torch.nn.Module:
    return tiny_model(arch, attn, vocab)


IDS = ["-".join(v) for v in VARIANTS]


@functools.cache
def model(variant=("llama", "sdpa")) -> torch.nn.Module:
    return _tiny(*variant)


@functools.cache
def _greedy(variant, prompt: tuple, n: int, eos) -> tuple:
    return tuple(greedy_generate(model(variant), list(prompt), n, eos_id=eos))


def greedy(variant, prompt, n=NEW, eos=-1) -> list[int]:
    """The reference; ``eos=-1`` is the tokenizer's EOS, as ``generate``'s default."""
    return list(_greedy(variant, tuple(prompt), n, tok().eos_id if eos == -1 else eos))


@functools.cache
def _seeded(variant, prompt: tuple, n: int, params, eos) -> tuple:
    from agspec_gpu.accept import target_probs
    from agspec_gpu.runners.hf import _cache_kwarg, _new_cache
    from agspec_gpu.seeding import seeded_uniforms
    m = model(variant)
    cache, kw = _new_cache(), _cache_kwarg(m)  # one token a forward, as greedy_generate
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            logits = m(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1]
            cdf = target_probs(logits, params).double().cumsum(-1)
            u = seeded_uniforms(torch.tensor(params.seed), torch.tensor(len(prompt) + len(out)))
            t = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp(
                max=cdf.numel() - 1))
            out.append(t)
            if t == eos:
                break
            ids = torch.tensor([[t]])
    return tuple(out)


def seeded_sample(variant, prompt, n, params, eos=-1) -> list[int]:
    """Plain seeded sampling, one token a forward with the model's cache: the token at
    position ``t`` by inverse CDF of the target at the uniform of ``(params.seed, t)``."""
    return list(_seeded(variant, tuple(prompt), n, params,
                        tok().eos_id if eos == -1 else eos))


# ---------------------------------------------------------------- real text prompts
@functools.cache
def text_ids(name: str) -> list[int]:
    """A source file of this package, encoded whole with cl100k."""
    return tok().encode((Path(agspec_gpu.__file__).parent / name).read_text())


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    """Eight ragged prompts (1 to 140 tokens) of real text, three of them repetitive."""
    dec, drf, trs = text_ids("decoder.py"), text_ids("drafter.py"), text_ids("tiers.py")
    rep_line = tok().encode("        self.stats[\"steps\"] += 1\n" * 4 + "        self.stats[")
    chunk = dec[700:730]
    out = [dec[100:105],                     # 5 tokens
           drf[200:223],                     # 23
           chunk + chunk,                    # 60, repeated
           trs[50:147],                      # 97
           drf[900:901],                     # 1 token
           rep_line,                         # one code line four times
           drf[1200:1340],                   # 140
           trs[400:431] + trs[400:410]]      # 41, ends repeating its start
    return tuple(tuple(p) for p in out)


def other_text(n: int, at: int = 2000) -> list[int]:
    return text_ids("tiers.py")[at:at + n]


# ---------------------------------------------------------------- helpers
def record_drafts(dec: SpecDecoder, monkeypatch) -> list:
    """Keeps every DraftBatch the drafter proposes (before per-request masking)."""
    drafts, propose = [], dec.drafter.propose

    def wrapped(sids, max_depths=None, **kw):  # kept past the step: stable drafts
        drafts.append(propose(sids, max_depths=max_depths))  # (clones under graphs)
        return drafts[-1]

    monkeypatch.setattr(dec.drafter, "propose", wrapped)
    return drafts


def record_steps(dec: SpecDecoder, monkeypatch) -> list:
    """Keeps ``(output_ids rows, num_accepted)`` of every verification step."""
    steps, observe = [], dec.drafter.observe

    def wrapped(sids, output_ids, num_output, num_accepted, **kw):
        steps.append((output_ids.tolist(), num_accepted.tolist()))
        return observe(sids, output_ids, num_output, num_accepted, **kw)

    monkeypatch.setattr(dec.drafter, "observe", wrapped)
    return steps


def accepted_with_more_after(steps, b: int, p: int) -> bool:
    """Whether output position ``p`` (>= 1; 0 is the prefill's token) of request ``b`` was an
    accepted draft token, so that its step produced further tokens after it."""
    pos = 1
    for rows, acc in steps:
        if pos <= p < pos + acc[b] + 1:
            return p - pos < acc[b] and rows[b][p - pos] >= 0
        pos += acc[b] + 1
    raise AssertionError(f"position {p} of request {b} was never emitted")


def chunk_recorder():
    chunks: dict[str, list[list[int]]] = {}
    return chunks, lambda sid, toks: chunks.setdefault(sid, []).append(list(toks))


def steer(dec: SpecDecoder, tenant: str, text: list[int]) -> None:
    """Puts ``text`` into the tenant's history (a closed session that held it)."""
    dec.close_session(dec.open_session(tenant, "coder", text))


def root_children(draft, b: int) -> list[int]:
    n = int(draft.num_draft_tokens[b])
    return [int(t) for t, p in zip(draft.token_ids[b, :n], draft.parents[b, :n]) if p == -1]


def assert_greedy(dec, variant, sids, contexts, n=16) -> None:
    """``generate`` on ``sids`` equals the greedy reference of each context."""
    out = dec.generate(sids, max_new_tokens=n)
    for sid, ctx, o in zip(sids, contexts, out):
        assert o == greedy(variant, ctx, n), sid


# ---------------------------------------------------------------- lossless greedy
# batch partitions per variant: together they cover batch sizes 1..8, ragged within a batch
PARTITIONS = {IDS[0]: [[0, 1, 2, 3, 4, 5, 6, 7], [3, 0, 5, 1], [2, 6, 7, 4]],
              IDS[1]: [[4], [0, 1, 2, 3, 5, 6, 7]],
              IDS[2]: [[7, 2], [0, 1, 3, 4, 5, 6]],
              IDS[3]: [[1, 5, 6], [0, 2, 3, 4, 7]]}


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_greedy_lossless_ragged_batches(variant):
    P = prompts()
    m = model(variant)
    for part in PARTITIONS["-".join(variant)]:
        dec = SpecDecoder(m, tok())
        # speculation really runs, whatever this package's source (the prompts' text): the
        # first session's continuation steered in
        steer(dec, f"t{part[0]}", list(P[part[0]]) + greedy(variant, P[part[0]]))
        # odd-indexed prompts go in as 1-D tensors, the rest as lists
        sids = [dec.open_session(f"t{i}", "coder",
                                 torch.tensor(P[i]) if i % 2 else list(P[i])) for i in part]
        out = dec.generate(sids, max_new_tokens=NEW)
        for i, o in zip(part, out):
            assert o == greedy(variant, P[i]), (part, i)
        assert dec.stats["drafted"] > 0 and dec.stats["accepted"] > 0


@pytest.mark.parametrize("variant", [VARIANTS[1], VARIANTS[2]], ids=[IDS[1], IDS[2]])
def test_fully_accepted_draft(variant):
    P = list(prompts()[3])
    g = greedy(variant, P, 45)
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P + g)
    sid = dec.open_session("t0", "coder", P)
    out = dec.generate([sid], max_new_tokens=45)  # 45: the cut falls inside a draft
    assert out == [g]
    s = dec.stats
    assert s["drafted"] > 0 and s["accepted"] == s["drafted"], s
    assert s["tokens"] / s["steps"] > 4, s  # measured: 2 steps, 43 of 43 drafted accepted


def record_prefills(dec: SpecDecoder, monkeypatch) -> list[list[int]]:
    """Per ``generate`` call on the paged runner: the tokens prefilled per session."""
    calls, prefill = [], dec._paged.prefill

    def wrapped(seq_ids, token_lists, *args, **kw):
        calls.append([len(t) for t in token_lists])
        return prefill(seq_ids, token_lists, *args, **kw)

    monkeypatch.setattr(dec._paged, "prefill", wrapped)
    return calls


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=[IDS[0], IDS[2]])
def test_paged_runner_is_lossless_and_keeps_session_kv(variant, monkeypatch):
    """runner="paged": the same loop on PagedLlamaRunner (torch tree-attention backend on
    CPU, FlashInfer on a GPU), ragged batches, full and partial acceptance. A session keeps
    its KV from one ``generate`` to the next (the next call prefills one token, or the
    appended tool output and one), and ``close_session`` returns every page."""
    P = prompts()
    full = list(P[3])
    g = greedy(variant, full, 45)
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner="paged", page_size=8,
                                                           kv_cache_tokens=4096))
    steer(dec, "t0", full + g)  # a draft that is accepted to its end
    part = [0, 2, 5, 7]
    sids = [dec.open_session("t0", "coder", full)] + [
        dec.open_session(f"t{i + 1}", "coder", list(P[i])) for i in part]
    prefilled = record_prefills(dec, monkeypatch)
    out = dec.generate(sids, max_new_tokens=45)
    assert out[0] == g
    for i, o in zip(part, out[1:]):
        assert o == greedy(variant, P[i], 45), i
    assert prefilled == [[len(full)] + [len(P[i]) for i in part]]
    s = dec.stats
    assert s["drafted"] > 0 and s["tokens"] / s["steps"] > 1.5, s
    cache = dec._paged.kv_cache
    assert all(sid in cache for sid in sids) and cache.num_free_pages < cache.num_pages
    # the next call continues each session's KV: one token (the last one, the root) each
    more = dec.generate(sids[:2], max_new_tokens=8)
    assert more[0] == greedy(variant, full + g, 8)
    assert more[1] == greedy(variant, list(P[0]) + out[1], 8)
    assert prefilled[-1] == [1, 1]
    tool = tok().encode("$ pytest -q tests/test_decoder.py\n3 passed in 0.12s\n")
    dec.append(sids[0], tool)
    again = dec.generate(sids[:1], max_new_tokens=8)
    assert again[0] == greedy(variant, full + g + more[0] + tool, 8)
    assert prefilled[-1] == [len(tool) + 1]
    s = dec.stats  # what the runner prefilled, counted by the decoder too
    assert (s["prefills"], s["prefill_tokens"]) == (len(prefilled), sum(map(sum, prefilled)))
    for sid in sids:
        dec.close_session(sid)
    assert cache.num_free_pages == cache.num_pages
    with pytest.raises(ValueError, match="runner"):
        DecoderConfig(runner="vllm")
    with pytest.raises(ValueError, match="drafter: expected a DrafterConfig"):
        DecoderConfig(drafter=dict(max_nodes=8))
    with pytest.raises(ValueError, match="model: expected a causal LM"):
        SpecDecoder("meta-llama/Llama-3-8B", tok())  # a name, not a loaded model
    for runner in ("hf", "paged"):  # a module with parameters but no HF config
        with pytest.raises(ValueError, match="model: expected a Hugging Face causal LM"):
            SpecDecoder(torch.nn.Linear(2, 2), tok(), DecoderConfig(runner=runner))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(ValueError, match="model: runner='paged'"):
        SpecDecoder(gpt2, tok(), DecoderConfig(runner="paged"))
    # training mode: refused naming the dropout where it is on (random logits); where it is
    # off, refused as HFRunner refuses it (a router's jitter, a norm's statistics), at
    # construction, not at the first generate
    with pytest.raises(ValueError, match=r"model: in training mode.*Dropout\(p=0.1\)"):
        SpecDecoder(gpt2.train(), tok())
    llama = _tiny("llama", "sdpa")
    llama.config.attention_dropout = 0.2
    with pytest.raises(ValueError, match="config.attention_dropout=0.2"):
        SpecDecoder(llama.train(), tok())
    llama.config.attention_dropout = 0.0
    with pytest.raises(ValueError, match=r"model: call model.eval\(\) first"):
        SpecDecoder(llama.train(), tok())
    assert SpecDecoder(llama.eval(), tok()).vocab_size == VOCAB


def test_calibrated_cost_model_steers_the_budget_and_loads_from_its_file(tmp_path):
    """``calibrate_cost_model`` measures the paged runner's steps at each batch size, installs
    the curves in the drafter (a table per curve; graphs captured again on a GPU) and writes
    the file ``DecoderConfig(cost_model=...)`` loads; greedy output stays plain greedy."""
    from agspec_gpu.cost_model import BatchCostModels

    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (1, 3)]
    m = model(variant)
    cfg = DecoderConfig(runner="paged", page_size=8, kv_cache_tokens=4096, max_batch=2)
    dec = SpecDecoder(m, tok(), cfg)
    path = tmp_path / "cost.json"
    cost = dec.calibrate_cost_model(24, max_draft_tokens=4, repeats=1, out=path)
    assert [b for b, _ in cost.curves] == [1, 2]
    assert [c.points[-1][0] for _, c in cost.curves] == [1 + 4, 2 + 4]  # b + n, n = 0..4
    assert dec.drafter.cost is cost and sorted(dec.drafter._cost_tables) == [1, 2]
    assert dec._paged.kv_cache.num_free_pages == 4096 // 8  # its sequences freed
    loaded = BatchCostModels.from_json(path)
    assert [(b, c.points, c.steps) for b, c in loaded.curves] == \
        [(b, c.points, c.steps) for b, c in cost.curves]
    dec2 = SpecDecoder(m, tok(), replace(cfg, cost_model=path))
    assert [c.points for _, c in dec2.drafter.cost.curves] == [c.points for _, c in cost.curves]
    assert dec.config.cost_model is cost
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    assert_greedy(dec, variant, sids, P)
    # a session named like the calibration's sequences keeps its KV through one (they
    # are not str ids), and a bad argument frees every page it took
    for s in sids:
        dec.close_session(s)
    named = dec.open_session("t9", "coder", P[0], session_id="__calibrate0")
    dec.generate([named], max_new_tokens=3)
    free = dec._paged.kv_cache.num_free_pages
    for kw in (dict(max_draft_tokens=16.0), dict(max_draft_tokens=0), dict(repeats=0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            dec.calibrate_cost_model(24, **kw)
    assert dec._paged.kv_cache.num_free_pages == free
    dec.calibrate_cost_model(24, [1], max_draft_tokens=4, repeats=1)
    assert dec._paged.kv_cache.num_free_pages == free
    assert_greedy(dec, variant, [named], [list(dec._sessions[named].context)])
    dec.close_session(named)
    # a draft proposed ahead that no step took (a request that ended at EOS exactly at a
    # step's end) does not keep the next calibration from installing its curves
    dec.drafter.set_cost(None)  # drafts that no CPU timing moves
    ref = greedy(variant, P[0], 30, eos=None)
    dec.close_session(dec.open_session("t0", "coder", P[0] + ref))  # steers t0's drafts
    for k in range(3, 25):  # an EOS that ends a request right at a step's end
        ended = dec.open_session("t0", "coder", P[0])
        dec.generate([ended], max_new_tokens=40, eos_id=ref[k])
        if dec.drafter._ahead is not None:
            break
        dec.close_session(ended)
    assert dec.drafter._ahead is not None  # (the case: left by that generate)
    assert [b for b, _ in dec.calibrate_cost_model(24, max_draft_tokens=4,
                                                   repeats=1).curves] == [1, 2]
    sids = [ended, dec.open_session("t1", "coder", P[1])]
    assert_greedy(dec, variant, sids, [list(dec._sessions[ended].context), P[1]])
    with pytest.raises(ValueError, match="batch_sizes"):
        dec.calibrate_cost_model(24, [4])
    last = dec.drafter.cost
    dec.propose(sids)
    with pytest.raises(RuntimeError, match="propose"):  # before it measures anything
        dec.calibrate_cost_model(24)
    assert dec.drafter.cost is last
    # a proposal that a later one replaced can never be committed: it holds nothing up
    draft = dec.propose(sids[1:])
    dec.commit(sids[1:], draft, torch.zeros(1, 1 + draft.max_nodes, dec.vocab_size))
    with pytest.raises(ValueError, match="must follow propose"):
        dec.commit(sids, draft, torch.zeros(2, 1 + draft.max_nodes, dec.vocab_size))
    assert not dec.drafter._pending
    dec.calibrate_cost_model(24, [1], max_draft_tokens=4, repeats=1)
    # a proposal whose session was submitted, then cancelled before a step took it: its
    # context moved on elsewhere (it had held calibration up until the session moved)
    dec.propose(sids[:1])
    dec.submit(sids[0], max_new_tokens=4)
    dec.cancel(sids[0])
    assert not dec.drafter._pending
    dec.calibrate_cost_model(24, [1], max_draft_tokens=4, repeats=1)
    with pytest.raises(ValueError, match="context_tokens"):
        dec.calibrate_cost_model(0)
    with pytest.raises(ValueError, match="runner='paged'"):
        SpecDecoder(m, tok()).calibrate_cost_model(24)
    with pytest.raises(ValueError, match="cost_model"):
        DecoderConfig(cost_model=3)
    (tmp_path / "bad.json").write_text("{}")
    for bad in (tmp_path / "missing.json", tmp_path / "bad.json"):
        with pytest.raises(ValueError, match="cost_model: cost model"):
            SpecDecoder(m, tok(), DecoderConfig(cost_model=bad))


def test_calibration_frees_idle_sessions_kv_it_needs_room_for():
    """Idle sessions hold every sequence row (``max_sessions`` = 2): a calibration at 2
    requests frees their kept KV, least recently used first, as a step would, rather than
    raise; their next call prefills again and is plain greedy decoding."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (1, 3)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(
        runner="paged", page_size=8, kv_cache_tokens=2048, max_batch=2, max_sessions=2))
    cache = dec._paged.kv_cache
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    outs = dec.generate(sids, max_new_tokens=4, eos_id=None)
    assert all(s in cache for s in sids) and cache.num_free_rows == 0
    cost = dec.calibrate_cost_model(24, [2], max_draft_tokens=4, repeats=1)
    assert [b for b, _ in cost.curves] == [2]
    assert not any(s in cache for s in sids) and cache.num_free_rows == 2
    ctx = [p + o for p, o in zip(P, outs)]
    assert dec.generate(sids, max_new_tokens=6, eos_id=None) == \
        [greedy(variant, c, 6, eos=None) for c in ctx]


def test_paged_session_kv_is_evicted_least_recent_first(monkeypatch):
    """A pool too small for every session's KV: a call frees idle sessions' KV, least
    recently generated first, only as far as it needs; an evicted session prefills its
    whole context at its next call, and every output is still plain greedy decoding's."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 6, 1)]  # 97, 140 and 23 tokens
    # 45 pages of 8: A's and B's KV fit together (15 + 20 pages held after 16 new tokens,
    # B's call asks for up to 28), C's call (up to 13) must free one of them
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner="paged", page_size=8,
                                                           kv_cache_tokens=8 * 45))
    cache = dec._paged.kv_cache
    a, b, c = sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    prefilled = record_prefills(dec, monkeypatch)
    outs = {}
    for sid, p in zip(sids, P):
        outs[sid] = dec.generate([sid], max_new_tokens=16)[0]
        assert outs[sid] == greedy(variant, p, 16)
    assert a not in cache and b in cache and c in cache  # A, the least recent, made room
    ctx = {sid: p + outs[sid] for sid, p in zip(sids, P)}
    assert dec.generate([a], max_new_tokens=8)[0] == greedy(variant, ctx[a], 8)
    assert prefilled[-1] == [len(ctx[a])]  # evicted: the whole context again
    assert a in cache and b not in cache and c in cache  # then B was the least recent
    assert dec.generate([c], max_new_tokens=8)[0] == greedy(variant, ctx[c], 8)
    assert prefilled[-1] == [1]


def test_paged_pool_running_short_shrinks_drafts_then_raises_and_keeps_state(monkeypatch):
    """A call whose requests the page pool cannot hold together to their limits runs them
    in turn (the second waits, then joins), output still plain greedy decoding. A request
    that outgrows the pool alone: its drafts shrink to the pages left, then the step that
    cannot get one more slot raises KVCacheFull naming kv_cache_tokens; the session's
    context holds what was emitted (its session tier too, its KV a prefix of it), and once
    it is closed the other session continues as plain greedy decoding."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1)]  # 97 and 23 tokens; the pool: 20 pages of 8
    g = greedy(variant, P[0], 45)
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner="paged", page_size=8,
                                                           kv_cache_tokens=8 * 20))
    # long drafts: more than the pool has room for in the second call
    steer(dec, "t0", P[0] + greedy(variant, P[0], 125, eos=None))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    fits = record_fit_width(monkeypatch)
    prefilled = record_prefills(dec, monkeypatch)
    out = dec.generate(sids, max_new_tokens=45)
    assert out == [g, greedy(variant, P[1], 45)]
    assert prefilled == [[len(P[0])], [len(P[1])]]  # one after the other
    fits.clear()
    with pytest.raises(KVCacheFull, match="kv_cache_tokens"):
        dec.generate(sids[:1], max_new_tokens=80)  # 142 + 80 tokens > the pool's 160
    monkeypatch.undo()
    # drafts were cut to fit
    assert any(got is not None and 0 < got < width for width, got in fits), fits
    assert fits[-1][1] is None
    cache = dec._paged.kv_cache
    sid, p = sids[0], P[0] + g
    ctx = dec._sessions[sid].context
    held = dec.store.arena.corpus_tokens(dec.store.session(sid).corpus).tolist()
    assert held == ctx and len(ctx) > len(p) + 1
    assert ctx[len(p):] == greedy(variant, p, len(ctx) - len(p), eos=None)
    assert 0 < dec._kv.kept_tokens(sid) <= len(ctx) - 1
    dec.close_session(sid)
    ctx = list(dec._sessions[sids[1]].context)
    assert dec.generate(sids[1:], max_new_tokens=8) == [greedy(variant, ctx, 8)]
    dec.close_session(sids[1])
    assert cache.num_free_pages == cache.num_pages


def test_paged_pool_too_small_for_the_contexts_raises_before_evicting():
    """Contexts that cannot fit even after freeing every idle session's KV: KVCacheFull
    before anything is freed; the idle session keeps its KV and continues."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (1, 3)]  # 23 and 97 tokens; the pool: 12 pages of 8
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner="paged", page_size=8,
                                                           kv_cache_tokens=8 * 12))
    a, b = (dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P))
    first = dec.generate([a], max_new_tokens=8)[0]
    cache = dec._paged.kv_cache
    held = cache.capacity(a)
    with pytest.raises(KVCacheFull, match="kv_cache_tokens.*13 pages of 8"):
        dec.generate([b], max_new_tokens=8)
    assert cache.capacity(a) == held and b not in cache
    assert dec._sessions[b].context == P[1]
    assert dec.generate([a], max_new_tokens=8) == [greedy(variant, P[0] + first, 8)]
    with pytest.raises(KVCacheFull):  # the same again: nothing changed in between
        dec.generate([b], max_new_tokens=8)


def record_hf_prefills(monkeypatch) -> list[list[int]]:
    """Per ``generate`` call on the hf runner: the tokens prefilled per session."""
    calls, prefill = [], HFRunner.prefill

    def wrapped(self, input_ids, past=None):
        calls.append([len(p) - (kv.length if kv else 0)
                      for p, kv in zip(input_ids, past or [None] * len(input_ids))])
        return prefill(self, input_ids, past)

    monkeypatch.setattr(HFRunner, "prefill", wrapped)
    return calls


def test_paged_loop_with_host_rings_coming_round_is_lossless(monkeypatch):
    """Every ``HostWriter`` of the loop (the drafter's, its arena's, the KV cache's) made
    with 64 bytes, so that each write reuses the bytes of a write a few before it: the
    paged loop still equals greedy decoding on a ragged batch, its sessions continued in a
    second call. No step keeps a view of a ring past its own launches."""
    made, init = [], agspec_gpu.host.HostWriter.__init__

    def tiny(self, nbytes, device):
        init(self, 64, device)
        made.append(self)

    monkeypatch.setattr(agspec_gpu.host.HostWriter, "__init__", tiny)
    variant, P = VARIANTS[2], prompts()
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner="paged", page_size=8,
                                                           kv_cache_tokens=4096))
    part = [1, 3, 4, 6, 7]
    sids = [dec.open_session(f"t{i % 2}", "coder", list(P[i])) for i in part]
    out = dec.generate(sids, max_new_tokens=24)
    for i, o in zip(part, out):
        assert o == greedy(variant, P[i], 24), i
    more = dec.generate(sids[1:4], max_new_tokens=8)
    for i, o, m in zip(part[1:4], out[1:4], more):
        assert m == greedy(variant, list(P[i]) + o, 8), i
    assert dec.stats["drafted"] > 0 and len(made) == 3
    assert all(w.nbytes < 1 << 12 for w in made)  # small rings: they came round often


@pytest.mark.parametrize("variant", [VARIANTS[1], VARIANTS[3]], ids=[IDS[1], IDS[3]])
def test_hf_runner_keeps_session_kv_between_calls(variant, monkeypatch):
    """runner="hf" (the default): a session's KV is kept between calls (the next call
    prefills the appended tool output and one token), batches of other compositions mix
    kept and fresh sessions, the least recently generated sessions' KV goes first past
    ``kv_cache_tokens``, close_session frees it; every output is plain greedy decoding's."""
    P = [list(prompts()[i]) for i in (3, 1, 6)]  # 97, 23 and 140 tokens
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(kv_cache_tokens=300))
    prefilled = record_hf_prefills(monkeypatch)
    a, b, c = sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    ctx = dict(zip(sids, P))

    def run(batch, n=8):
        out = dec.generate(batch, max_new_tokens=n)
        for sid, o in zip(batch, out):
            assert o == greedy(variant, ctx[sid], n), sid
            ctx[sid] = ctx[sid] + o
        return [dec._kv.kept_tokens(s) for s in sids]

    assert run([a, b]) == [len(ctx[a]) - 1, len(ctx[b]) - 1, 0]
    assert prefilled[-1] == [len(P[0]), len(P[1])]
    tool = tok().encode("$ ls\nsrc tests\n")
    dec.append(a, tool)
    ctx[a] = ctx[a] + tool
    run([b, a])  # another order: the kept KV goes with its session
    assert prefilled[-1] == [1, len(tool) + 1]
    # a's 126 and c's 147 kept tokens leave no room for b's 38 under 300: b, the least
    # recently generated, is freed
    held = run([c, a])
    assert held == [len(ctx[a]) - 1, 0, len(ctx[c]) - 1]
    assert prefilled[-1] == [len(P[2]), 1]
    run([b])
    assert prefilled[-1] == [len(ctx[b]) - 8]  # freed: its whole context again
    s = dec.stats
    assert (s["prefills"], s["prefill_tokens"]) == (len(prefilled), sum(map(sum, prefilled)))
    kept = dec._kv._kept[a].tensors
    assert kept is not None and kept.nbytes > 0
    dec.close_session(a)
    assert dec._kv.kept_tokens(a) == 0 and a not in dec._kv._kept


def test_decoder_loads_role_profiles(tmp_path):
    from agspec_gpu.controller import profile_roles

    out = tmp_path / "roles.json"
    profile_roles({"coder": [0.5 ** k for k in range(1, 33)]}, out=out)
    dec = SpecDecoder(model(), tok(), DecoderConfig(profiles=str(out)))
    roles = dec.drafter._roles
    assert roles["coder"].draft_cap < 32 and roles["coder"].initial_scale == 4.0
    assert roles["planner"].draft_cap == 16  # a role the file does not name is kept
    sid = dec.open_session("t", "coder", list(prompts()[2]))
    assert dec.generate([sid], max_new_tokens=8) == [greedy(("llama", "sdpa"), prompts()[2], 8)]


def test_workspace_file_drafts_are_lossless():
    variant = VARIANTS[1]
    P = list(prompts()[6])
    g = greedy(variant, P)
    dec = SpecDecoder(model(variant), tok())
    sid = dec.open_session("t0", "coder", P)
    # decoded text re-encodes to other ids where the random model's tokens do not round-trip
    # through BPE, so this draft is partly accepted only; the output must not care
    assert dec.add_workspace_file(sid, "src/mod.py", tok().decode(P + g)) > 0
    assert dec.generate([sid], max_new_tokens=NEW) == [g]
    assert dec.stats["drafted"] > 0


def emit_as_model(dec: SpecDecoder, sid: str, ids: list[int]) -> None:
    """Commits ``ids`` as the model's output through the own loop: the drafts cut to
    nothing, row 0's argmax is the next token (one token a step)."""
    for t in ids:
        draft = dec.propose([sid]).capped(0).narrowed(1)
        logits = torch.zeros(1, 2, VOCAB)
        logits[0, 0, t] = 1
        dec.commit([sid], draft, logits)


def draft_follows(draft: DraftBatch, b: int, continuation: list[int]) -> int:
    """How many tokens of ``continuation`` a root-to-node path of tree ``b`` spells."""
    n = int(draft.num_draft_tokens[b])
    toks, pars = draft.token_ids[b, :n].tolist(), draft.parents[b, :n].tolist()
    node, depth = -1, 0
    while depth < len(continuation):
        kids = [j for j in range(n) if pars[j] == node and toks[j] == continuation[depth]]
        if not kids:
            break
        node, depth = kids[0], depth + 1
    return depth


def test_append_captures_the_files_an_agent_reads_and_writes():
    """``append(sid, ids, text=...)``: the files a real tool output shows, read with the
    command the model generated (a mini-swe-agent ``nl``/``sed`` read, which needs it), and
    the files that generated message wrote (a heredoc) join the tenant's workspace tier;
    another session of the tenant then drafts the file's text, another tenant's does not."""
    from agspec_gpu.capture import capture_agent_writes, capture_tool_output
    from agspec_gpu.trajectories import load_sessions

    path = Path("/work/shared/data/trajectories/dev/mini_swe_agent__gemini-3-pro-preview.jsonl.gz")
    msgs = load_sessions(path, limit=1)[0].messages
    pairs = list(zip(msgs, msgs[1:]))
    write = next((a, t) for a, t in pairs
                 if a.role == "assistant" and t.role != "assistant" and
                 capture_agent_writes(a.content))
    read = next((a, t) for a, t in pairs
                if a.role == "assistant" and t.role == "tool" and
                capture_tool_output(a.content, t.content) and
                not capture_tool_output(None, t.content))
    shown = capture_tool_output(read[0].content, read[1].content)
    dec = SpecDecoder(model(VARIANTS[1]), tok())
    a = dec.open_session("t0", "coder", tok().encode(msgs[0].content)[:64])
    paths = []
    for message, output in (write, read):
        emit_as_model(dec, a, tok().encode(message.content))
        paths += dec.append(a, tok().encode(output.content), text=output.content)
    assert paths == [f.path for f in capture_agent_writes(write[0].content)] + \
        [f.path for f in capture_tool_output(write[0].content, write[1].content)] + \
        [f.path for f in shown]
    assert dec.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t0") > 0
    assert dec.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t1") == 0
    # a second session of the tenant re-types the file: its drafts quote the workspace
    file_ids = tok().encode(shown[0].text)
    at = len(file_ids) // 2
    b = dec.open_session("t0", "coder", file_ids[:at])
    c = dec.open_session("t1", "coder", file_ids[:at])
    draft = dec.propose([b, c])
    follows = [draft_follows(draft, b, file_ids[at:]) for b in range(2)]
    # measured: 14 tokens from the workspace; 4 for the other tenant, from what its own
    # prompt repeats
    assert follows[0] >= 8 and follows[1] < follows[0] // 2, follows
    # bad text: a clear error, the session unchanged
    n = len(dec._sessions[a].context)
    surrogate = "1|def f():\n2|    return '\ud800'\n"  # (json.loads of a lone \\ud800)
    for bad in (b"bytes", surrogate):
        with pytest.raises(ValueError, match="text"):
            dec.append(a, [1, 2], text=bad)
    for call in (lambda: dec.add_workspace_file(a, "f.py", surrogate),
                 lambda: dec.add_workspace_file(a, "\udcff.py", "x = 1\n"),
                 lambda: dec.generate([a], max_new_tokens=2, stop=["ok", "\udcff"])):
        with pytest.raises(ValueError, match=r"(text|path|stop): .* has no UTF-8 form"):
            call()
    assert len(dec._sessions[a].context) == n and dec.append(a, [1, 2]) == []



def test_a_message_that_ended_at_its_end_token_still_shows_its_command():
    """``generate`` keeps a request's end token in the message; ``append`` decoded it into
    the command (``...```<|endoftext|>``), so the fence, heredoc and edit parsers missed
    it: half the dev trajectories' captures were lost this way (a helper's count)."""
    from agspec_gpu.capture import capture_tool_output
    from agspec_gpu.trajectories import load_sessions

    path = Path("/work/shared/data/trajectories/dev/mini_swe_agent__gemini-3-pro-preview.jsonl.gz")
    msgs = load_sessions(path, limit=1)[0].messages
    eos = tok().eos_id
    command, output = next(
        (a, t) for a, t in zip(msgs, msgs[1:]) if a.role == "assistant" and t.role == "tool"
        and capture_tool_output(a.content, t.content)
        and not capture_tool_output(a.content + tok().decode([eos]), t.content))
    shown = [f.path for f in capture_tool_output(command.content, output.content)]
    dec = SpecDecoder(model(VARIANTS[1]), tok())
    for tail in ([], [eos]):
        sid = dec.open_session(f"t{len(tail)}", "coder", tok().encode(msgs[0].content)[:64])
        for t in tok().encode(command.content) + tail:  # the model's tokens, its end token
            draft = dec.propose([sid]).capped(0).narrowed(1)
            logits = torch.zeros(1, 2, VOCAB)
            logits[0, 0, t] = 1
            dec.commit([sid], draft, logits, eos_id=None)
        assert dec.append(sid, tok().encode(output.content), text=output.content) == shown

def test_open_session_captures_the_files_its_prompt_shows():
    """``open_session(..., text=...)``: a prompt that shows a file (here a real SWE-agent
    editor view, recognised from the text alone) puts it in the tenant's workspace, so a later
    session of the tenant drafts it; bad text opens nothing."""
    from agspec_gpu.capture import capture_tool_output
    from agspec_gpu.trajectories import load_sessions

    path = Path("/work/shared/data/trajectories/dev/swe_agent__claude-sonnet-4.jsonl.gz")
    shown = next(m.content for s in load_sessions(path, limit=3) for m in s.messages
                 if m.role == "tool" and capture_tool_output(None, m.content))
    file_text = capture_tool_output(None, shown)[0].text
    dec = SpecDecoder(model(VARIANTS[1]), tok())
    for bad in (b"bytes", shown + "\ud800"):  # (a lone surrogate: no UTF-8 form)
        with pytest.raises(ValueError, match="text"):
            dec.open_session("t0", "coder", [1, 2, 3], text=bad)
    assert not dec._sessions and dec.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t0") == 0
    dec.open_session("t0", "coder", tok().encode(shown), text=shown)
    dec.open_session("t1", "coder", [1, 2, 3])  # no text: nothing captured
    assert dec.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t0") > 0
    assert dec.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t1") == 0
    file_ids = tok().encode(file_text)
    at = len(file_ids) // 2
    b = dec.open_session("t0", "coder", file_ids[:at])
    assert draft_follows(dec.propose([b]), 0, file_ids[at:]) >= 8
    # a file past the workspace's whole budget: left out of a capture (the session opens),
    # refused by add_workspace_file naming text (eviction keeps the newest file whole)
    small = SpecDecoder(model(VARIANTS[1]), tok(), DecoderConfig(
        tiers=TierConfig(workspace_budget_tokens=len(file_ids))))
    sid = small.open_session("t0", "coder", tok().encode(shown), text=shown)
    assert small.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t0") == 0
    with pytest.raises(ValueError, match=rf"text: \d+ tokens in its \d forms exceed "
                                         rf"TierConfig.workspace_budget_tokens={len(file_ids)}"):
        small.add_workspace_file(sid, "f.py", file_text)
    assert small.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t0") == 0
    assert small.add_workspace_file(sid, "g.py", file_text[:200]) > 0


def test_global_corpus_from_a_path(tmp_path):
    """``global_corpus=`` takes the path of an ``agspec-gpu build-global`` file, as
    DESIGN.md's API does: loaded, checked against the tokenizer, drafted from (lossless);
    a corpus of another tokenizer is refused naming it."""
    import dataclasses

    from agspec_gpu.tiers import build_global_corpus

    variant = VARIANTS[1]
    P = list(prompts()[6])
    g = greedy(variant, P)
    src = tmp_path / "src"
    src.mkdir()
    (src / "mod.py").write_text(tok().decode(P + g))
    path = tmp_path / "global.agspec"
    build_global_corpus([src], tok(), path)
    dec = SpecDecoder(model(variant), tok(), global_corpus=str(path))
    sid = dec.open_session("t0", "coder", P)
    assert dec.generate([sid], max_new_tokens=NEW) == [g]
    assert dec.stats["drafted"] > 0
    other = dataclasses.replace(tok(), name="other-bpe", fingerprint="f" * 64)
    build_global_corpus([src], other, tmp_path / "foreign.agspec")
    with pytest.raises(ValueError, match="tokenizer"):
        SpecDecoder(model(variant), tok(), global_corpus=tmp_path / "foreign.agspec")

    class Located:  # any os.PathLike names a file (it was refused unless a str or Path)
        def __fspath__(self):
            return str(path)

    assert SpecDecoder(model(variant), tok(), global_corpus=Located()).store.global_cid \
        is not None


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=[IDS[0], IDS[3]])
def test_mixed_trees_in_one_batch(variant, monkeypatch):
    """One batch: a fully accepted chain, a draft rejected at its first token, a tree whose
    second root branch is the right one, and a request with no steered draft."""
    P = [list(prompts()[i]) for i in (3, 6, 1, 0)]
    g = [greedy(variant, p) for p in P]
    W = other_text(40)
    assert W[0] != g[1][1] and W[0] != g[2][1]
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "full", P[0] + g[0])
    steer(dec, "reject", P[1] + g[1][:1] + W)            # after the first token: wrong text
    steer(dec, "branch", P[2] + g[2])                    # older: the right continuation
    steer(dec, "branch", P[2] + g[2][:1] + W)            # newer: wrong, drafted first
    sids = [dec.open_session(t, "coder", p) for t, p in zip(("full", "reject", "branch", "d"), P)]
    drafts = record_drafts(dec, monkeypatch)
    chunks, on_tokens = chunk_recorder()
    out = dec.generate(sids, max_new_tokens=NEW, on_tokens=on_tokens)
    assert out == g
    first = drafts[0]
    # fully accepted: long accepted steps
    assert len(chunks[sids[0]][1]) > 8, chunks[sids[0]]
    # rejected at the first token: a draft was proposed, one token (the bonus) came out
    assert root_children(first, 1) == [W[0]]
    assert len(chunks[sids[1]][1]) == 1
    # non-first branch: the first root child is wrong, a later one is right and wins
    kids = root_children(first, 2)
    assert kids[0] != g[2][1] and g[2][1] in kids[1:], (kids, g[2][:2])
    assert len(chunks[sids[2]][1]) > 1
    assert dec.stats["accepted"] > 0


def test_speculate_false_per_request():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (3, 6, 1, 7)]
    g = [greedy(variant, p) for p in P]
    dec = SpecDecoder(model(variant), tok())
    for i, p in enumerate(P):
        steer(dec, f"t{i}", p + g[i])  # every request could draft its whole output
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    chunks, on_tokens = chunk_recorder()
    spec = [False, True, False, True]
    # the drafter is told which nodes were verified: none of an opted-out request's
    verified, observe = [], dec.drafter.observe
    def spy(sids_, *args, num_verified=None, **kw):
        if num_verified is not None:  # None: no cut (or no proposal: only opt-outs left)
            verified.extend(zip(sids_, num_verified.tolist()))
        return observe(sids_, *args, num_verified=num_verified, **kw)
    dec.drafter.observe = spy
    out = dec.generate(sids, max_new_tokens=NEW, speculate=spec, on_tokens=on_tokens)
    assert out == g
    for sid, s in zip(sids, spec):
        sizes = [len(c) for c in chunks[sid]]
        assert (max(sizes) > 1) == s, (sid, sizes)
    assert {sid for sid, _ in verified} == set(sids)
    assert all(n == 0 for sid, n in verified if not spec[sids.index(sid)])
    assert any(n > 0 for sid, n in verified if spec[sids.index(sid)])


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_every_request_opted_out_skips_the_drafter(runner, monkeypatch):
    """With no request speculating, no step asks the drafter for a draft; it still takes
    the emitted tokens (a later session of the tenant drafts them)."""
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (3, 6)]
    g = [greedy(variant, p) for p in P]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=1 << 12))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    drafts = record_drafts(dec, monkeypatch)
    chunks, on_tokens = chunk_recorder()
    assert dec.generate(sids, max_new_tokens=NEW, speculate=False, on_tokens=on_tokens) == g
    assert drafts == [] and dec.stats["steps"] == NEW - 1 and dec.stats["drafted"] == 0
    assert all(len(c) == 1 for sid in sids for c in chunks[sid])
    dec.close_session(sids[0])  # its output joins the tenant's history
    again = dec.open_session("t0", "coder", P[0])
    chunks.clear()
    assert dec.generate([again], max_new_tokens=NEW, on_tokens=on_tokens) == [g[0]]
    assert drafts and max(len(c) for c in chunks[again]) > 8, chunks[again]


@pytest.mark.parametrize("batch", [1, 4])
def test_paged_step_launches_few_ops_outside_its_graphs(batch, monkeypatch):
    """What one speculative step of the paged runner launches one by one on a GPU, counted here on
    the CPU: every torch op, with the verification forward and the drafter's two halves as the
    graph replays they are there (VerifyGraphs and the drafter's StepGraphs run their padded
    steps eagerly here) and each Triton-backed function as its launches; and what it allocates
    outside them: nothing (session 25: the match, the greedy walk and its argmax write into
    buffers kept for the batch, the commit's KV lengths and the drafter's padded commit inputs
    are written in place; six allocations before, and twelve more inside the match's and the
    walk's launchers). Now 20-26 at B = 1 and 4 (session 28: the append also grows the drafter's
    kept lengths; 21-27 in session 27; session 26: the session tier's append is one launch,
    three ops before, and the commit's padding is written only over columns that held data;
    25-28 in session 25; session 24: the match reads its queries from the drafter's ring and
    writes the candidate windows in its own launch, two launches fewer; 27-33 in session 21: the
    match kernel writes every level slot, so its two output fills went, and the step's host
    reads copy into a pinned buffer, as uncounted here as the host-to-device copies; 30-36 in
    session 20, 31-37 in session 19; 60-64 before the drafter's graph inputs were copied one
    launch per dtype, the verification step's inputs staged without re-padding every row, and
    the greedy walk read the flat logits rows' argmax and wrote the bonus tokens itself). Before
    the two-kernel planning (the sink included), the greedy acceptance in one launch,
    host-counted stats, no vocabulary check of the decoder's own drafts and no clones of them:
    143-147 (counted the same way, the planner's fills as the launches they were). Session 41:
    21-27, the split attention's prefix pages one launch more (its tree kernel runs inside the
    verification graph). Session 43: 22-28, the drafter's commit queued before the step's
    read (deferred): its session-tier append copies the device counts it settles later;
    and the next step's propose queued there too when no request can end in the step: a
    step that uses it proposes nothing (20-23), one without it (none proposed ahead, or
    one that did not stand) proposes afresh and ahead both (up to 30)."""
    import agspec_gpu.accept as accept_mod
    import agspec_gpu.drafter as drafter_mod
    import agspec_gpu.index as index_mod
    import agspec_gpu.runners.paged_batch as paged_batch_mod
    import agspec_gpu.running_batch as running_batch_mod
    import agspec_gpu.tree as tree_mod
    from agspec_gpu.runners.verify_graphs import VerifyGraphs
    from op_count import CountOps

    P = [list(prompts()[i]) for i in (3, 6, 1, 7)][:batch]
    g = [greedy(VARIANTS[0], p) for p in P]
    dec = SpecDecoder(model(VARIANTS[0]), tok(), DecoderConfig(
        runner="paged", page_size=8, kv_cache_tokens=1 << 12, max_batch=4))
    for i, p in enumerate(P):  # drafts accepted for a while, then the model's own tokens
        steer(dec, f"t{i}", p + g[i][:12])
    count = CountOps()
    # a paged decoder graphs its verification only on FlashInfer (a GPU); the padded
    # buckets run eagerly here stand for the graphs' replays
    assert dec._capture_verify_graphs(8) is None and "not FlashInfer" in dec.verify_graph_error
    dec._verify_graphs = VerifyGraphs(dec._paged, [1, 2, 4], dec.drafter.config.max_nodes)
    dec._paged.forward = count.launches(dec._paged.forward, "verify graph")
    d = dec.drafter
    d._graphs = d._step_graphs(use_graphs=False)
    for graph, name in zip(d._graphs, ("propose graph", "commit graph")):
        graph.fn = count.launches(graph.fn, name)
    for mod, name, n in ((drafter_mod, "suffix_match", 1), (tree_mod, "launch_tree_mask", 2),
                         (tree_mod, "plan_prefix_pages", 1),  # the split attention's pages
                         (accept_mod, "greedy_tree_accept", 1),
                         (paged_batch_mod, "kv_compact", 1), (index_mod, "arena_append", 1)):
        monkeypatch.setattr(mod, name, count.launches(getattr(mod, name), name, n))
    per_step = []
    step = running_batch_mod.RunningBatch.verify_step

    def counted(self, generator):
        count.ops.clear()
        count.allocs.clear()
        with count.mode:
            out = step(self, generator)
        per_step.append((len(self.reqs.sids), len(count.ops), list(count.allocs)))
        return out
    monkeypatch.setattr(running_batch_mod.RunningBatch, "verify_step", counted)
    # a request leaving (its KV kept, the batch's rows selected) is a per-request cost
    monkeypatch.setattr(running_batch_mod.RunningBatch, "leave",
                        count.pause(running_batch_mod.RunningBatch.leave))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    assert dec.generate(sids, max_new_tokens=NEW) == g
    assert dec.stats["accepted"] > 0 and len(per_step) > 2
    # the first step of a batch size also fills its buckets' new buffers
    again = [(n, allocs) for i, (b, n, allocs) in enumerate(per_step)
             if any(b == c for c, _, _ in per_step[:i])]
    assert again and max(n for n, _ in again) <= 30, per_step
    # and allocates nothing (buffers sized when the decoder and the batch were built; the
    # Triton launchers write into them: suffix_match, the greedy walk, the planner)
    assert all(allocs == [] for _, allocs in again), per_step


@pytest.mark.parametrize("variant", [VARIANTS[1], VARIANTS[2]], ids=[IDS[1], IDS[2]])
def test_generate_continues_and_appended_tool_output(variant):
    P = [list(prompts()[i]) for i in (2, 5, 0)]
    dec = SpecDecoder(model(variant), tok())
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    out1 = dec.generate(sids, max_new_tokens=12)
    out2 = dec.generate(sids, max_new_tokens=20)
    for p, a, b in zip(P, out1, out2):
        assert a + b == greedy(variant, p, 32)
    tool = tok().encode("$ pytest -q tests/test_decoder.py\n3 passed in 0.12s\n")
    dec.append(sids[0], tool)
    dec.append(sids[2], torch.tensor(tool))
    ctx = [p + a + b for p, a, b in zip(P, out1, out2)]
    ctx[0] += tool
    ctx[2] += tool
    assert_greedy(dec, variant, sids, ctx)


# ---------------------------------------------------------------- EOS and stop strings
def _first_new(g: list[int], at: int) -> int:
    """The first position >= ``at`` whose token does not occur earlier in ``g``."""
    return next(j for j in range(at, len(g)) if g[j] not in g[:j])


@pytest.mark.parametrize("at", [0, 17])
def test_eos_inside_accepted_draft(at, monkeypatch):
    variant = VARIANTS[1]
    P, Q = list(prompts()[3]), list(prompts()[1])
    g = greedy(variant, P, 48, eos=None)
    j = _first_new(g, at)
    eos = g[j]
    assert greedy(variant, P, 48, eos=eos) == g[:j + 1]
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P + g)
    sids = [dec.open_session("t0", "coder", P), dec.open_session("t1", "coder", Q)]
    steps = record_steps(dec, monkeypatch)
    out = dec.generate(sids, max_new_tokens=48, eos_id=eos)
    assert out == [g[:j + 1], greedy(variant, Q, 48, eos=eos)]
    if j > 0:  # EOS was an accepted draft token with more verified tokens after it
        assert accepted_with_more_after(steps, 0, j)


# cl100k ids the model's vocabulary covers that hold no text
TEXTLESS = {100256} | set(range(100261, 100276))


def test_output_with_ids_that_hold_no_text():
    """A model may emit an id its tokenizer has no text for (a hole of cl100k's id range,
    which the output layer covers; this tiny model does at the 13th token): stop strings
    are matched on the text around it, and the output, with the id, appended to and
    captured from, as with any other token (tiktoken's decode raised KeyError there)."""
    variant = VARIANTS[1]
    P = tok().encode("useSignalEvaluation.ts")
    g = greedy(variant, P, 24, eos=None)
    hole = next(j for j, t in enumerate(g) if t in TEXTLESS)  # (StopIteration: no hole)
    after = tok().decode(g[hole + 1:hole + 3])
    assert after.strip() and after not in tok().decode(g[:hole + 1])
    dec = SpecDecoder(model(variant), tok())
    sids = [dec.open_session("t0", "coder", P) for _ in range(2)]
    out = dec.generate(sids, max_new_tokens=24, eos_id=None, stop=[[after], ["never"]])
    assert out[1] == g and hole + 1 < len(out[0]) <= hole + 3
    assert out[0] == g[:len(out[0])] and after in tok().decode(out[0])
    dec.append(sids[1], tok().encode("\n$ ls\n"))
    ctx = P + g + tok().encode("\n$ ls\n")
    assert dec.generate([sids[1]], max_new_tokens=8, eos_id=None) == \
        [greedy(variant, ctx, 8, eos=None)]

def test_stop_string_inside_accepted_draft(monkeypatch):
    variant = VARIANTS[1]
    P = list(prompts()[3])
    g = greedy(variant, P, 48, eos=None)
    decode = tok().decode
    # a stop string ending inside token j and spanning into token j-1 (multi-token)
    for j in range(15, 40):
        piece = decode(g[j:j + 1])
        stop = decode(g[:j + 1])[-(len(piece) + 2):]
        if piece.strip() and "\ufffd" not in stop and \
                next(k for k in range(1, 49) if stop in decode(g[:k])) == j + 1:
            break
    else:
        pytest.fail("no usable stop string in the continuation")
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P + g)
    sid = dec.open_session("t0", "coder", P)
    steps = record_steps(dec, monkeypatch)
    out = dec.generate([sid], max_new_tokens=48, eos_id=None, stop=["never in this text", stop])
    assert out == [g[:j + 1]], (j, stop)
    assert accepted_with_more_after(steps, 0, j)
    # one string is one stop string (not its characters)
    again = dec.open_session("t0", "coder", P)
    assert dec.generate([again], max_new_tokens=48, eos_id=None, stop=stop) == [g[:j + 1]]
    # one list per session: only the session that names the stop string ends at it
    pair = [dec.open_session("t0", "coder", P), dec.open_session("t1", "coder", P)]
    out = dec.generate(pair, max_new_tokens=48, eos_id=None, stop=[[stop], ["never"]])
    assert out == [g[:j + 1], g]
    # None: no stop strings (as commit takes it, and as servers pass an absent field)
    none = dec.open_session("t0", "coder", P)
    assert dec.generate([none], max_new_tokens=48, eos_id=None, stop=None) == [g]
    fresh = dec.open_session("t0", "coder", P)
    dec.submit(fresh, max_new_tokens=1, eos_id=None, stop=None)
    assert [(o.token_ids, o.finish_reason) for o in dec.step()] == [(g[:1], "length")]
    for bad in ([[stop]], [[stop], [""]], [[stop], [3]]):
        with pytest.raises(ValueError, match="stop"):
            dec.generate(pair, max_new_tokens=4, stop=bad)


# ---------------------------------------------------------------- sampling
def _sampled(variant, P, g, params, seed):
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + g)  # drafts that sampling may accept
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    return dec.generate(sids, max_new_tokens=24, sampling=params,
                        generator=torch.Generator().manual_seed(seed))


def test_sampling_deterministic_under_seed_and_greedy_limits():
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 0, 7)]
    g = greedy(variant, P[0], 24)
    hot = SamplingParams(temperature=0.8)
    a = _sampled(variant, P, g, hot, 1234)
    assert a == _sampled(variant, P, g, hot, 1234)
    assert a != _sampled(variant, P, g, hot, 99)  # the generator is really used
    refs = [greedy(variant, p, 24) for p in P]
    assert _sampled(variant, P, g, SamplingParams(temperature=0.0), 7) == refs
    # top-k 1 goes through the sampling path (multinomial + rejection sampling) yet is greedy
    # (where the largest logit is not tied: top-k keeps ties, and this float32 model has none)
    assert _sampled(variant, P, g, SamplingParams(temperature=1.0, top_k=1), 7) == refs


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_seeded_sampling_is_the_same_in_any_batch_and_without_speculation(runner):
    """``SamplingParams(seed=...)``: a request's sampled output depends on its context and
    seed only. One batch with speculation (drafts accepted, some sessions unseeded or
    greedy beside them), each session alone without speculation, another generator and
    more sessions than max_batch all give the seeded sessions the same tokens; another
    seed gives other tokens."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 0, 7, 5)]
    g = greedy(variant, P[0], 30)
    cfg = DecoderConfig(runner=runner, page_size=8, kv_cache_tokens=4096, max_batch=4)

    def run(sids_of, params, speculate=True, seed=0, max_batch=4):
        dec = SpecDecoder(model(variant), tok(), replace(cfg, max_batch=max_batch))
        steer(dec, "t0", P[0] + g)  # drafts that low-temperature sampling accepts
        sids = [dec.open_session(f"t{i}", "coder", P[i]) for i in sids_of]
        out = dec.generate(sids, max_new_tokens=30, sampling=[params[i] for i in sids_of],
                           speculate=speculate, eos_id=None,
                           generator=torch.Generator().manual_seed(seed))
        return dict(zip(sids_of, out)), dec.session_stats(sids[0])

    cold = [SamplingParams(0.05, top_k=3, seed=11), SamplingParams(0.9, seed=12),
            SamplingParams(0.9), SamplingParams(0.0, seed=13)]
    together, stats = run([0, 1, 2, 3], cold)
    assert stats.num_accepted > 0, stats  # the seeded request walked accepted drafts
    for i in (0, 1, 3):
        alone, _ = run([i], cold, speculate=False, seed=5)
        assert alone[i] == together[i], i
    assert together[3] == greedy(variant, P[3], 30, eos=None)
    waves, _ = run([1, 3, 0], cold, seed=9, max_batch=1)  # one at a time, in another order
    assert all(waves[i] == together[i] for i in (0, 1, 3))
    other, _ = run([1], [None, SamplingParams(0.9, seed=99)])
    assert other[1] != together[1]


def test_per_session_sampling_and_limits():
    """One batch, per-session SamplingParams and max_new_tokens (as a server batches
    requests of different roles): the greedy sessions are plain greedy decoding whatever
    their neighbours sample, each stops at its own limit (0: not run), every session tier
    holds its context; bad per-session lists raise naming the argument."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 0, 7, 1)]
    g = greedy(variant, P[0], 24)
    hot = SamplingParams(temperature=0.9, top_k=40)
    params = [None, hot, SamplingParams(temperature=0.0), SamplingParams(0.0, 5)]
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + g)
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    out = dec.generate(sids, max_new_tokens=[24, 12, 9, 0], sampling=params,
                       generator=torch.Generator().manual_seed(5))
    assert out[0] == g and out[2] == greedy(variant, P[2], 9) and out[3] == []
    assert len(out[1]) == 12 and all(0 <= t < VOCAB for t in out[1])
    assert out[1] != greedy(variant, P[1], 12)  # really sampled (temperature 0.9)
    for sid, p, o in zip(sids, P, out):
        held = dec.store.arena.corpus_tokens(dec.store.session(sid).corpus).tolist()
        assert held == p + o
    assert dec.generate(sids[3:], max_new_tokens=[5]) == [greedy(variant, P[3], 5)]
    assert dec.generate(sids, max_new_tokens=0) == [[], [], [], []]
    assert all(dec.session_stats(s).finish_reason == "length" for s in sids)
    bad = [dict(max_new_tokens=[4, 4]), dict(max_new_tokens=[4, 4, -1, 4]),
           dict(max_new_tokens=4.5), dict(sampling=[hot, hot]),
           dict(sampling=[hot, 0.5, None, None]), dict(sampling="greedy")]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw))):
            dec.generate(sids, **{"max_new_tokens": 4, **kw})
    assert dec.generate(sids[2:3], max_new_tokens=6) == [greedy(variant, P[2] + out[2], 6)]


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_finished_requests_leave_the_batch(runner, monkeypatch):
    """A request that finishes early leaves the batch before the next step: later steps
    verify only the others, the finished session keeps its KV as it was when it left (its
    next call prefills one token; paged, it takes no pages after it left), and every output
    is plain greedy decoding's (a sampled neighbour leaving does not disturb the rest)."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1, 7)]
    limits = (3, 30, 12)
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=4096))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    cls = HFRunner if runner == "hf" else PagedBatch
    sizes, verify, select = [], cls.verify_rows, cls.select_rows
    held = {}

    def recorded(self, draft, root, **kw):
        sizes.append(draft.batch_size)
        return verify(self, draft, root, **kw)

    def selected(self, rows):
        if runner == "paged":  # the pages of the sessions that leave, as they leave
            held.update({sid: self.runner.kv_cache.capacity(sid)
                         for b, sid in enumerate(self._seq_ids) if b not in rows})
        return select(self, rows)

    monkeypatch.setattr(cls, "verify_rows", recorded)
    monkeypatch.setattr(cls, "select_rows", selected)
    prefilled = record_hf_prefills(monkeypatch) if runner == "hf" else \
        record_prefills(dec, monkeypatch)
    out = dec.generate(sids, max_new_tokens=list(limits),
                       sampling=[None, None, SamplingParams(temperature=0.9)],
                       generator=torch.Generator().manual_seed(1))
    assert out[:2] == [greedy(variant, p, n) for p, n in zip(P[:2], limits[:2])]
    assert len(out[2]) == 12
    assert sizes[0] == 3 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True), sizes
    if runner == "paged":
        cache = dec._paged.kv_cache
        assert held and all(cache.capacity(sid) == n for sid, n in held.items()), held
    ctx = [p + o for p, o in zip(P, out)]
    assert dec.generate(sids, max_new_tokens=4) == [greedy(variant, c, 4) for c in ctx]
    assert prefilled[-1] == [1, 1, 1]


# ---------------------------------------------------------------- bad input
def test_keys_and_values_of_different_head_sizes_are_lossless():
    """Multi-head latent attention (DeepSeek-V3: keys of qk_nope + qk_rope dims, values of
    v_head_dim) through the hf runner: its commit moves keys and values each by its own
    shape; greedy output equals plain greedy decoding with drafts accepted."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    m = transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    P = [list(prompts()[i]) for i in (1, 3)]
    want = [greedy_generate(m, p, 16, eos_id=tok().eos_id) for p in P]
    dec = SpecDecoder(m, tok())
    for i, (p, w) in enumerate(zip(P, want)):
        steer(dec, f"t{i}", p + w)
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    assert dec.generate(sids, max_new_tokens=16) == want
    assert dec.stats["accepted"] > 0


def test_mismatched_vocabularies():
    small = _tiny("llama", "sdpa", vocab=50000)
    with pytest.raises(ValueError, match="vocab"):
        SpecDecoder(small, tok())


def test_bad_token_ids_and_survivors():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (1, 3)]
    dec = SpecDecoder(model(variant), tok())
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    for bad in ([5, VOCAB], [-1, 5], torch.tensor([[1, 2]])):
        with pytest.raises(ValueError, match="prompt_ids"):
            dec.open_session("t0", "coder", bad)
    with pytest.raises(ValueError, match="prompt_ids"):
        dec.open_session("t0", "coder", [])
    with pytest.raises(ValueError, match="token_ids"):
        dec.append(sids[0], [7, VOCAB + 3])  # rejected whole: the context stays as it was
    with pytest.raises(ValueError, match="distinct"):
        dec.generate([sids[0], sids[1], sids[0]], max_new_tokens=4)
    with pytest.raises(ValueError, match="speculate"):
        dec.generate(sids, max_new_tokens=4, speculate=[True])
    for bad in ("hello", b"ab", torch.tensor([1.0, 2.0]), torch.tensor([True]), [1, 2.5],
                [True, 3], 7):
        with pytest.raises(ValueError, match="prompt_ids"):
            dec.open_session("t0", "coder", bad)
    with pytest.raises(ValueError, match="tenant"):  # 5 and "5" must not be one tenant
        dec.open_session(5, "coder", [1, 2])
    with pytest.raises(ValueError, match="role"):
        dec.open_session("t0", "no-such-role", [1, 2])
    with pytest.raises(ValueError, match="path"):
        dec.add_workspace_file(sids[0], 5, "x = 1\n")
    with pytest.raises(ValueError, match="text"):
        dec.add_workspace_file(sids[0], "a.py", b"x = 1\n")
    with pytest.raises(ValueError, match="session_ids"):  # one id, not a list of them
        dec.generate(sids[0], max_new_tokens=4)
    for kw in (dict(max_new_tokens=True), dict(eos_id=VOCAB), dict(eos_id=-5),
               dict(stop=[""]), dict(stop=["a", 3]), dict(speculate="yes"),
               dict(generator="seed")):
        with pytest.raises(ValueError, match=next(iter(kw))):
            dec.generate(sids, **{"max_new_tokens": 4, **kw})
    for bad in (3, "", sids[0]):
        with pytest.raises(ValueError, match="session_id"):
            dec.open_session("t0", "coder", [1, 2], session_id=bad)
    # unordered containers hold no token order (a set sorted and deduplicated them)
    for bad in ({3, 1, 2}, {5: "a"}, frozenset([4])):
        with pytest.raises(ValueError, match="prompt_ids: expected token ids"):
            dec.open_session("t0", "coder", bad)
        with pytest.raises(ValueError, match="token_ids: expected token ids"):
            dec.append(sids[0], bad)
    with pytest.raises(ValueError, match="role: expected a str"):  # not "unhashable type"
        dec.open_session("t0", ["coder"], [1, 2])
    with pytest.raises(ValueError, match=r"stop: expected a string or strings, got b'x'"):
        dec.generate(sids, max_new_tokens=4, stop=b"x")
    for kw in (dict(max_new_tokens=[2]), dict(sampling=[SamplingParams()]),
               dict(speculate=[True]), dict(stop=[["a"]])):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}: submit\\(\\) takes one"):
            dec.submit(sids[0], **kw)
    assert dec.queued == []
    # a caller's id of the automatic ids' form: the next automatic id passes it by
    probe = dec.open_session("t0", "coder", [1, 2])
    prefix, n = probe.rsplit("s", 1)
    taken = [dec.open_session("t0", "coder", [1, 2], session_id=f"{prefix}s{int(n) + k}")
             for k in (2, 3)]
    auto = dec.open_session("t0", "coder", [1, 2])
    assert auto not in sids + taken + [probe] and auto.startswith(prefix)
    for s in taken + [probe, auto]:
        dec.close_session(s)
    assert_greedy(dec, variant, sids, P)


def test_config_fields_of_other_types_are_named_or_stored_as_python_types():
    """numpy scalars are stored back as int / float / bool (the kernels' launchers and buffer
    sizes take Python ints: a numpy ``max_nodes`` had failed at the first step); a str, a
    float for an int, a truthy str for a bool, a non-profile role: ValueError naming the
    field at construction, not a TypeError (or a silent switch) later."""
    from agspec_gpu.controller import ControllerConfig, RoleProfile
    from agspec_gpu.forms import EmissionForm

    d = DrafterConfig(max_nodes=np.int64(8), max_draft_depth=np.int32(6), min_match=np.int64(2),
                      min_prob=np.float32(0.25), tree=np.bool_(True),
                      tier_bonus=[np.int64(2), 2, 1, 0])
    assert (type(d.max_nodes), type(d.max_draft_depth), type(d.min_match), type(d.min_prob),
            type(d.tree), d.tier_bonus) == (int, int, int, float, bool, (2, 2, 1, 0))
    assert type(DecoderConfig(max_batch=np.int64(2)).max_batch) is int
    t = TierConfig(max_depth=np.int64(16), forms=[EmissionForm.RAW],
                   workspace_low_water=np.float64(0.5))
    assert (type(t.max_depth), t.forms, type(t.workspace_low_water)) == \
        (int, (EmissionForm.RAW,), float)
    assert type(SamplingParams(top_k=np.int64(3), seed=np.int64(1)).top_k) is int
    # what the old checks took stays taken: an array of tier bonuses, a set of forms (in
    # the enum's order), no upper bound on the controller's scale
    assert DrafterConfig(tier_bonus=np.array([2, 2, 1, 0])).tier_bonus == (2, 2, 1, 0)
    assert TierConfig(forms={EmissionForm.DIFF_ADD, EmissionForm.RAW}).forms == \
        (EmissionForm.RAW, EmissionForm.DIFF_ADD)
    assert ControllerConfig(s_max=float("inf")).s_max == float("inf")
    for cls, kw in ((TierConfig, dict(workspace_budget_tokens="x")),
                    (TierConfig, dict(workspace_budget_tokens=2.5)),
                    (TierConfig, dict(max_depth=3.5)), (TierConfig, dict(forms=5)),
                    (TierConfig, dict(forms=("raw",))), (TierConfig, dict(use_workspace="no")),
                    (TierConfig, dict(idle_budget_tokens=1.5)),
                    (DrafterConfig, dict(min_prob="x")), (DrafterConfig, dict(tier_bonus=5)),
                    (DrafterConfig, dict(tier_bonus=(1, 2, True, 0))),
                    (DrafterConfig, dict(roles=("default",))),
                    (DrafterConfig, dict(roles=())),
                    (DrafterConfig, dict(roles=(RoleProfile("a"), RoleProfile("a")))),
                    (DrafterConfig, dict(controller=None)), (DrafterConfig, dict(tree="no")),
                    (DrafterConfig, dict(cuda_graphs=1)),
                    (ControllerConfig, dict(alpha="2")), (ControllerConfig, dict(static_k=2.0)),
                    (ControllerConfig, dict(s_max=float("nan"))),
                    (ControllerConfig, dict(s_min=float("inf")))):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}"):
            cls(**kw)
    for kw in (dict(draft_cap="3"), dict(initial_scale=float("nan")), dict(name="")):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}"):
            RoleProfile(**{"name": "r", **kw})
    # the numpy-valued config runs: drafts (a continuation steered in), and stays lossless
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (1, 3)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(drafter=d, max_batch=np.int64(2)))
    steer(dec, "t0", P[0] + greedy(variant, P[0], 16))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    assert_greedy(dec, variant, sids, P)
    assert dec.stats["drafted"] > 0


def test_arguments_of_the_wrong_type_are_named():
    """Wrong types (not only wrong values) of the decoder's, its config's and the sampling
    parameters' arguments raise naming the argument, before anything changes."""
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (1, 3)]
    m = model(variant)
    for kw in (dict(max_batch=2.5), dict(max_batch=True), dict(max_batch="4"),
               dict(max_sessions=4.5), dict(page_size=2.5), dict(kv_cache_tokens=4096.5),
               dict(cuda_graphs="no"), dict(profiles=3), dict(admission="vllm"),
               dict(admission=None),
               # sizes past what the decoder's buffers are built for (10**6 sessions took
               # minutes, 2**31 a 1 TB allocation naming nothing)
               dict(max_batch=10 ** 6), dict(max_sessions=10 ** 8), dict(page_size=1 << 20)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            DecoderConfig(**kw)
    for kw in (dict(max_nodes=2.5), dict(max_positions="8"), dict(max_scan=1.5),
               dict(max_candidate_rows=True), dict(min_match=1.0)):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}: expected an int"):
            DrafterConfig(**kw)
    with pytest.raises(ValueError, match="profiles: no profile file"):
        SpecDecoder(m, tok(), DecoderConfig(profiles="/nonexistent/profiles.json"))
    for kw in (dict(temperature="1"), dict(temperature=None), dict(temperature=True),
               dict(temperature=float("inf")), dict(top_k=True), dict(top_p="0.5")):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="config"):
        SpecDecoder(m, tok(), {"max_batch": 2})
    with pytest.raises(ValueError, match="global_corpus"):
        SpecDecoder(m, tok(), global_corpus=3)
    with pytest.raises(ValueError, match="tokenizer"):
        SpecDecoder(m, None)
    dec = SpecDecoder(m, tok())
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    with pytest.raises(KeyError, match="session id: expected a str"):
        dec.append([sids[0]], [1, 2])
    with pytest.raises(KeyError, match="session id: expected a str"):
        dec.generate([sids[0], [sids[1]]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(sids, max_new_tokens=torch.tensor(1))
    for bad in (torch.tensor(5), torch.tensor(-1), -1.0):  # -1, the default, as an int only
        with pytest.raises(ValueError, match="eos_id: expected None or an int"):
            dec.generate(sids, max_new_tokens=4, eos_id=bad)
        with pytest.raises(ValueError, match="eos_id: expected None or an int"):
            dec.submit(sids[0], max_new_tokens=4, eos_id=bad)
    assert not dec.queued
    with pytest.raises(ValueError, match="sampling: expected a SamplingParams or None, or a"):
        dec.generate(sids, max_new_tokens=4, sampling={"temperature": 0.5})
    for bad in (torch.tensor([1, 2], device="meta"), torch.tensor([1, 2]).to_sparse(),
                np.array(5)):
        with pytest.raises(ValueError, match="token_ids: expected"):
            dec.append(sids[0], bad)
    with pytest.raises(ValueError, match="on_tokens"):  # before the prefill, not after it
        dec.generate(sids, max_new_tokens=4, on_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.submit(sids[0], max_new_tokens=[0])
    assert dec.queued == [] and dec.stats["prefills"] == 0
    draft = dec.propose(sids)
    logits = torch.zeros(2, 1 + draft.max_nodes, VOCAB)
    for gen in (5, "seed"):
        with pytest.raises(ValueError, match="generator"):
            dec.commit(sids, draft, logits, sampling=SamplingParams(0.7), generator=gen)
    with pytest.raises(ValueError, match="generator"):  # greedy too: checked all the same
        dec.commit(sids, draft, logits, generator=5)
    num = draft.num_draft_tokens
    for bad, name in (((draft.token_ids, draft.parents, num.float()), "num_draft_tokens"),
                      ((draft.token_ids.float(), draft.parents, num), "token_ids"),
                      ((draft.token_ids, draft.parents[:, :1], num), "parents"),
                      ((draft.token_ids, draft.parents, num[:, None]), "num_draft_tokens")):
        with pytest.raises(ValueError, match=f"draft.*{name}"):
            dec.commit(sids, DraftBatch(*bad), logits)
    assert dec.stats["steps"] == 0
    assert_greedy(dec, variant, sids, P)


def _two_sessions_and_a_runner(variant):
    """``(prompts, decoder, its two sessions, an HFRunner prefilled with their contexts less
    the last token)``: the user's own loop, its verifier the runner."""
    P = [list(prompts()[i]) for i in (3, 1)]
    dec = SpecDecoder(model(variant), tok())
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    runner = HFRunner(model(variant))
    runner.prefill([p[:-1] for p in P])
    return P, dec, sids, runner


def test_own_loop_ignores_logit_columns_past_the_vocabulary():
    """Logits wider than the model's vocabulary (an engine's padded head): the columns past
    it are no tokens, however large, and never committed."""
    variant = VARIANTS[1]
    P, dec, sids, runner = _two_sessions_and_a_runner(variant)
    outs = [[] for _ in sids]
    for step in range(3):
        draft = dec.propose(sids)
        logits = runner.verify_padded(draft, dec.root_ids(sids))
        wide = torch.cat([logits, torch.full((*logits.shape[:2], 64), 1e4)], -1)
        sampling = None if step < 2 else SamplingParams(0.0, top_k=3)
        res = dec.commit(sids, draft, wide if step % 2 == 0 else wide[..., :VOCAB + 1],
                         sampling=sampling)
        runner.commit(res)
        for b, (row, n) in enumerate(zip(res.output_ids.tolist(), res.num_output.tolist())):
            outs[b] += row[:n]
    for p, o in zip(P, outs):
        assert len(o) >= 3 and o == greedy(variant, p, len(o), eos=None)  # a token a step


def test_closed_and_foreign_sessions_raise_keyerror():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (1, 3, 0)]
    dec = SpecDecoder(model(variant), tok())
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    dec.close_session(sids[2])
    for call in (lambda: dec.generate([sids[0], sids[2]], max_new_tokens=4),
                 lambda: dec.append(sids[2], [1, 2]),
                 lambda: dec.add_workspace_file(sids[2], "a.py", "x = 1\n"),
                 lambda: dec.close_session(sids[2])):
        with pytest.raises(KeyError):
            call()
    fresh = SpecDecoder(model(variant), tok())  # a decoder that has opened nothing yet
    with pytest.raises(KeyError):
        fresh.generate([sids[0]], max_new_tokens=4)
    foreign = fresh.open_session("x", "coder", P[0], session_id="opened-elsewhere")
    with pytest.raises(KeyError):
        dec.generate([sids[0], foreign], max_new_tokens=4)
    assert_greedy(dec, variant, sids[:2], P[:2])


def test_session_id_of_another_decoder_with_open_sessions():
    variant = VARIANTS[1]
    a, b = SpecDecoder(model(variant), tok()), SpecDecoder(model(variant), tok())
    sa = a.open_session("tenant-a", "coder", list(prompts()[1]))
    sb = b.open_session("tenant-b", "coder", list(prompts()[3]))
    with pytest.raises(KeyError):
        b.generate([sa], max_new_tokens=4)
    assert_greedy(b, variant, [sb], [list(prompts()[3])])


def test_padded_model_vocabulary_generates():
    variant = ("llama", "sdpa")
    m = _tiny(*variant, vocab=VOCAB + 75)
    P = list(prompts()[3])
    with torch.no_grad():  # make padding id VOCAB + 23 win wherever the most common token did
        g = greedy_generate(m, P, 20)
        m.lm_head.weight[VOCAB + 23] = 1.5 * m.lm_head.weight[max(set(g), key=g.count)]
    ref = greedy_generate(m, P, 20, eos_id=tok().eos_id)
    assert VOCAB + 23 in ref
    dec = SpecDecoder(m, tok())
    sid = dec.open_session("t0", "coder", P)
    assert dec.generate([sid], max_new_tokens=20) == [ref]



def test_a_composite_config_models_vocabulary_is_its_heads():
    """Fuyu keeps ``vocab_size`` in its text config only: the decoder took the tokenizer's
    size as the model's, so an own loop's commit cut the padded ids the head scores (not
    greedy decoding; ``generate`` kept them), ``append`` refused ``generate``'s own output,
    and a tokenizer larger than the model was taken (its prompts past the embedding)."""
    from transformers import FuyuConfig, FuyuForCausalLM

    def fuyu(vocab):
        torch.manual_seed(0)
        return FuyuForCausalLM(FuyuConfig(text_config=dict(
            model_type="persimmon", vocab_size=vocab, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, initializer_range=0.1),
            hidden_size=64, patch_size=4)).eval()

    with pytest.raises(ValueError, match="model embeds 50000: mismatched vocabularies"):
        SpecDecoder(fuyu(50_000), tok())
    m = fuyu(VOCAB + 75)
    P = list(prompts()[3])
    with torch.no_grad():  # padding id VOCAB + 23 wins where the most common token did
        g = greedy_generate(m, P, 12)
        m.lm_head.weight[VOCAB + 23] = 1.5 * m.lm_head.weight[max(set(g), key=g.count)]
    ref = greedy_generate(m, P, 12, eos_id=None)
    assert VOCAB + 23 in ref
    dec = SpecDecoder(m, tok())
    assert dec.vocab_size == VOCAB + 75
    sid = dec.open_session("t0", "coder", P)
    out = dec.generate([sid], max_new_tokens=12, eos_id=None)[0]
    assert out == ref
    dec.append(sid, out[:3])  # the model's own ids are in its vocabulary
    own = dec.open_session("t1", "coder", P)
    runner = HFRunner(m)
    runner.prefill([P[:-1]])
    outs = []
    while len(outs) < 8:
        draft = dec.propose([own])
        res = dec.commit([own], draft, runner.verify_padded(draft, dec.root_ids([own])),
                         eos_id=None)
        runner.commit(res)
        outs += res.output_ids[0, :int(res.num_output[0])].tolist()
    assert outs == ref[:len(outs)]


def test_a_tokenizer_with_input_only_ids_the_embedding_holds_is_taken():
    """Mllama's embedding holds 8 ids past what its head scores (Llama-3.2-Vision's
    ``<|image|>`` is one of them): a tokenizer that long is taken (the head-sized check
    had refused it), the decoder's vocabulary stays the head's, and a prompt holding an
    input-only id is refused by name (a draft of it could not be verified)."""
    import logging

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import MllamaConfig, MllamaForConditionalGeneration, \
        PreTrainedTokenizerFast
    V = 256
    cfg = MllamaConfig(
        text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         cross_attention_layers=[1], pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_global_layers=1, attention_heads=2, image_size=32,
                           patch_size=16, vision_output_dim=64, max_num_tiles=4,
                           intermediate_layers_indices=[0]))
    torch.manual_seed(0)
    m = MllamaForConditionalGeneration(cfg).eval()
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V + 1)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t2")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dec = SpecDecoder(m, t)
    assert dec.vocab_size == V and dec.tokenizer.vocab_size == V + 1
    P = [5, 6, 7, 8, 5, 6, 7]
    sid = dec.open_session("t0", "coder", P)
    assert dec.generate([sid], max_new_tokens=6, eos_id=None) == [
        greedy_generate(m, P, 6, eos_id=None)]
    with pytest.raises(ValueError, match="prompt_ids"):
        dec.open_session("t0", "coder", [5, V])

# ---------------------------------------------------------------- your own loop
def own_loop(dec, runner, sids, steps, between=None, flat=False,
             **commit_kw) -> list[list[int]]:
    """``steps`` propose / verify / commit rounds with ``runner`` as the user's verifier;
    ``between(draft)``, if given, runs between each propose and its commit; ``flat``: commit
    the verifier's flat rows with their ``qo_indptr`` (a ``PagedBatch``'s ``verify_rows``)."""
    outs = [[] for _ in sids]
    for _ in range(steps):
        draft = dec.propose(sids)
        if between is not None:
            between(draft)
        if flat:
            logits, qo = runner.verify_rows(draft, dec.root_ids(sids).to(torch.int32))
            res = dec.commit(sids, draft, logits, qo_indptr=qo, **commit_kw)
        else:
            logits = runner.verify_padded(draft, dec.root_ids(sids))
            res = dec.commit(sids, draft, logits, **commit_kw)
        runner.commit(res)
        for b, (row, n) in enumerate(zip(res.output_ids.tolist(), res.num_output.tolist())):
            outs[b] += row[:n]
    return outs


def test_commit_ends_a_session_at_its_end_token_or_its_limit():
    """``commit(eos_id=, max_new_tokens=)``: a step whose accepted draft runs past the end
    token, or past what the request may still emit, gives each session the tokens up to its
    end only (they alone join its context; the result is cut to them, its last token the
    root), and ``finish_reason`` says why; without them every accepted token joins, as
    before. Bad values raise naming the argument, and the proposal stands."""
    dec = SpecDecoder(model(VARIANTS[0]), tok())
    eos = dec.tokenizer.eos_id
    P = list(prompts()[3])
    cont = [5, 6, eos, 7, 8, 9, 10, 11]
    steer(dec, "t0", P + cont)
    sids = [dec.open_session("t0", "coder", P) for _ in range(3)]

    def target(draft):  # logits of a target that continues as the history did
        logits = torch.zeros(*draft.token_ids.shape[:1], 1 + draft.max_nodes, VOCAB)
        for b in range(draft.batch_size):
            depth = {}
            logits[b, 0, cont[0]] = 10
            for j, p in enumerate(draft.parents[b, :int(draft.num_draft_tokens[b])].tolist()):
                depth[j] = 1 if p == -1 else depth[p] + 1
                logits[b, 1 + j, cont[depth[j]] if depth[j] < len(cont) else 99] = 10
        return logits

    draft = dec.propose(sids)
    logits = target(draft)
    for bad, match in ((dict(max_new_tokens=0), "max_new_tokens: expected ints >= 1"),
                       (dict(max_new_tokens=-1), "max_new_tokens: expected ints >= 1"),
                       (dict(max_new_tokens=True), "max_new_tokens: expected ints >= 1"),
                       (dict(max_new_tokens=[1, 2]), "max_new_tokens"),
                       (dict(eos_id=VOCAB), "eos_id")):
        with pytest.raises(ValueError, match=match):
            dec.commit(sids, draft, logits, **bad)
    res = dec.commit(sids, draft, logits, eos_id=-1, max_new_tokens=[10, 2, 1 << 20])
    assert res.num_output.tolist() == [3, 2, 3] and res.num_accepted.tolist() == [2, 1, 2]
    assert res.output_ids.tolist()[0][:4] == [5, 6, eos, PAD_ID]
    assert res.output_ids.tolist()[1][:3] == [5, 6, PAD_ID]
    assert (res.accepted_nodes[1, 1:] == PAD_ID).all() and res.bonus_ids().tolist() == \
        [eos, 6, eos]
    assert [dec._sessions[s].context[len(P):] for s in sids] == [[5, 6, eos], [5, 6],
                                                                  [5, 6, eos]]
    assert [dec.session_stats(s).finish_reason for s in sids] == ["eos", "length", "eos"]
    # the next request's steps run: a step that ends nothing clears the last reason, with
    # end rules or without
    for sid, rules in ((sids[1], dict(eos_id=-1)), (sids[0], {})):
        d = dec.propose([sid])
        dec.commit([sid], d, torch.zeros(1, 1 + d.max_nodes, VOCAB), **rules)  # token 0
        assert dec.session_stats(sid).finish_reason is None
    # without end rules every accepted token joins (the draft ran past the end token)
    again = dec.open_session("t0", "coder", P)
    d2 = dec.propose([again])
    res2 = dec.commit([again], d2, target(d2))
    assert res2.num_output.tolist()[0] > 3
    assert dec._sessions[again].context[len(P):len(P) + 4] == [5, 6, eos, 7]
    assert dec.session_stats(again).finish_reason is None


def test_commit_ends_a_session_at_a_stop_string_across_steps():
    """``commit(stop=)``: the output ends with the token that completes a stop string in
    the text the session generated since its last append, inside an accepted draft or
    across two commits (the message so far seeds the matcher); the tokens after it do not
    join, ``finish_reason`` says ``"stop"``, and an append starts a new message."""
    dec = SpecDecoder(model(VARIANTS[0]), tok())
    P = list(prompts()[3])
    cont = [5, 6, 7, 8, 9, 10, 11, 12]  # "&'()*+,-"
    steer(dec, "t0", P + cont)

    def target(draft, at):  # a target that continues as the history did from cont[at]
        logits = torch.zeros(draft.batch_size, 1 + draft.max_nodes, VOCAB)
        for b in range(draft.batch_size):
            depth = {}
            logits[b, 0, cont[at]] = 10
            for j, p in enumerate(draft.parents[b, :int(draft.num_draft_tokens[b])].tolist()):
                depth[j] = 1 if p == -1 else depth[p] + 1
                d = at + depth[j]
                logits[b, 1 + j, cont[d] if d < len(cont) else 99] = 10
        return logits

    a, b = (dec.open_session("t0", "coder", P) for _ in range(2))
    d = dec.propose([a, b])
    with pytest.raises(ValueError, match="stop"):
        dec.commit([a, b], d, target(d, 0), stop=[""])
    res = dec.commit([a, b], d, target(d, 0), stop=[["()"], ["+"]])  # inside the draft
    assert res.num_output.tolist() == [4, 6]
    assert [dec._sessions[s].context[len(P):] for s in (a, b)] == [cont[:4], cont[:6]]
    assert [dec.session_stats(s).finish_reason for s in (a, b)] == ["stop", "stop"]
    # across steps: "()" spans the last token of one commit and the first of the next
    c = dec.open_session("t0", "coder", P)
    d = dec.propose([c])
    dec.commit([c], d, target(d, 0), max_new_tokens=3)
    assert dec._sessions[c].context[len(P):] == cont[:3]
    d = dec.propose([c])
    res = dec.commit([c], d, target(d, 3), stop="()")
    assert res.num_output.tolist() == [1] and dec._sessions[c].context[len(P):] == cont[:4]
    assert dec.session_stats(c).finish_reason == "stop"
    # an append starts a new message: the old ")" no longer counts
    dec.append(c, [5])
    d = dec.propose([c])
    res = dec.commit([c], d, torch.zeros(1, 1 + d.max_nodes, VOCAB), stop=")")
    assert res.num_output.tolist() == [1] and dec.session_stats(c).finish_reason is None


def test_a_commit_whose_drafter_raises_changes_no_counter_or_reason(monkeypatch):
    """The drafter's commit runs before the counters and the contexts change, and the
    sessions' finish reasons come back when it raises."""
    dec = SpecDecoder(model(VARIANTS[0]), tok())
    sid = dec.open_session("t0", "coder", list(prompts()[3]))
    dec.generate([sid], max_new_tokens=2)
    before = (dec.session_stats(sid), dict(dec.stats), list(dec._sessions[sid].context))
    assert before[0].finish_reason == "length"

    def broken(*args, **kwargs):
        raise RuntimeError("drafter fault")

    d = dec.propose([sid])
    monkeypatch.setattr(dec.drafter, "observe", broken)
    with pytest.raises(RuntimeError, match="drafter fault"):
        dec.commit([sid], d, torch.zeros(1, 1 + d.max_nodes, VOCAB), stop="x", eos_id=-1)
    assert (dec.session_stats(sid), dict(dec.stats), dec._sessions[sid].context) == before


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=[IDS[0], IDS[3]])
def test_own_loop_propose_commit_is_lossless(variant):
    """propose / root_ids / commit around the user's own verifier (an HFRunner whose KV
    holds each context but its last token, the root): plain greedy decoding's tokens, with
    drafts accepted (one steered to be accepted whole), and ``generate`` continues from the
    contexts ``commit`` extended."""
    P = [list(prompts()[i]) for i in (3, 1, 2)]
    g0 = greedy(variant, P[0], 45, eos=None)
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + g0)
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    runner = HFRunner(model(variant))
    runner.prefill([p[:-1] for p in P])
    outs = own_loop(dec, runner, sids, 10)
    for p, o in zip(P, outs):
        assert len(o) >= 10 and o == greedy(variant, p, len(o), eos=None)
    assert len(outs[0]) > 45 and outs[0][:45] == g0  # the steered draft ran whole
    s = dec.stats
    assert s["steps"] == 10 and s["accepted"] >= 20 and s["tokens"] == sum(map(len, outs))
    for sid, p, o in zip(sids, P, outs):  # each session's share; no request: no reason
        st = dec.session_stats(sid)
        assert (st.num_steps, st.num_generated, st.num_step_tokens, st.context_len) == \
            (10, len(o), len(o), len(p) + len(o)) and st.finish_reason is None, st
    assert sum(dec.session_stats(x).num_accepted for x in sids) == s["accepted"]
    more = dec.generate(sids[:2], max_new_tokens=6)
    for p, o, m in zip(P, outs, more):
        assert m == greedy(variant, p + o, 6)


def paged_verifier(variant, contexts) -> PagedBatch:
    """The user's verifier on the paged runner: each context but its last token cached."""
    from agspec_gpu.runners.paged import PagedLlamaRunner

    batch = PagedBatch(PagedLlamaRunner.from_hf_model(model(variant), num_pages=256,
                                                      page_size=8))
    batch.prefill([c[:-1] for c in contexts])
    return batch


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=[IDS[0], IDS[3]])
def test_own_loop_commits_flat_rows(variant):
    """A verifier with FlashInfer's flat layout (the paged runner's ``verify_rows``: ragged
    rows and ``qo_indptr``) commits its rows as they are: plain greedy decoding's tokens,
    the steered draft accepted whole; sampled, the same tokens as committing the same rows
    padded (same generator)."""
    P = [list(prompts()[i]) for i in (3, 1, 2)]
    g0 = greedy(variant, P[0], 45, eos=None)
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + g0)
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    outs = own_loop(dec, paged_verifier(variant, P), sids, 10, flat=True)
    for p, o in zip(P, outs):
        assert len(o) >= 10 and o == greedy(variant, p, len(o), eos=None)
    assert len(outs[0]) > 45 and outs[0][:45] == g0
    assert dec.stats["steps"] == 10 and dec.stats["accepted"] >= 20
    sampled = []
    for flat in (True, False):
        d = SpecDecoder(model(variant), tok())
        steer(d, "t0", P[0] + g0)
        s = [d.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
        sampled.append(own_loop(d, paged_verifier(variant, P), s, 6, flat=flat,
                                sampling=SamplingParams(temperature=0.8, top_k=20),
                                generator=torch.Generator().manual_seed(5)))
    assert sampled[0] == sampled[1] and all(len(o) >= 6 for o in sampled[0])


def test_flat_commit_bad_qo_indptr_raises_and_commits_nothing():
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1)]
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + greedy(variant, P[0], 30, eos=None))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    batch = paged_verifier(variant, P)
    draft = dec.propose(sids)
    logits, qo = batch.verify_rows(draft, dec.root_ids(sids).to(torch.int32))
    n = draft.num_draft_tokens.tolist()
    assert n[0] > 0  # the steered session drafts
    swapped = torch.tensor([0, 1 + n[1], 2 + n[0] + n[1]], dtype=torch.int32)
    for bad in (qo.float(), qo[:-1], qo[None], [0, 1 + n[0], 2 + sum(n)], swapped, qo + 1,
                qo - 1):
        with pytest.raises(ValueError, match="qo_indptr"):
            dec.commit(sids, draft, logits, qo_indptr=bad)
    with pytest.raises(ValueError, match="qo_indptr"):  # rows past the logits
        dec.commit(sids, draft, logits[:-1], qo_indptr=qo)
    for bad in (logits[None], logits[:, :VOCAB - 1]):
        with pytest.raises(ValueError, match="logits"):
            dec.commit(sids, draft, bad, qo_indptr=qo)
    nan = logits.clone()
    nan[int(qo[1]) + n[1], 3] = float("nan")  # the second session's last node's row
    with pytest.raises(ValueError, match=rf"logits: .*\['{sids[1]}'\] hold a NaN"):
        dec.commit(sids, draft, nan, qo_indptr=qo)
    assert dec.stats["steps"] == 0  # nothing was committed
    res = dec.commit(sids, draft, logits, qo_indptr=qo.long())  # int64 is fine
    batch.commit(res)
    got = [r[:k] for r, k in zip(res.output_ids.tolist(), res.num_output.tolist())]
    assert got[0] == greedy(variant, P[0], len(got[0]), eos=None) and len(got[0]) > 1
    assert got[1] == greedy(variant, P[1], len(got[1]), eos=None) and len(got[1]) >= 1


def test_own_loop_with_the_models_own_forward_and_cache():
    """What a user of one request writes: the model's forward on ``tree_inputs`` (their own
    DynamicCache, a 0 / -inf mask: the cached context, then the in-tree mask), commit, and
    the cache pruned to the root plus ``accepted_nodes``: plain greedy decoding's tokens."""
    from transformers import DynamicCache

    from agspec_gpu.runners.hf import _cache_kwarg

    variant = VARIANTS[0]
    P = list(prompts()[3])
    g0 = greedy(variant, P, 45, eos=None)
    m, dec = model(variant), SpecDecoder(model(variant), tok())
    kw = _cache_kwarg(m)  # `cache` (newer transformers) or `past_key_values`
    steer(dec, "t0", P + g0)
    sid = dec.open_session("t0", "coder", P)
    cache, out = DynamicCache(), []
    with torch.no_grad():
        m(input_ids=torch.tensor([P[:-1]]), use_cache=True, **{kw: cache})  # all but the root
        for _ in range(8):
            draft = dec.propose([sid])
            inp = dec.tree_inputs([sid], draft)
            past = cache.get_seq_length()
            assert int(inp.position_ids[0, 0]) == past
            allowed = torch.cat([torch.ones(1, 1 + draft.max_nodes, past, dtype=torch.bool),
                                 inp.tree_mask], 2)
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None]
            logits = m(input_ids=inp.input_ids, position_ids=inp.position_ids,
                       attention_mask=mask, use_cache=True, **{kw: cache}).logits
            res = dec.commit([sid], draft, logits)
            n_acc = int(res.num_accepted[0])
            keep = torch.cat([torch.arange(past + 1),  # the context and the root
                              past + 1 + res.accepted_nodes[0, :n_acc].long()])
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            out += res.output_ids[0, :int(res.num_output[0])].tolist()
    assert len(out) > 45 and out[:45] == g0  # the steered draft ran
    assert out == greedy(variant, P, len(out), eos=None)


def test_own_loop_bad_calls_raise_and_leave_sessions_intact():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (3, 1)]
    dec = SpecDecoder(model(variant), tok())
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    other = dec.open_session("t9", "coder", list(prompts()[2]))
    runner = HFRunner(model(variant))
    runner.prefill([p[:-1] for p in P])
    draft0 = DraftBatch.from_lists([[], []])
    with pytest.raises(ValueError, match="session_ids"):  # no propose yet
        dec.commit(sids, draft0, torch.zeros(2, 2, VOCAB))
    draft = dec.propose(sids)
    N = draft.max_nodes
    logits = runner.verify_padded(draft, dec.root_ids(sids))
    for bad_sids in (sids[::-1], sids[:1], [sids[0], other]):
        with pytest.raises(ValueError, match="session_ids"):
            dec.commit(bad_sids, draft, logits)
    with pytest.raises(ValueError, match="distinct"):
        dec.commit([sids[0], sids[0]], draft, logits)
    for bad in (logits[:, :N], logits[:1], logits[..., :VOCAB - 1], logits.argmax(-1),
                logits.long()):
        with pytest.raises(ValueError, match="logits"):
            dec.commit(sids, draft, bad)
    with pytest.raises(ValueError, match="draft"):
        dec.commit(sids, DraftBatch(draft.token_ids[:1], draft.parents[:1],
                                    draft.num_draft_tokens[:1]), logits)
    bad_tok = draft.token_ids.clone()
    bad_tok[0, 0], num = VOCAB + 5, draft.num_draft_tokens.clamp(min=1)
    with pytest.raises(ValueError, match="draft.token_ids"):
        dec.commit(sids, DraftBatch(bad_tok, draft.parents, num), logits)
    for p in (0, N, -2):  # node 0's parent: itself, a later node, below the root (its
        bad_par = draft.parents.clone()  # token a valid one, if the draft had no node 0)
        bad_par[1, 0] = p
        with pytest.raises(ValueError, match="draft.parents"):
            dec.commit(sids, DraftBatch(draft.token_ids.clamp(min=0), bad_par, num), logits)
    for n in (-1, N + 1):
        with pytest.raises(ValueError, match="draft.num_draft_tokens"):
            dec.commit(sids, DraftBatch(draft.token_ids, draft.parents,
                                        torch.tensor([1, n], dtype=torch.int32)), logits)
    # a built draft past the drafter's max_nodes or max_draft_depth: its commit buffers
    # hold no more (a 64-node chain committed 65 tokens, and a GPU's drafter ring kept 33)
    K = dec.drafter.config.max_draft_depth
    pad = torch.full((2, N), -1, dtype=torch.int32)
    wide = DraftBatch(torch.cat([draft.token_ids, pad], 1), torch.cat([draft.parents, pad], 1),
                      draft.num_draft_tokens)
    assert N == dec.drafter.config.max_nodes > K
    chain = lambda n: DraftBatch(  # noqa: E731 - session 0's n-node chain
        torch.where(torch.arange(N) < n, 5, -1).int().expand(2, N).contiguous(),
        torch.where(torch.arange(N) < n, torch.arange(-1, N - 1), -1).int().expand(2, N)
        .contiguous(), torch.tensor([n, 0], dtype=torch.int32))
    for call in (dec.commit, lambda s, d, *_: dec.tree_inputs(s, d)):
        with pytest.raises(ValueError, match=f"draft: {2 * N} node columns, past the "
                                             f"drafter's max_nodes={N}"):
            call(sids, wide, torch.zeros(2, 1 + 2 * N, VOCAB))
        with pytest.raises(ValueError, match=f"draft: a node is deeper than the drafter's "
                                             f"max_draft_depth={K}"):
            call(sids, chain(K + 1), logits)
    assert dec.tree_inputs(sids, chain(K)).position_ids[0, K] == len(P[0]) - 1 + K
    with pytest.raises(KeyError):
        dec.root_ids([sids[0], "nope"])
    with pytest.raises(ValueError, match="session_ids: expected a list"):  # not its letters
        dec.root_ids(sids[0])
    for bad_draft in (None, draft.token_ids):  # not a DraftBatch: named, no AttributeError
        with pytest.raises(ValueError, match="draft: expected the DraftBatch"):
            dec.commit(sids, bad_draft, logits)
        with pytest.raises(ValueError, match="draft: expected the DraftBatch"):
            dec.tree_inputs(sids, bad_draft)
    with pytest.raises(ValueError, match="draft: batch 2 != 1"):
        dec.tree_inputs(sids[:1], draft)
    # a draft other than propose()'s is checked before the caller's forward embeds it
    with pytest.raises(ValueError, match="draft.token_ids"):
        dec.tree_inputs(sids, DraftBatch(bad_tok, draft.parents, num))
    with pytest.raises(ValueError, match="draft.parents"):
        dec.tree_inputs(sids, DraftBatch(draft.token_ids.clamp(min=0), bad_par, num))
    with pytest.raises(ValueError, match="draft.num_draft_tokens"):
        dec.tree_inputs(sids, DraftBatch(draft.token_ids, draft.parents,
                                         torch.tensor([1, N + 5], dtype=torch.int32)))
    capped = draft.capped(1)  # a user's copy of a valid draft passes
    assert dec.tree_inputs(sids, capped).input_ids.shape == (2, 1 + N)
    with pytest.raises(ValueError, match="logits: expected a torch.Tensor, got ndarray"):
        dec.commit(sids, draft, logits.numpy())
    with pytest.raises(ValueError, match="session_ids: propose"):
        dec.propose([])
    with pytest.raises(ValueError, match="sampling"):  # one SamplingParams per session
        dec.commit(sids, draft, logits, sampling=[SamplingParams()])
    # a model fault in a row that chooses a token: NaN, +inf, all -inf (greedy or sampled)
    n1 = int(draft.num_draft_tokens[1])
    for b, row, value in ((0, 0, "nan"), (1, n1, "inf"), (1, 0, "-inf row")):
        bad = logits.clone()
        if value == "-inf row":
            bad[b, row] = float("-inf")
        else:
            bad[b, row, 7] = float(value)
        for sampling in (None, SamplingParams(temperature=1.0, seed=3)):
            with pytest.raises(ValueError, match=rf"logits: .*\['{sids[b]}'\] hold a NaN"):
                dec.commit(sids, draft, bad, sampling=sampling)
    assert dec.stats["steps"] == 0  # nothing was committed
    if n1 < N:  # a padding row's NaN is no token's row: ignored
        logits[1, 1 + n1:] = float("nan")
    res = dec.commit(sids, draft, logits)  # the real step still commits
    runner.commit(res)
    with pytest.raises(ValueError, match="session_ids"):  # one commit per propose
        dec.commit(sids, draft, logits)
    outs = own_loop(dec, runner, sids, 3)
    first = [r[:n] for r, n in zip(res.output_ids.tolist(), res.num_output.tolist())]
    for p, f, o in zip(P, first, outs):
        assert len(f) >= 1 and len(o) >= 3 and f + o == greedy(variant, p, len(f + o),
                                                                 eos=None)
    dec.propose([sids[1]])
    dec.close_session(sids[1])  # closing a proposed session drops the proposal
    with pytest.raises(KeyError):
        dec.commit([sids[1]], draft, logits)



@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_a_model_fault_in_sampled_generate_raises_and_emits_nothing(runner):
    """Logits with no distribution to sample (a NaN or +inf in a row that chooses a token,
    or only -inf: a half-precision overflow) raise RuntimeError naming the sessions, in the
    prefill or in a step, with nothing emitted by that step. Before, a sampled request
    emitted the last vocabulary id at every step (``commit`` refused such logits already;
    Hugging Face's sampling raises). The sessions keep what earlier steps emitted, and go
    on losslessly once the model is sound again. Greedy steps are not checked: their
    output is plain greedy decoding's, the NaN's column included."""
    variant = VARIANTS[1]
    m = _tiny(*variant)  # (its own copy: its head is broken below)
    P = [list(prompts()[i]) for i in (3, 1)]
    dec = SpecDecoder(m, tok(), DecoderConfig(runner=runner, page_size=8,
                                              kv_cache_tokens=4096))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    head = m.lm_head.weight.detach()
    sound = head[7].clone()
    streamed = {s: [] for s in sids}

    def on_tokens(sid, new):  # after the prefill and one step, the head breaks
        streamed[sid] += new
        if len(streamed[sids[0]]) > 1:
            head[7] = float("nan")

    with pytest.raises(RuntimeError, match=r"the model's logits for session\(s\) \['.*-s0', "
                                           r"'.*-s1'\] hold a NaN or \+inf, or only -inf"):
        dec.generate(sids, max_new_tokens=30, sampling=SamplingParams(temperature=0.8),
                     eos_id=None, generator=torch.Generator().manual_seed(0),
                     on_tokens=on_tokens)
    for sid, p in zip(sids, P):  # the failed step took nothing
        assert dec._sessions[sid].context == p + streamed[sid] and len(streamed[sid]) > 1
    other = dec.open_session("t9", "coder", list(prompts()[2]))  # a prefill's fault too
    with pytest.raises(RuntimeError, match=r"\['.*-s2'\] hold a NaN"):
        dec.generate([other], max_new_tokens=4, sampling=SamplingParams(temperature=0.8))
    assert dec._sessions[other].context == list(prompts()[2])
    contexts = [list(dec._sessions[sid].context) for sid in sids]
    out = dec.generate(sids, max_new_tokens=8, eos_id=None)  # greedy: the NaN's column
    for o, c in zip(out, contexts):
        assert o == greedy_generate(m, c, 8, eos_id=None) == [7] * 8
    head[7] = sound
    contexts = [list(dec._sessions[sid].context) for sid in sids]
    out = dec.generate(sids, max_new_tokens=12, eos_id=None)
    for o, c in zip(out, contexts):
        assert o == greedy_generate(m, c, 12, eos_id=None)
    # a greedy request whose own rows are NaN beside a sound sampled one: not checked, it
    # decodes as plain greedy decoding does (it raised when the batch sampled)
    bad_tok = next(t for t in P[0] if t not in P[1])
    m.get_input_embeddings().weight.data[bad_tok] = float("nan")
    greedy_one, sampled = [dec.open_session(f"u{i}", "coder", p) for i, p in enumerate(P)]
    out = dec.generate([greedy_one, sampled], max_new_tokens=6, eos_id=None,
                       sampling=[None, SamplingParams(temperature=0.8)])
    assert out[0] == greedy_generate(m, P[0], 6, eos_id=None) and len(out[1]) == 6


def test_the_depth_check_of_a_built_draft_equals_its_deepest_node():
    """``checked_sizes(max_depth=K)`` (binary lifting: log2(K) hops of the tree, not the N
    gathers of ``depths()``, 866 ops a call at N = 64) refuses a draft iff a node is
    deeper than K: chains, random trees, padding columns, every K."""
    import random
    rng = random.Random(0)
    for case in range(150):
        B, N = rng.randint(1, 3), rng.randint(1, 24)
        trees = [[(rng.randint(0, 50), j - 1 if chain else rng.randint(-1, j - 1))
                  for j in range(rng.randint(0, N))]
                 for chain in (rng.random() < 0.4 for _ in range(B))]
        d = DraftBatch.from_lists(trees)
        pad = torch.full((B, N - d.max_nodes), PAD_ID, dtype=torch.int32)
        d = DraftBatch(torch.cat([d.token_ids, pad], 1), torch.cat([d.parents, pad], 1),
                       d.num_draft_tokens)
        deepest = int(d.depths().max())
        for K in range(N):
            if deepest <= K:
                assert d.checked_sizes(VOCAB, max_depth=K) == [len(t) for t in trees]
            else:
                with pytest.raises(ValueError, match=f"max_draft_depth={K}"):
                    d.checked_sizes(VOCAB, max_depth=K)

def test_own_loop_sampling_commits_sampled_tokens():
    variant = VARIANTS[1]
    P, dec, sids, runner = _two_sessions_and_a_runner(variant)
    g = torch.Generator().manual_seed(0)
    outs = own_loop(dec, runner, sids, 6, sampling=SamplingParams(temperature=1.0, top_k=50),
                    generator=g)
    for sid, p, o in zip(sids, P, outs):
        assert len(o) >= 6 and all(0 <= t < VOCAB for t in o)
        held = dec.store.arena.corpus_tokens(dec.store.session(sid).corpus).tolist()
        assert held == p + o  # the session tier holds exactly the sampled context
    # seeded: the own loop's commits draw what generate's plain sampling draws
    seeded = [SamplingParams(temperature=1.0, top_k=50, seed=s) for s in (5, 6)]
    P, dec, sids, runner = _two_sessions_and_a_runner(variant)
    outs = own_loop(dec, runner, sids, 6, sampling=seeded)
    _, plain, sids, _ = _two_sessions_and_a_runner(variant)
    ref = plain.generate(sids, max_new_tokens=max(map(len, outs)), sampling=seeded,
                         speculate=False, eos_id=None)
    assert [r[:len(o)] for r, o in zip(ref, outs)] == outs and min(map(len, outs)) >= 6


# ---------------------------------------------------------------- streaming
def test_on_tokens_streams_exactly_the_output():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (3, 2, 4)]
    g = greedy(variant, P[0], 30, eos=None)
    eos = g[_first_new(g, 20)]  # request 0 ends at EOS inside an accepted draft
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + g)
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    calls = []
    out = dec.generate(sids, max_new_tokens=30, eos_id=eos,
                       on_tokens=lambda sid, toks: calls.append((sid, list(toks))))
    assert out == [greedy(variant, p, 30, eos=eos) for p in P]
    for sid, o in zip(sids, out):
        mine = [t for s, t in calls if s == sid]
        assert all(mine) and sum(mine, []) == o
    assert {s for s, _ in calls} == set(sids)


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_sessions_of_a_running_generate_are_busy_for_its_callback(runner):
    """A streaming callback may not move a session of its own call (append, generate,
    propose, submit, close_session, cancel raise naming it: the running batch holds its KV and
    context); it may generate for another session, and once the call returns its sessions
    are idle again. Every output is plain greedy decoding of its context."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1, 2)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=4096))
    steer(dec, "t0", P[0] + greedy(variant, P[0], 30))
    a, b, c = (dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P))
    refused, nested = [], []

    def on_tokens(sid, toks):
        if len(refused) < 6:
            for call in (lambda: dec.append(a, [1, 2]), lambda: dec.generate([b]),
                         lambda: dec.propose([a, c]), lambda: dec.submit(b),
                         lambda: dec.close_session(a), lambda: dec.cancel(b)):
                with pytest.raises(ValueError, match="running generate"):
                    call()
                refused.append(sid)
        if sid == b and not nested:
            nested.append(dec.generate([c], max_new_tokens=6)[0])

    out = dec.generate([a, b], max_new_tokens=30, on_tokens=on_tokens)
    assert len(refused) == 6 and nested
    assert out == [greedy(variant, P[0], 30), greedy(variant, P[1], 30)]
    assert nested[0] == greedy(variant, P[2], 6)
    for sid, p, o in zip((a, b, c), P, out + nested):
        assert dec._sessions[sid].context == p + o
    dec.append(a, [1, 2])  # idle again
    assert dec.generate([a, c], max_new_tokens=5) == [
        greedy(variant, P[0] + out[0] + [1, 2], 5), greedy(variant, P[2] + nested[0], 5)]
    dec.close_session(b)


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_on_tokens_returning_false_ends_only_that_request(runner):
    """A streaming callback that returns False (the client went away) ends its request
    after the tokens it was given; the other requests run to their end, and the ended
    session's context holds exactly its output: its next call is plain greedy decoding."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1)]
    g = greedy(variant, P[0], 45)
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=2048))
    steer(dec, "t0", P[0] + g)  # long accepted drafts: the cut falls after a whole step
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    streamed = {sid: [] for sid in sids}

    def on_tokens(sid, toks):
        streamed[sid] += toks
        return not (sid == sids[0] and len(streamed[sid]) > 1)  # after its first step

    out = dec.generate(sids, max_new_tokens=45, on_tokens=on_tokens)
    assert out[0] == streamed[sids[0]] == g[:len(out[0])] and 2 < len(out[0]) < 45, out[0]
    assert out[1] == streamed[sids[1]] == greedy(variant, P[1], 45)
    ctx = [p + o for p, o in zip(P, out)]
    assert [dec._sessions[s].context for s in sids] == ctx
    assert_greedy(dec, variant, sids, ctx, n=8)


def test_on_tokens_returns_none_true_or_false():
    """``on_tokens`` returning numpy's False ends its request as False does; a return that is
    no bool (a ``write``'s count of 0, say) raises TypeError naming ``on_tokens`` once
    every session had the step's call, rather than ending a stream or going on silently."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig())
    a, b = (dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P))
    out = dec.generate([a, b], max_new_tokens=12, eos_id=None,
                       on_tokens=lambda sid, toks: np.bool_(sid != a))
    assert 0 < len(out[0]) < 12 and len(out[1]) == 12
    assert dec.session_stats(a).finish_reason == "cancelled"
    calls = []

    def on_tokens(sid, toks):
        calls.append(sid)
        return 0 if sid == a else None

    with pytest.raises(TypeError, match=r"on_tokens: returned int 0 for session .*False to end"):
        dec.generate([a, b], max_new_tokens=12, eos_id=None, on_tokens=on_tokens)
    assert calls == [a, b]
    assert [dec.session_stats(s).finish_reason for s in (a, b)] == ["error"] * 2
    assert_greedy(dec, variant, [a, b], [list(dec._sessions[s].context) for s in (a, b)], n=4)


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_session_stats_are_each_sessions_share_and_say_why_it_ended(runner):
    """``session_stats``: per session, the steps it was in, the tokens they emitted, drafted
    and accepted tokens (summing to the decoder's ``stats``), and why its last request
    ended: its limit (0 included), a stop string, its callback; None while it runs. A
    steered session shows its speedup, an opted-out one plain decoding's 1 token a step."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 6, 1, 7, 2)]
    g = greedy(variant, P[0], 45, eos=None)
    refs = [greedy(variant, p, 20, eos=None) for p in P[1:]]
    stop_text = tok().decode(refs[3][:6])
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=4096))
    steer(dec, "t0", P[0] + g)
    sids = [dec.open_session(f"t{i}", "planner" if i else "coder", p)
            for i, p in enumerate(P)]
    assert dec.session_stats(sids[0]) == SessionStats("t0", "coder", len(P[0]), 0, 0, 0, 0, 0,
                                                      None)
    assert dec.session_stats(sids[1]).role == "planner"
    seen = {sid: [] for sid in sids}  # the reason each callback saw

    def on_tokens(sid, toks):
        seen[sid].append(dec.session_stats(sid).finish_reason)
        return sid != sids[2] or dec.session_stats(sid).num_generated < 3

    out = dec.generate(sids, max_new_tokens=[45, 20, 20, 0, 20], eos_id=None,
                       speculate=[True, False, True, True, True],
                       stop=[[], [], [], [], [stop_text]], on_tokens=on_tokens)
    assert out[0] == g and out[1] == refs[0] and out[3] == []
    stats = [dec.session_stats(s) for s in sids]
    assert [st.finish_reason for st in stats] == ["length", "length", "cancelled", "length",
                                                  "stop"]
    for sid, st in zip(sids, stats):  # None while it ran; its last tokens tell why it ends
        last = None if st.finish_reason == "cancelled" else st.finish_reason
        assert seen[sid] == ([None] * (len(seen[sid]) - 1) + [last] if seen[sid] else []), sid
    for st, p, o in zip(stats, P, out):
        assert st.context_len == len(p) + len(o) and st.num_generated == len(o), st
        # a call's first token comes from its prefill, every other one from a step
        assert st.num_step_tokens == max(len(o) - 1, 0), st
    total = dec.stats
    for key, name in (("tokens", "num_step_tokens"), ("drafted", "num_drafted"),
                      ("accepted", "num_accepted")):
        assert sum(getattr(st, name) for st in stats) == total[key], key
    assert max(st.num_steps for st in stats) == total["steps"]
    assert stats[0].tokens_per_step > 4 and stats[0].acceptance_rate > 0.5, stats[0]
    assert stats[1].num_drafted == 0 and stats[1].tokens_per_step == 1.0
    assert stats[1].acceptance_rate == 0.0 and stats[3].num_steps == 0
    # a second call adds to the counts and sets its own reasons
    more = dec.generate(sids[:2], max_new_tokens=[5, 0])
    again = dec.session_stats(sids[0])
    assert again.num_generated == len(g) + len(more[0]) and again.num_steps > stats[0].num_steps
    assert dec.session_stats(sids[1]).finish_reason == "length"
    dec.close_session(sids[0])
    with pytest.raises(KeyError, match="unknown or closed"):
        dec.session_stats(sids[0])


# ---------------------------------------------------------------- failures inside generate
class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("runner", ["hf", "paged"])
@pytest.mark.parametrize("where", ["on_tokens", "interrupt", "propose", "propose_ahead"])
def test_a_failed_generate_leaves_context_and_session_tier_in_step(runner, where,
                                                                   monkeypatch):
    """A call that fails half-way (the user's streaming callback raises, a Ctrl-C in it
    included, or a step fails: in its propose, or in the next step's propose ahead, queued
    behind the step's deferred commit, which is then taken back):
    each session's context holds exactly what was streamed to it (the raising callback's
    chunk included: the sessions after it in the batch still get theirs) and what its
    session tier took, the paged KV stays a prefix of it, and the next call is plain greedy
    decoding of that context."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1)]
    g = greedy(variant, P[0], 45)
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=2048))
    steer(dec, "t0", P[0] + g)
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    streamed = {sid: [] for sid in sids}
    calls = []
    error = KeyboardInterrupt if where == "interrupt" else Boom

    def on_tokens(sid, toks):
        calls.append(sid)
        streamed[sid] += toks
        if where in ("on_tokens", "interrupt") and len(calls) == 5:  # third step, first
            raise error                                                  # session

    def failing(call):
        def f(*a, **kw):
            if len(calls) >= 4:
                raise Boom
            return call(*a, **kw)
        return f

    if where.startswith("propose"):
        monkeypatch.setattr(dec.drafter, where, failing(getattr(dec.drafter, where)))
    with pytest.raises(error):
        dec.generate(sids, max_new_tokens=45, on_tokens=on_tokens)
    monkeypatch.undo()
    if not where.startswith("propose"):  # the second session had its call in the failing step
        assert calls[5:] == [sids[1]], calls
    for sid, p in zip(sids, P):
        ctx = dec._sessions[sid].context
        held = dec.store.arena.corpus_tokens(dec.store.session(sid).corpus).tolist()
        assert held == ctx and len(ctx) > len(p) + 1
        assert ctx[len(p):] == greedy(variant, p, len(ctx) - len(p), eos=None)
        assert ctx == p + streamed[sid]
        if runner == "paged":
            assert 0 < dec._kv.kept_tokens(sid) <= len(ctx) - 1
    assert_greedy(dec, variant, sids, [list(dec._sessions[s].context) for s in sids], n=8)


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_an_interrupt_between_the_commits_halves_keeps_the_kv_before_it(runner, monkeypatch):
    """A Ctrl-C while a step waits for its accepted tokens (after the KV commit, before the
    host lengths): the step emitted nothing, each session keeps the KV of the context it
    had (the slots below the pending commit's are intact), and its next call prefills
    only the rest and is plain greedy decoding."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (3, 1)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, page_size=8,
                                                           kv_cache_tokens=2048))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]
    cls = HFRunner if runner == "hf" else PagedBatch
    commit_lengths, calls = cls.commit_lengths, []

    def interrupted(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return commit_lengths(self, *a, **kw)

    monkeypatch.setattr(cls, "commit_lengths", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dec.generate(sids, max_new_tokens=30, eos_id=None)
    monkeypatch.undo()
    ctx = [list(dec._sessions[s].context) for s in sids]
    for s, c, p in zip(sids, ctx, P):
        kept = dec._kv.kept_tokens(s)
        assert c[len(p):] == greedy(variant, p, len(c) - len(p), eos=None)
        assert len(p) < kept == len(c) - 1, (kept, len(c))  # all but the root
        if runner == "hf":
            assert dec._kv._kept[s].tensors.length == kept
    before = dec.stats["prefill_tokens"]
    assert dec.generate(sids, max_new_tokens=6, eos_id=None) == \
        [greedy(variant, c, 6, eos=None) for c in ctx]
    assert dec.stats["prefill_tokens"] - before == len(sids)  # each its root alone


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_a_failed_generate_of_more_sessions_than_max_batch(runner):
    """A call of more sessions than ``max_batch`` that fails while some wait: the running
    ones keep what they emitted (their next call continues it), the waiting ones never ran
    (context and KV as before); the sessions are idle again, and the next call of all of
    them is plain greedy decoding."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (1, 4, 6)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(
        runner=runner, max_batch=2, page_size=8, kv_cache_tokens=4096))
    sids = [dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P)]

    def on_tokens(sid, toks):
        if len(dec._sessions[sid].context) - len(P[sids.index(sid)]) >= 3:
            raise Boom

    with pytest.raises(Boom):
        dec.generate(sids, max_new_tokens=20, eos_id=None, on_tokens=on_tokens)
    ctx = [list(dec._sessions[s].context) for s in sids]
    assert ctx[2] == P[2] and dec._kv.kept_tokens(sids[2]) == 0  # it waited, never ran
    for c, p in zip(ctx[:2], P):
        assert len(c) > len(p) and c[len(p):] == greedy(variant, p, len(c) - len(p), eos=None)
    assert [dec.session_stats(s).finish_reason for s in sids] == ["error"] * 3
    assert dec.generate(sids, max_new_tokens=6, eos_id=None) == \
        [greedy(variant, c, 6, eos=None) for c in ctx]


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_a_request_that_ended_before_its_call_failed_keeps_its_finish_reason(runner):
    """``generate`` fails after one of its requests ended at its limit: that one says
    ``"length"``, the one the error cut short ``"error"``."""
    variant = VARIANTS[0]
    P = [list(prompts()[i]) for i in (1, 4)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(runner=runner, max_batch=2))
    a, b = (dec.open_session(f"t{i}", "coder", p) for i, p in enumerate(P))

    def on_tokens(sid, toks):
        if sid == b and dec.session_stats(a).finish_reason is not None:
            raise Boom

    with pytest.raises(Boom):
        dec.generate([a, b], max_new_tokens=[2, 30], eos_id=None, on_tokens=on_tokens)
    assert dec.session_stats(a).finish_reason == "length"
    assert dec.session_stats(b).finish_reason == "error"
    assert len(dec._sessions[b].context) < len(P[1]) + 30


# ---------------------------------------------------------------- close
def test_close_session_frees_memory():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (6, 3, 1)]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(max_batch=3, max_sessions=3))
    sids = [dec.open_session(t, "coder", p) for t, p in zip(("t0", "t1", "t1"), P)]
    dec.generate(sids, max_new_tokens=16)
    store = dec.store
    before = {t: store.nbytes(tenant=t) for t in ("t0", "t1")}
    assert store.nbytes(tier=CorpusTier.SESSION, tenant="t0") > 0
    assert store.nbytes(tier=CorpusTier.HISTORY, tenant="t0") == 0
    with pytest.raises(ValueError, match="max_sessions=3"):
        dec.open_session("t2", "coder", [1, 2, 3])
    dec.close_session(sids[0])
    # only the tenant's history is left, which holds the closed session's text by design
    hist = store.nbytes(tier=CorpusTier.HISTORY, tenant="t0")
    assert store.nbytes(tier=CorpusTier.SESSION, tenant="t0") == 0
    assert 0 < hist == store.nbytes(tenant="t0")
    assert store.nbytes(tenant="t1") == before["t1"]
    with pytest.raises(KeyError):
        dec.generate([sids[0]], max_new_tokens=2)
    # the drafter slot is free again
    s3 = dec.open_session("t2", "coder", P[0])
    assert_greedy(dec, variant, [sids[1], s3], [P[1] + greedy(variant, P[1], 16), P[0]])


@pytest.mark.parametrize("runner", ["hf", "paged"])
def test_more_open_sessions_than_max_batch(runner):
    """Agents keep their sessions open while they wait on tools: a decoder holds up to
    ``max_sessions`` open sessions (default 4x ``max_batch``) and generates for any
    ``max_batch`` of them at a time, each keeping its KV between calls; one session too
    many, or a larger ``propose`` batch, raises naming the setting and changes nothing. A
    ``generate`` of more sessions runs ``max_batch`` at once, the others joining as
    requests end."""
    variant = VARIANTS[0]
    P = [list(p) for p in prompts()]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(
        runner=runner, max_batch=2, max_sessions=5, page_size=8, kv_cache_tokens=4096))
    assert DecoderConfig(max_batch=3).session_limit == 12
    assert replace(DecoderConfig(), max_batch=512).session_limit == 2048
    with pytest.raises(ValueError, match="max_sessions"):
        DecoderConfig(max_batch=4, max_sessions=3)
    sids = [dec.open_session(f"t{i}", "coder", P[i]) for i in range(5)]
    with pytest.raises(ValueError, match="max_sessions=5"):
        dec.open_session("t5", "coder", P[5])
    with pytest.raises(ValueError, match="max_batch=2"):
        dec.propose(sids[2:5])
    three = dec.generate(sids[:3], max_new_tokens=[4, 9, 6])
    assert three == [greedy(variant, P[i], n) for i, n in zip(range(3), (4, 9, 6))]
    assert dec.stats["prefills"] == 2  # two ran, the third joined when the first ended
    outs = {i: o for i, o in enumerate(three)}
    for pair in ([0, 1], [2, 3], [4, 0], [1, 3]):  # every session, some twice, in new pairs
        out = dec.generate([sids[i] for i in pair], max_new_tokens=12)
        for i, o in zip(pair, out):
            ctx = P[i] + outs.get(i, [])
            assert o == greedy(variant, ctx, 12), (pair, i)
            outs[i] = outs.get(i, []) + o
    assert all(dec._kv.kept_tokens(s) > 0 for s in sids)  # idle sessions kept their KV
    dec.close_session(sids[2])
    s5 = dec.open_session("t5", "coder", P[5])  # its slot (and page-table row) is free again
    assert_greedy(dec, variant, [s5, sids[4]], [P[5], P[4] + outs[4]], n=12)
    if runner == "paged":
        assert dec._paged.kv_cache._page_table.shape[0] == 5


def test_close_tenant_frees_its_workspace_and_history_only():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (6, 3)]
    dec = SpecDecoder(model(variant), tok())
    a, b = dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[1])
    dec.add_workspace_file(a, "src/mod.py", tok().decode(P[0]))
    dec.generate([a, b], max_new_tokens=8)
    with pytest.raises(ValueError, match="tenant: 't0' has open sessions"):
        dec.close_tenant("t0")
    dec.close_session(a)  # its text joins t0's history
    t1 = dec.store.nbytes(tenant="t1")
    assert dec.store.nbytes(tier=CorpusTier.WORKSPACE, tenant="t0") > 0
    assert dec.store.nbytes(tier=CorpusTier.HISTORY, tenant="t0") > 0
    dec.close_tenant("t0")
    assert dec.store.nbytes(tenant="t0") == 0 and dec.store.nbytes(tenant="t1") == t1
    with pytest.raises(KeyError, match="t0"):
        dec.close_tenant("t0")
    with pytest.raises(ValueError, match="tenant"):
        dec.close_tenant(0)
    ctx = P[1] + greedy(variant, P[1], 8)
    assert dec.generate([b], max_new_tokens=8) == [greedy(variant, ctx, 8)]
    # a new session of the closed tenant starts from nothing
    c = dec.open_session("t0", "coder", P[0])
    assert dec.generate([c], max_new_tokens=8) == [greedy(variant, P[0], 8)]


def test_idle_tenants_past_their_budget_are_freed_and_return_empty():
    """Tenants coming and going (one session each, then gone without close_tenant): the
    store keeps the idle ones within TierConfig.idle_budget_tokens, least recently active
    freed first, and a returning tenant drafts from nothing yet decodes the same tokens."""
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in range(6)]
    budget = 2 * max(len(p) for p in P) + 2 * 8 + 4  # about two closed sessions' text
    cfg = DecoderConfig(tiers=TierConfig(idle_budget_tokens=budget))
    dec = SpecDecoder(model(variant), tok(), cfg)
    for i, p in enumerate(P):
        sid = dec.open_session(f"t{i}", "coder", p)
        assert dec.generate([sid], max_new_tokens=8) == [greedy(variant, p, 8)]
        dec.close_session(sid)
        idle = [t for t in dec.store._tenants.values() if not t.sessions]
        assert sum(t.num_tokens for t in idle) <= budget or len(idle) == 1
    assert dec.stats["evicted_tenants"] == dec.store.num_evicted_tenants >= len(P) - 3
    assert "t0" not in dec.store._tenants and f"t{len(P) - 1}" in dec.store._tenants
    with pytest.raises(KeyError, match="freed as idle"):
        dec.close_tenant("t0")
    sid = dec.open_session("t0", "coder", P[0])
    assert {tier for tier, _ in dec.store.corpora_of(sid)} <= {CorpusTier.SESSION,
                                                              CorpusTier.GLOBAL}
    assert dec.generate([sid], max_new_tokens=8) == [greedy(variant, P[0], 8)]


def test_session_tier_holds_exactly_the_context():
    variant = VARIANTS[1]
    P = [list(prompts()[i]) for i in (3, 1)]
    g = greedy(variant, P[0], 45)
    dec = SpecDecoder(model(variant), tok())
    steer(dec, "t0", P[0] + g)
    sids = [dec.open_session("t0", "coder", P[0]), dec.open_session("t1", "coder", P[1])]
    eos = greedy(variant, P[1], 1)[0]  # request 1 ends at its first token
    out = dec.generate(sids, max_new_tokens=45, eos_id=eos)
    for sid, p, o in zip(sids, P, out):
        held = dec.store.arena.corpus_tokens(dec.store.session(sid).corpus).tolist()
        assert held == p + o, (sid, len(held), len(p + o))


def test_calibration_names_its_bad_arguments_before_measuring():
    """(a helper's audit: a zero ``max_draft_tokens`` blamed ``context_tokens``, zero
    repeats failed after every measurement, ``batch_size=0`` divided by zero)"""
    import unittest.mock as mock

    from agspec_gpu.calibrate import calibrate_batch_costs, calibrate_cost_model

    dec = SpecDecoder(model(VARIANTS[0]), tok(), DecoderConfig(
        runner="paged", page_size=16, kv_cache_tokens=512, max_batch=2))
    runner = dec._paged
    for kw, name in ((dict(batch_size=0), "batch_size"), (dict(max_draft_tokens=0),
                                                          "max_draft_tokens"),
                     (dict(repeats=0), "repeats"), (dict(context_tokens=1.5), "context_tokens"),
                     (dict(warmup=-1), "warmup")):
        args = {"batch_size": 1, "context_tokens": 32, **kw}
        with pytest.raises(ValueError, match=f"^{name}"):
            calibrate_cost_model(runner, **args)
    with mock.patch("agspec_gpu.calibrate.calibrate_cost_model") as measure:
        for kw, name in ((dict(max_draft_tokens=None, max_nodes=None), "max_draft_tokens"),
                         (dict(max_draft_tokens=0), "max_draft_tokens"),
                         (dict(repeats=0), "repeats"), (dict(batch_sizes=[2, 1]), "batch_sizes"),
                         (dict(max_draft_tokens=None, max_nodes=0), "max_nodes")):
            args = {"batch_sizes": [1, 2], "context_tokens": 32, "max_draft_tokens": 8, **kw}
            with pytest.raises(ValueError, match=f"^{name}"):
                calibrate_batch_costs(runner, **args)
        assert not measure.called


def test_calibration_counts_the_drafts_kv_and_raises_before_measuring():
    """A calibration's widest step holds each request's context plus its share of the
    drafts (``max_nodes`` by default): idle sessions' KV is freed for that whole need, and a
    pool that cannot hold it raises KVCacheFull naming the arguments before any batch size
    is measured (an audit's case: the contexts fit, the drafts did not, and the curves
    measured by then were lost)."""
    from agspec_gpu.calibrate import calibration_pages
    from agspec_gpu.kv_cache import KVCacheFull

    variant = VARIANTS[0]
    dec = SpecDecoder(model(variant), tok(), DecoderConfig(
        runner="paged", page_size=16, kv_cache_tokens=512, max_batch=2))
    cache = dec._paged.kv_cache
    nodes = dec.drafter.config.max_nodes
    # 2 x (200 + 64) tokens: 34 pages of 32, though the contexts alone need 26
    assert calibration_pages(cache, 2, 200, 2 * nodes) == 2 * -(-(200 + nodes) // 16) > 32
    last = dec.drafter.cost
    import unittest.mock as mock
    with mock.patch("agspec_gpu.calibrate.calibrate_cost_model") as measure, \
            pytest.raises(KVCacheFull, match="context_tokens: calibrating 2 requests x 200"):
        dec.calibrate_cost_model(200, repeats=1)
    assert not measure.called and dec.drafter.cost is last
    assert cache.num_free_pages == 32
    assert [b for b, _ in dec.calibrate_cost_model(200, max_draft_tokens=16,
                                                   repeats=1).curves] == [1, 2]
    # an idle session's KV is freed for the drafts' pages too, not only the contexts'
    sid = dec.open_session("t0", "coder", list(prompts()[1]))
    dec.generate([sid], max_new_tokens=3, eos_id=None)
    # (the contexts alone, 2 x 15 pages, fit beside it: the drafts' pages do not)
    assert 2 * -(-230 // 16) <= cache.num_free_pages < calibration_pages(cache, 2, 230, 32) \
        == 32
    dec.calibrate_cost_model(230, max_draft_tokens=32, repeats=1)
    assert sid not in cache and cache.num_free_pages == 32
    ctx = list(dec._sessions[sid].context)  # its next call prefills again
    assert dec.generate([sid], max_new_tokens=2, eos_id=None) == [greedy(variant, ctx, 2,
                                                                         eos=None)]
