"""Baseline drafters: golden cases, and equivalence with the upstream implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from agspec_gpu.baselines import (
    HOST_DRAFTERS,
    PLDHF,
    PLDVLLM,
    HostDrafter,
    NoDrafter,
    SuffixDecoding,
    longest_earliest_suffix_match,
    make_host_drafter,
    suffix_decoding_available,
)

needs_suffix_decoding = pytest.mark.skipif(
    not suffix_decoding_available(), reason="arctic-inference is not installed"
)


def _propose(drafter, context) -> list[int]:
    """One request: begin with ``context``, propose once, end; checks the draft is a chain."""
    context = np.asarray(context, dtype=np.int32)
    drafter.begin("r", "t", context)
    tokens, parents = drafter.propose("r", context)
    drafter.end("r")
    assert parents == list(range(-1, len(tokens) - 1))
    return tokens


# ---------------------------------------------------------------------------------------
# PLD, transformers flavour


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        # Earliest occurrence of the trailing 2-gram [1, 2] (index 0, not 4), and the
        # continuation clipped at the end of the input runs into the suffix itself.
        ([1, 2, 3, 9, 1, 2, 4, 9, 1, 2], [3, 9, 1, 2, 4, 9, 1, 2]),
        # The 2-gram [6, 7] wins over the earlier 1-gram [7].
        ([7, 1, 2, 6, 7, 3, 4, 6, 7], [3, 4, 6, 7]),
        # No earlier [9, 1]: falls back to the 1-gram [1].
        ([4, 1, 5, 9, 1], [5, 9, 1]),
        # The continuation stops at num_output_tokens = 10.
        ([5, *range(100, 115), 5], list(range(100, 110))),
        # No match, and too short to match.
        ([1, 2, 3, 4], []),
        ([1], []),
        ([], []),
        # The suffix's own occurrence never counts: [3, 3] matches at 0 (continuation [3]).
        ([3, 3, 3], [3]),
    ],
)
def test_pld_hf_golden(context, expected):
    assert _propose(PLDHF(), context) == expected


def test_pld_hf_eos_truncates_draft():
    drafter = PLDHF(eos_token_ids=(0,))
    assert _propose(drafter, [1, 2, 3, 0, 4, 1, 2]) == [3]


def _hf_reference(context: np.ndarray) -> list[int]:
    # no end tokens: an empty tensor (transformers 4.x passes None to torch.isin)
    generator = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor([], dtype=torch.long), num_output_tokens=10,
        max_matching_ngram_size=2, max_length=10**9
    )
    input_ids = torch.as_tensor(context, dtype=torch.long)[None]
    candidates, _ = generator.get_candidates(input_ids)
    return candidates[0, len(context) :].tolist()


@pytest.mark.parametrize("vocab", [3, 8, 50, 1000])
def test_pld_hf_matches_transformers(vocab):
    rng = np.random.default_rng(vocab)
    drafter = PLDHF()
    for trial in range(60):
        length = int(rng.integers(0, 120))
        context = rng.integers(0, vocab, size=length).astype(np.int32)
        if trial % 3 == 0 and length > 10:
            # Repetitive: a copied span makes long matches and ties between occurrences.
            a = int(rng.integers(0, length - 5))
            context = np.concatenate([context, context[a : a + int(rng.integers(2, 20))]])
        assert _propose(drafter, context) == _hf_reference(context), context.tolist()


# ---------------------------------------------------------------------------------------
# PLD, vLLM flavour


def _vllm_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Transcription of vLLM's KMP search for an independent check of the vectorized one.

    Source: vllm-project/vllm, vllm/v1/spec_decode/ngram_proposer.py,
    ``_find_longest_matched_ngram_and_propose_tokens`` (max_model_len taken as unbounded).
    """
    total = len(tokens)
    if total < min_n:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:  # ">=": the latest reversed position = the earliest original
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + k]


