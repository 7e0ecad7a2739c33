"""Differential fuzz: speculative ``generate`` equals plain greedy decoding, whatever happens
between the calls.

Each case draws a runner (HF or paged), a tiny model variant, tier and batch sizes, a few
tenants whose history steers the drafts, and then several rounds on random subsets of the
open sessions, through ``generate`` or through ``submit`` / ``step`` with requests joining a
running batch (ragged limits; sometimes an end token that a request emits; sometimes sampled
requests beside the greedy ones), with tool outputs appended, workspace files added and
sessions closed in between. Each tenant's history and files also hold a private text after
the prompts the tenants share, which no other tenant's draft may hold. Every greedy output
is compared with the greedy reference of the session's context so far (a sampled one is
checked for its length and ids, and becomes part of its session's context). After every
propose the drafter's kept match descriptors (updated in place between steps, see
:mod:`agspec_gpu.kept_descriptors`) are also compared with a fresh gather from the index
arena, which is what they stand in for.

A second kind of case (:func:`run_preemption_case`) drives ``submit`` / ``step`` in a pool
that holds two or three requests with optimistic admission, so that batches preempt, and
ends preempted requests in every way.

The suite runs a few seeds; more from the command line, e.g. ``python
tests/test_lossless_fuzz.py 0 200`` (about 5 s a case on a small CPU; ``... 0 20
--preempt`` for the preemption cases, about 20 s each).
"""

from __future__ import annotations

import functools
import random
import sys
from collections import Counter

import pytest
import torch

import test_decoder as td
from agspec_gpu import DecoderConfig, SamplingParams, SpecDecoder
from agspec_gpu.drafter_config import DrafterConfig
from agspec_gpu.kv_cache import KVCacheFull
from agspec_gpu.tiers import TierConfig

pytest.importorskip("transformers")

SEEDS = range(6)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = (SamplingParams(), SamplingParams(temperature=0.7, top_k=20),
           SamplingParams(temperature=1.3, top_p=0.9),
           # seeded: plain seeded sampling's tokens, whatever the batch and the drafts
           SamplingParams(temperature=0.1, top_k=5, seed=7), SamplingParams(0.9, seed=1 << 40))


def check_kept_descriptors(drafter) -> None:
    """The kept descriptors equal a fresh gather for the last step's match grid."""
    kept = drafter._kept
    assert kept.key == drafter._grid_key
    assert kept.version == drafter.store.arena.descriptor_version
    rows_cid, rows_tier = drafter._grid[1], drafter._grid[2]
    fresh = drafter.store.arena.descriptors(rows_cid)
    for name in ("tok_base", "tail_start", "level_indptr", "level_sa_base", "level_sa_len"):
        assert torch.equal(getattr(kept.desc, name), getattr(fresh, name)), name
    real = torch.tensor(rows_tier) >= 0  # padding rows' lengths are never read
    assert torch.equal(kept.desc.num_tokens[real], fresh.num_tokens[real])
    assert kept.desc.max_tail >= fresh.max_tail
    assert kept.desc.max_levels == fresh.max_levels


@functools.cache
def marker(tenant: str) -> tuple[int, ...]:
    """A tenant's private text (rare cl100k tokens, different for each tenant): only its
    own history and workspace files ever hold it."""
    raw = [70000 + 997 * int(tenant[1:]) + 3 * k for k in range(12)]
    return tuple(td.tok().encode(td.tok().decode(raw)))


def marker_drafts(draft, sids: list[str], tenant_of: dict[str, str]) -> int:
    """How many of the sessions' drafts hold two consecutive tokens of their own tenant's
    marker; raises if one holds two of another tenant's."""
    tokens, parents = draft.token_ids.tolist(), draft.parents.tolist()
    own = 0
    for b, sid in enumerate(sids):
        pairs = {t: set(zip(marker(t), marker(t)[1:])) for t in set(tenant_of.values())}
        drafted = {(tokens[b][p], tokens[b][j])
                   for j, p in enumerate(parents[b][:int(draft.num_draft_tokens[b])]) if p >= 0}
        for t, private in pairs.items():
            if t != tenant_of[sid]:
                assert not drafted & private, \
                    f"session {sid} of {tenant_of[sid]} drafted {t}'s private text"
        own += bool(drafted & pairs[tenant_of[sid]])
    return own