# Golden cases from vLLM's own tests (tests/v1/spec_decode/test_ngram.py).
@pytest.mark.parametrize(
    ("context", "min_n", "max_n", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
        ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),
        ([1, 2, 3, 4, 5], 2, 2, 2, []),
        ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
        ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
        ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),
        ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
        ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
        # The proposer's docstring example.
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),
    ],
)
def test_pld_vllm_golden(context, min_n, max_n, k, expected):
    drafter = PLDVLLM(prompt_lookup_min=min_n, prompt_lookup_max=max_n, k=k)
    assert _propose(drafter, context) == expected
    assert _vllm_reference(context, min_n, max_n, k) == expected


def test_pld_vllm_defaults_need_a_5_gram():
    drafter = PLDVLLM()
    base = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    assert _propose(drafter, [*base, 1, 11, 12, 13, 14]) == []  # only a 4-gram
    assert _propose(drafter, [*base, 1, 10, 11, 12, 13, 14]) == [15, 16, 17, 18, 19]


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(5, 5, 5), (1, 3, 4), (2, 6, 10)])
def test_pld_vllm_matches_kmp_reference(min_n, max_n, k):
    rng = np.random.default_rng(min_n * 100 + max_n)
    drafter = PLDVLLM(prompt_lookup_min=min_n, prompt_lookup_max=max_n, k=k)
    for trial in range(150):
        vocab = int(rng.choice([2, 3, 6, 40]))
        length = int(rng.integers(0, 100))
        context = rng.integers(0, vocab, size=length).astype(np.int32)
        if trial % 3 == 0 and length > 10:
            a = int(rng.integers(0, length - 8))
            context = np.concatenate([context, context[a : a + int(rng.integers(3, 12))]])
        got = _propose(drafter, context)
        assert got == _vllm_reference(context.tolist(), min_n, max_n, k), context.tolist()


def test_longest_earliest_suffix_match_rejects_bad_max_n():
    with pytest.raises(ValueError, match="max_n"):
        longest_earliest_suffix_match(np.zeros(4, dtype=np.int32), 0)


# ---------------------------------------------------------------------------------------
# Protocol and factory


def test_factory_and_protocol():
    assert make_host_drafter("none").name == "none"
    assert make_host_drafter("pld-hf").name == "pld-hf"
    assert make_host_drafter("pld-vllm").name == "pld-vllm"
    for name in HOST_DRAFTERS[:3]:
        assert isinstance(make_host_drafter(name), HostDrafter)
    with pytest.raises(ValueError, match="name"):
        make_host_drafter("pld")


def test_no_drafter_and_key_misuse():
    drafter = NoDrafter()
    assert _propose(drafter, [1, 2, 1, 2]) == []
    drafter.begin("a", "t", np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError, match="already active"):
        drafter.begin("a", "t", np.zeros(3, dtype=np.int32))
    drafter.end("a")
    with pytest.raises(ValueError, match="not active"):
        drafter.propose("a", np.zeros(3, dtype=np.int32))