def checked_decoder(cfg: DecoderConfig, variant, tenant_of: dict[str, str], seen: Counter
                    ) -> SpecDecoder:
    """A decoder whose drafter, after every propose, checks its kept descriptors and that
    no draft holds another tenant's marker (``tenant_of``: each session's tenant), counting
    in ``seen``."""
    dec = SpecDecoder(td.model(variant), td.tok(), cfg)
    propose = dec.drafter._propose

    def checked(sids, stable=True, bounds=None):
        out = propose(sids, stable, bounds)
        if bounds is not None:  # no node past what its request may still emit, less one
            deepest = out.depths().amax(1).tolist() if out.max_nodes else [0] * len(sids)
            assert all(d <= b for d, b in zip(deepest, bounds)), (deepest, bounds)
            seen["bounded proposes checked"] += 1
        if dec.drafter.store.arena.unsettled is None:
            check_kept_descriptors(dec.drafter)
        else:  # a propose ahead of a deferred commit's settle: a fresh gather would settle
            # the arena with the queued counts, which a request ending inside the step
            # (fewer kept) then contradicts; the next settled propose checks
            seen["proposes ahead of a settle"] += 1
        seen["drafts of their own tenant's private text"] += marker_drafts(out, sids,
                                                                            tenant_of)
        seen["proposes checked"] += 1
        return out

    dec.drafter._propose = checked  # this instance only
    return dec


def continuous(dec: SpecDecoder, sids: list[str], limits: list[int],
               sampling: list[SamplingParams], eos: int, rng: random.Random,
               generator: torch.Generator) -> list[list[int]]:
    """The requests through ``submit`` / ``step``, joining a few steps apart."""
    outs: dict[str, list[int]] = {sid: [] for sid in sids}
    waiting = list(zip(sids, limits, sampling))
    while waiting or dec.running or dec.queued:
        while waiting and (not dec.running or rng.random() < 0.3):
            sid, n, params = waiting.pop(0)
            dec.submit(sid, max_new_tokens=n, sampling=params, eos_id=eos)
        for step in dec.step(generator):
            outs[step.session_id] += step.token_ids
    return [outs[sid] for sid in sids]


def run_case(seed: int) -> Counter:
    """One random case; returns what it covered: rounds by kind, proposes checked."""
    rng = random.Random(seed)
    variant = rng.choice(td.VARIANTS)
    runner = rng.choice(["hf", "paged"])
    # a tight page pool: a few requests at a time. Each session fits alone at its
    # longest (140 prompt tokens + 4 rounds of up to 48 new and 40 appended + a step's 17
    # = 509 slots); reserving admission never lets a batch run out of pages, optimistic
    # admission preempts
    tight = runner == "paged" and rng.random() < 0.3
    cfg = DecoderConfig(
        tiers=TierConfig(use_global=False, tail_tokens=rng.choice([4, 8, 32, 1024]),
                         # drawn apart too: a third of the cases free idle tenants' text
                         # (steered histories among them) as other tenants come and go
                         idle_budget_tokens=random.Random(seed ^ 0x1D1E).choice(
                             [24_000_000, 24_000_000, 60])),
        # (small trees in a tight pool: a step's reserve below the requests' growth, so
        # that optimistic admission outgrows the pool and preempts)
        drafter=DrafterConfig(max_positions=rng.choice([1, 4, 8]),
                              max_nodes=rng.choice([8, 16]) if tight else 64),
        max_batch=rng.choice([2, 4, 8]), runner=runner,
        page_size=rng.choice([4, 8, 16]), kv_cache_tokens=576 if tight else 1 << 13,
        admission=rng.choice(["reserve", "optimistic"]),
        # drawn apart: the other draws (and so what each seed covers) are as before
        tree_attention=random.Random(seed ^ 0x5EED).choice(["split", "custom"]))
    tenant_of: dict[str, str] = {}
    seen = Counter()
    dec = checked_decoder(cfg, variant, tenant_of, seen)
    generator = torch.Generator().manual_seed(seed)
    prompts = td.prompts()
    num_tenants = rng.randint(1, 3)
    context: dict[str, list[int]] = {}
    for i in range(rng.randint(1, cfg.max_batch + 2)):  # a generate may wait for room
        tenant = f"t{i % num_tenants}"
        prompt = list(prompts[rng.randrange(len(prompts))])
        if rng.random() < 0.5:  # the tenant's history holds the greedy continuation
            td.steer(dec, tenant, prompt + td.greedy(variant, prompt, 24))
        if rng.random() < 0.5:  # its private text where a session of P drafts first
            td.steer(dec, tenant, prompt + td.greedy(variant, prompt, 1) + list(marker(tenant)))
        sid = dec.open_session(tenant, "coder", prompt)
        context[sid], tenant_of[sid] = prompt, tenant
    for rnd in range(rng.randint(2, 4)):
        open_sids = list(context)
        batch = rng.sample(open_sids, rng.randint(1, len(open_sids)))
        limits = [rng.choice([1, 8, 16, 24] if not tight else [8, 24, 48]) for _ in batch]
        eos = -1  # the tokenizer's; or a token the first request will emit, to end there
        if rng.random() < 0.3:
            eos = rng.choice(td.greedy(variant, context[batch[0]], limits[0]))
        sampling = [GREEDY] * len(batch)
        if rng.random() < 0.3:  # sampled requests beside greedy ones
            sampling = [rng.choice([GREEDY, *SAMPLED]) for _ in batch]
        seen["sampled rounds"] += not all(p.is_greedy for p in sampling)
        seen["end-token rounds"] += eos != -1
        seen["tight-pool rounds"] += tight
        if rng.random() < 0.5:
            seen["generate rounds"] += 1
            outs = dec.generate(batch, max_new_tokens=limits, sampling=sampling, eos_id=eos,
                                generator=generator)
        else:
            seen["submit/step rounds"] += 1
            outs = continuous(dec, batch, limits, sampling, eos, rng, generator)
        end = td.tok().eos_id if eos == -1 else eos
        for sid, n, params, out in zip(batch, limits, sampling, outs):
            st = dec.session_stats(sid)  # why it ended: its end token first, else its limit
            assert st.finish_reason == ("eos" if out and out[-1] == end else "length"), st
            assert st.context_len == len(context[sid]) + len(out), st
            if params.is_greedy:  # the greedy ones stay plain greedy decoding
                assert out == td.greedy(variant, context[sid], n, eos), (seed, rnd, sid)
            elif params.seed is not None:  # the seeded ones plain seeded sampling
                assert out == td.seeded_sample(variant, context[sid], n, params, eos), \
                    (seed, rnd, sid)
                seen["seeded requests"] += 1
            else:  # the end token ends the output, if there
                assert 1 <= len(out) <= n and all(0 <= t < td.VOCAB for t in out), out
                assert end not in out[:-1], (end, out)
            context[sid] += out
        event, sid = rng.random(), rng.choice(open_sids)
        if event < 0.4:  # a tool output
            extra = td.other_text(rng.randint(1, 40), at=rng.randrange(3000))
            dec.append(sid, extra)
            context[sid] += extra
        elif event < 0.6:  # a file; or the session's last tokens and where it goes next,
            ids = td.other_text(60, at=rng.randrange(3000))  # then the tenant's private text
            if rng.random() < 0.5:
                ctx = context[sid]
                ids = ctx[-30:] + td.greedy(variant, ctx, 1) + list(marker(tenant_of[sid]))
            dec.add_workspace_file(sid, f"f{rnd}.py", td.tok().decode(ids))
        elif event < 0.75 and len(open_sids) > 1:
            dec.close_session(sid)
            del context[sid]
    seen["preemptions"] += dec.stats["preemptions"]
    for sid in context:
        dec.close_session(sid)
    seen["idle tenants freed"] += dec.store.num_evicted_tenants
    return seen