def test_constructor_arguments_are_validated():
    with pytest.raises(ValueError, match="num_output_tokens"):
        PLDHF(num_output_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        PLDVLLM(prompt_lookup_min=3, prompt_lookup_max=2)


# ---------------------------------------------------------------------------------------
# SuffixDecoding (arctic-inference)


def _run_request(drafter, key, prompt, response):
    """Replay one request token by token (teacher forcing); returns the draft lengths and
    how many drafted tokens matched the response."""
    context = np.asarray(prompt, dtype=np.int32)
    drafter.begin(key, "t", context)
    lengths, hits, pos = [], 0, 0
    while pos < len(response):
        tokens, parents = drafter.propose(key, context)
        assert parents == list(range(-1, len(tokens) - 1))
        lengths.append(len(tokens))
        accepted = 0
        while accepted < len(tokens) and pos + accepted < len(response):
            if tokens[accepted] != response[pos + accepted]:
                break
            accepted += 1
        hits += accepted
        step = response[pos : pos + accepted + 1]  # accepted + bonus
        drafter.accept(key, step)
        context = np.concatenate([context, np.asarray(step, dtype=np.int32)])
        pos += len(step)
    drafter.end(key)
    return lengths, hits


@needs_suffix_decoding
def test_suffix_decoding_reuses_an_earlier_response():
    rng = np.random.default_rng(0)
    response = rng.integers(1000, 2000, size=80).tolist()
    drafter = make_host_drafter("suffix-decoding")
    assert drafter.name == "suffix-decoding"
    _run_request(drafter, "a", rng.integers(0, 500, size=50), response)
    lengths, hits = _run_request(drafter, "b", rng.integers(0, 500, size=50), response)
    # After a couple of tokens the repeated response is found in the global tree; the draft
    # grows with the match length up to the depth limit of 24 (match + draft).
    assert max(lengths) >= 10
    assert hits >= len(response) - 10


@needs_suffix_decoding
def test_suffix_decoding_warm_holds_the_responses_it_was_given():
    """``cache_responses`` puts earlier traffic in the global tree, as served requests:
    a request repeating one of them finds it; the FIFO keeps the newest
    ``max_cached_requests``; a drafter without the cache refuses."""
    rng = np.random.default_rng(1)
    old, kept = (rng.integers(1000, 2000, size=80) for _ in range(2))
    drafter = SuffixDecoding(max_cached_requests=2)
    assert drafter.cache_responses([old, rng.integers(2000, 3000, size=40), kept]) == 2
    _, hits = _run_request(drafter, "a", rng.integers(0, 500, size=50), kept.tolist())
    assert hits >= len(kept) - 10
    _, hits = _run_request(drafter, "b", rng.integers(0, 500, size=50), old.tolist())
    assert hits == 0  # evicted first
    warm = make_host_drafter("suffix-decoding-warm", [old, kept])
    assert warm.name == "suffix-decoding-warm" and warm.cache_responses([]) == 2
    with pytest.raises(ValueError, match="suffix-decoding-warm: no earlier traffic"):
        make_host_drafter("suffix-decoding-warm")
    with pytest.raises(ValueError, match="cache_responses"):
        make_host_drafter("suffix-decoding-nocache").cache_responses([kept])


@needs_suffix_decoding
def test_suffix_decoding_nocache_does_not_see_earlier_responses():
    rng = np.random.default_rng(0)
    response = rng.integers(1000, 2000, size=80).tolist()
    drafter = make_host_drafter("suffix-decoding-nocache")
    assert drafter.name == "suffix-decoding-nocache"
    _run_request(drafter, "a", rng.integers(0, 500, size=50), response)
    lengths, hits = _run_request(drafter, "b", rng.integers(0, 500, size=50), response)
    assert hits == 0


@needs_suffix_decoding
def test_suffix_decoding_uses_the_prompt_and_reuses_keys():
    drafter = SuffixDecoding()
    span = list(range(3000, 3030))
    prompt = [1, 2, *span, 7, 8, span[0], span[1], span[2], span[3]]
    tokens = _propose(drafter, prompt)
    assert tokens[:4] == span[4:8]
    # A finished key may start again (its cached response is evicted first, as in vLLM).
    assert _propose(drafter, prompt) == tokens
    with pytest.raises(ValueError, match="not active"):
        drafter.accept("r", [1])


def test_suffix_decoding_missing_raises_import_error(monkeypatch):
    import agspec_gpu.baselines as baselines

    monkeypatch.setattr(baselines, "suffix_decoding_available", lambda: False)
    with pytest.raises(ImportError, match="install_arctic_inference.sh"):
        baselines.make_host_drafter("suffix-decoding-nocache")


def _cache_drafts(cache_kwargs: dict, sessions, steps_per_message: int):
    """Drives arctic-inference's ``SuffixDecodingCache`` itself, as vLLM does (a prompt tree
    of the whole context built at every request), over ``sessions`` round-robin, one message
    of each per turn; teacher forcing, accepted prefix + bonus per step. Returns the drafts."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24, **cache_kwargs)

    def speculate(key, ctx):
        d = cache.speculate(key, ctx[-24:], max_spec_tokens=24, max_spec_factor=1.0,
                            min_token_prob=0.1)
        return list(d.token_ids)

    return _drive(sessions, steps_per_message, begin=cache.start_request, propose=speculate,
                  accept=cache.add_active_response, end=cache.stop_request)


def _drive(sessions, steps_per_message, *, begin, propose, accept, end, end_session=None):
    drafts = []
    cursor = {s.sid: 0 for s in sessions}
    while any(cursor[s.sid] < len(s.target_messages) for s in sessions):
        for s in sessions:
            n = cursor[s.sid]
            if n >= len(s.target_messages):
                continue
            cursor[s.sid] += 1
            i = s.target_messages[n]
            lo, hi = int(s.bounds[i]), min(int(s.bounds[i + 1]), int(s.bounds[i]) + 400)
            key = f"{s.sid}#{n}"
            begin(key, np.ascontiguousarray(s.tokens[:lo]))
            pos = lo
            for _ in range(steps_per_message):
                if pos >= hi:
                    break
                toks = propose(key, np.ascontiguousarray(s.tokens[:pos]))
                drafts.append(toks)
                acc = 0
                while acc < len(toks) and pos + acc < hi and toks[acc] == s.tokens[pos + acc]:
                    acc += 1
                step = np.ascontiguousarray(s.tokens[pos:min(pos + acc + 1, hi)])
                accept(key, step)
                pos += len(step)
            # the rest of the message goes in unverified, as the output the session continues
            if pos < int(s.bounds[i + 1]):
                accept(key, np.ascontiguousarray(s.tokens[pos:int(s.bounds[i + 1])]))
            end(key)
            if end_session is not None and cursor[s.sid] == len(s.target_messages):
                end_session(s.sid)
    return drafts


@needs_suffix_decoding
@pytest.mark.parametrize("cache_kwargs", [{"max_cached_requests": 10000},
                                          {"max_cached_requests": 3},
                                          {"max_cached_requests": 0}])
def test_suffix_decoding_matches_suffix_decoding_cache_on_real_sessions(cache_kwargs):
    """Extending a session's prompt tree instead of rebuilding it per request changes no
    draft: every draft equals the one ``SuffixDecodingCache`` itself gives, with the response
    cache on, evicting (3 requests) and off."""
    from pathlib import Path

    from agspec_gpu.replay import tokenize_sessions
    from agspec_gpu.tokenizer import load_tokenizer
    from agspec_gpu.trajectories import load_sessions

    path = Path("/work/shared/data/trajectories/dev/swe_agent__claude-sonnet-4.jsonl.gz")
    if not path.exists():
        pytest.skip("the dev trajectories are not on this machine")
    corpus = tokenize_sessions(load_sessions(path, limit=2), load_tokenizer("cl100k"),
                               capture_files=False)
    sessions = [s for s in corpus.sessions if s.target_messages][:2]
    want = _cache_drafts(cache_kwargs, sessions, steps_per_message=40)

    ours = SuffixDecoding(cache_responses=cache_kwargs["max_cached_requests"] != 0,
                          max_cached_requests=max(cache_kwargs["max_cached_requests"], -1))

    def begin(key, ctx):
        ours.begin(key, "t", ctx, session=key.rsplit("#", 1)[0])
        tree = ours._active[key]  # holds exactly the context: the tree a rebuild would make
        assert tree.num_tokens == len(ctx) and tree.continued_by(ctx)

    got = _drive(sessions, 40, begin=begin,
                 propose=lambda key, ctx: ours.propose(key, ctx)[0],
                 accept=lambda key, toks: ours.accept(key, toks.tolist()), end=ours.end,
                 end_session=ours.end_session)
    assert len(want) > 100 and sum(map(len, want)) > 100  # real drafts, not empty ones
    assert got == want
    assert not ours._idle and not ours._active  # every session's trees are gone