@pytest.mark.parametrize("seed", SEEDS)
def test_generate_equals_greedy_on_random_cases(seed):
    assert run_case(seed)["proposes checked"] > 0


def check_pool(dec: SpecDecoder, context: dict[str, list[int]]) -> None:
    """The pool's pages are free or held by an open session, each once; each session's
    context is what it was given and emitted."""
    cache = dec._paged.kv_cache
    held = [p for seq, pages in cache._pages.items() for p in pages]
    assert len(set(held + cache._free_pages)) == len(held) + cache.num_free_pages == \
        cache.num_pages, (len(held), cache.num_free_pages)
    assert set(cache._pages) <= set(context), "KV of a closed session"
    for sid, ctx in context.items():
        assert dec._sessions[sid].context == ctx, sid


def run_preemption_case(seed: int) -> Counter:
    """A pool that holds two or three requests, optimistic admission and long limits, so
    that running batches outgrow the pool and preempt: requests submitted as sessions go
    idle, cancels and closes that pick preempted (queued, part-emitted) requests, re-opened
    sessions, tool outputs, ``generate`` calls between steps, seeded sampled requests.
    Every token a request emits extends plain greedy decoding (or plain seeded sampling)
    of its context at submission; pages and contexts are checked after every step."""
    rng = random.Random(seed)
    variant = rng.choice(td.VARIANTS)
    cfg = DecoderConfig(tiers=TierConfig(use_global=False),
                        drafter=DrafterConfig(max_nodes=rng.choice([1, 2, 4, 8])),
                        max_batch=rng.choice([2, 3, 4, 5]), max_sessions=32, runner="paged",
                        page_size=rng.choice([1, 2, 4, 8, 16]),
                        kv_cache_tokens=rng.choice([200, 256, 320]), admission="optimistic")
    dec = SpecDecoder(td.model(variant), td.tok(), cfg)
    # no top_k: at a (near) tie of the k-th logits the paged runner's float noise moves the
    # cut, and the sampled token with it (seeds 399, 409: the reference's 50th and 51st
    # logits 2.4e-7 apart, and equal); top_k's distribution is checked in test_accept
    seeded = SamplingParams(temperature=0.9, seed=seed)
    prompts = [list(p) for p in td.prompts() if len(p) <= 100]
    context: dict[str, list[int]] = {}
    req: dict[str, tuple] = {}  # sid: (context at submission, limit, sampling, emitted)
    seen = Counter()

    def open_one() -> None:
        prompt = prompts[rng.randrange(len(prompts))]
        context[dec.open_session(f"t{rng.randrange(3)}", "coder", prompt)] = list(prompt)

    def expected(sid: str) -> list[int]:
        ctx, n, params, _ = req[sid]
        if params is None:
            return td.greedy(variant, ctx, n, eos=None)
        return td.seeded_sample(variant, ctx, n, params, eos=None)

    for _ in range(rng.randint(3, 6)):
        open_one()
    ended = 0
    for _ in range(300):
        busy = set(dec.running) | set(dec.queued)
        for sid in list(context):  # idle sessions take a tool output and a new request
            if sid not in busy and ended < 12 and rng.random() < 0.5:
                if rng.random() < 0.2:
                    extra = td.other_text(rng.randint(1, 10), at=rng.randrange(2000))
                    dec.append(sid, extra)
                    context[sid] += extra
                params = seeded if rng.random() < 0.2 else None
                n = rng.randint(10, 120)
                try:
                    dec.submit(sid, max_new_tokens=n, sampling=params, eos_id=None)
                except KVCacheFull:  # its context alone outgrew the pool: refused, not queued
                    seen["submissions refused (context > pool)"] += 1
                    assert sid not in dec.queued and sid not in dec.running
                    ended += 1
                    continue
                req[sid] = (list(context[sid]), n, params, [])
        preempted = [sid for sid in dec.queued if req[sid][3]]
        if preempted and rng.random() < 0.15:
            sid = rng.choice(preempted)
            seen["preempted requests ended"] += 1
            ended += 1
            if rng.random() < 0.5 or len(context) == 1:
                dec.cancel(sid)
                assert dec.session_stats(sid).finish_reason == "cancelled"
            else:
                dec.close_session(sid)
                del context[sid], req[sid]
                if rng.random() < 0.7:
                    open_one()
        idle = [s for s in context if s not in set(dec.running) | set(dec.queued)]
        if idle and rng.random() < 0.04:  # a generate call beside the submitted requests
            batch, n = rng.sample(idle, min(len(idle), 2)), rng.randint(1, 10)
            seen["generate calls"] += 1
            try:
                outs = dec.generate(batch, max_new_tokens=n, eos_id=None)
                assert all(len(o) == n for o in outs), seed  # no EOS: every token asked
            except KVCacheFull:  # the submitted requests hold the pool: what ran is greedy
                seen["generate calls short of pages"] += 1
                outs = [dec._sessions[s].context[len(context[s]):] for s in batch]
            for sid, out in zip(batch, outs):
                assert out == td.greedy(variant, context[sid], len(out), eos=None), seed
                context[sid] += out
        if not dec.running and not dec.queued:
            if ended >= 12:
                break
            continue
        running = dec.running
        try:
            outs = dec.step()
        except KVCacheFull:  # a lone request outgrew the pool: the step's requests end there
            seen["steps short of pages"] += 1
            for sid in running:
                assert dec.session_stats(sid).finish_reason == "error"
                assert dec._sessions[sid].context == context[sid]
            ended += len(running)
            continue
        for out in outs:
            sid = out.session_id
            emitted = req[sid][3]
            emitted += out.token_ids
            context[sid] += out.token_ids
            assert emitted == expected(sid)[:len(emitted)], (seed, sid, len(emitted))
            if out.finished:
                ended += 1
                assert out.finish_reason == "length" and len(emitted) == req[sid][1]
        check_pool(dec, context)
    seen["preemptions"] += dec.stats["preemptions"]
    for sid in list(context):
        dec.close_session(sid)
    assert dec._paged.kv_cache.num_free_pages == dec._paged.kv_cache.num_pages
    return seen


@pytest.mark.parametrize("seed", [1, 2])
def test_preempting_batches_equal_greedy_on_random_cases(seed):
    assert run_preemption_case(seed)["preemptions"] > 0


if __name__ == "__main__":  # seeds LO..HI; with --preempt the preemption cases
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    case = run_preemption_case if "--preempt" in sys.argv[3:] else run_case
    failures, seen = 0, Counter()
    for s in range(lo, hi):
        try:
            seen += case(s)
            print("ok", s, flush=True)
        except AssertionError as e:
            failures += 1
            print("FAIL", s, repr(e)[:300], flush=True)
    print(f"seeds {lo}-{hi}: {failures} failures;", ", ".join(f"{v} {k}" for k, v in seen.items()))
    sys.exit(1 if failures else 0)
