"""Baseline drafters behind one host-side protocol, for the replay evaluator and benchmarks.

Every baseline reproduces an upstream drafter's choice of draft exactly (same match rule,
same tie-break, same length limits), so figures compare against what users of those systems
actually get:

- ``none``: no speculation.
- ``pld-hf``: Hugging Face transformers' prompt lookup decoding
  (``transformers/generation/candidate_generator.py``, ``PromptLookupCandidateGenerator``).
- ``pld-vllm``: vLLM's n-gram proposer
  (``vllm/v1/spec_decode/ngram_proposer.py``, ``_find_longest_matched_ngram_and_propose_tokens``).
- ``suffix-decoding`` / ``suffix-decoding-nocache``: arctic-inference's ``SuffixDecodingCache``
  driven the way vLLM's ``vllm/v1/spec_decode/suffix_decoding.py`` drives it, with and without
  the cross-request cache of earlier responses; ``suffix-decoding-warm``: the same, its cache
  holding the responses of earlier traffic before the replay starts (the replay fills it with
  the other half's assistant messages, the text agspec's global tier holds).

Drafts are host lists: ``(tokens, parents)`` with ``parents[j]`` the index of node ``j``'s
parent, ``-1`` for children of the root (the last committed token); a chain has parents
``[-1, 0, 1, ...]`` (the layout of :class:`agspec_gpu.draft_batch.DraftBatch`).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

HOST_DRAFTERS = ("none", "pld-hf", "pld-vllm", "suffix-decoding", "suffix-decoding-warm",
                 "suffix-decoding-nocache")

SUFFIX_DECODING_INSTALL_HINT = (
    "SuffixDecoding needs arctic-inference (only an sdist on PyPI; it builds the suffix tree "
    "extension without CUDA). Install it into this environment with "
    "`bash bench/install_arctic_inference.sh` (see bench/INSTALL_SUFFIX_DECODING.md)."
)


@runtime_checkable
class HostDrafter(Protocol):
    """A drafter that runs on the host and is driven one request at a time.

    Call order per request: ``begin`` once, then any number of ``propose`` / ``accept``
    rounds, then ``end``. A request is one assistant message; ``key`` names it and must be
    unique among active requests.
    """

    name: str

    def begin(self, key: str, tenant: str, context: np.ndarray,
              session: str | None = None) -> None:
        """Start request ``key``; ``context`` is the int32 token ids of everything before it.

        ``session``: the request continues that session (an agent's next turn): ``context``
        extends the context and output of the session's previous request. A drafter may keep
        per-session state for it until :meth:`end_session`.
        """

    def propose(self, key: str, context: np.ndarray) -> tuple[list[int], list[int]]:
        """Draft after ``context`` (prompt + output so far): ``(tokens, parents)``, maybe empty."""

    def accept(self, key: str, tokens: list[int]) -> None:
        """``tokens`` (accepted draft + bonus) were just appended to the request's output."""

    def end(self, key: str) -> None:
        """Request ``key`` is finished; its per-request state is dropped."""

    def end_session(self, session: str) -> None:
        """Session ``session`` has no more requests; its state is dropped."""


def _chain(tokens: np.ndarray) -> tuple[list[int], list[int]]:
    return tokens.tolist(), list(range(-1, len(tokens) - 1))


def _as_tokens(context: np.ndarray) -> np.ndarray:
    tokens = np.asarray(context)
    if tokens.ndim != 1:
        raise ValueError(f"context must be 1-D token ids, got shape {tokens.shape}")
    return tokens


def longest_earliest_suffix_match(tokens: np.ndarray, max_n: int) -> tuple[int, int]:
    """Longest n-gram (``n <= max_n``) ending the sequence that also occurs earlier in it.

    An occurrence counts only if at least one token follows it, which excludes the suffix
    itself (both upstream PLDs find the suffix as a match of itself and skip it because its
    continuation is empty). Tie-break among occurrences of the longest ``n``: the earliest
    (smallest start index), as both transformers and vLLM pick.

    Returns:
        ``(n, start)``: the match length (0 if even the last token never occurred before)
        and the index of the first continuation token (``-1`` when ``n == 0``).

    Cost: one vectorized pass over the sequence for the last token, then passes over the
    shrinking set of candidate occurrences only, so a 100k-token context costs tens of µs.
    """
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    length = len(tokens)
    if length < 2:
        return 0, -1
    # Candidate occurrences are identified by the index of their last token; every one of
    # them ends at or before length - 2, so its continuation is non-empty.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return 0, -1
    best_n, best_ends = 1, ends
    for j in range(1, max_n):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[length - 1 - j]]
        if ends.size == 0:
            break
        best_n, best_ends = j + 1, ends
    # Ends are ascending and all occurrences have the same length, so the first is earliest.
    return best_n, int(best_ends[0]) + 1


class _ActiveKeys:
    """Per-request bookkeeping shared by the stateless drafters: catches harness misuse
    (double begin, propose after end) the same way the stateful SuffixDecoding does."""

    def __init__(self) -> None:
        self._active: set[str] = set()

    def begin(self, key: str, tenant: str, context: np.ndarray,
              session: str | None = None) -> None:
        if key in self._active:
            raise ValueError(f"key {key!r} is already active")
        self._active.add(key)

    def _check(self, key: str) -> None:
        if key not in self._active:
            raise ValueError(f"key {key!r} is not active")

    def accept(self, key: str, tokens: list[int]) -> None:
        self._check(key)

    def end(self, key: str) -> None:
        self._check(key)
        self._active.remove(key)

    def end_session(self, session: str) -> None:
        pass


class NoDrafter(_ActiveKeys):
    """``none``: never drafts (plain autoregressive decoding)."""

    name = "none"

    def propose(self, key: str, context: np.ndarray) -> tuple[list[int], list[int]]:
        self._check(key)
        return [], []


class PLDHF(_ActiveKeys):
    """``pld-hf``: transformers' ``PromptLookupCandidateGenerator.get_candidates``.

    Upstream rule (transformers 5.x ``generation/candidate_generator.py``): for ngram sizes
    ``min(max_matching_ngram_size, len - 1)`` down to 1, take the trailing ngram, scan its
    occurrences left to right and use the first whose continuation is non-empty; the draft is
    the next ``num_output_tokens`` tokens, clipped at the end of the input. That is: longest
    n in ``[1, max_matching_ngram_size]``, earliest occurrence, a chain.

    Upstream quirks kept: the trailing ngram's own occurrence is skipped only because its
    continuation is empty; a match near the end yields a short draft rather than a later,
    longer one. ``eos_token_ids`` (upstream's ``eos_token_id``) truncates the draft before
    the first EOS, as ``generate`` does; default none. Not modelled: ``max_length`` (the
    replay has no length cap, so upstream's clip never binds) and the logits-processor
    filter (the replay is greedy with no processors).
    """

    name = "pld-hf"

    def __init__(
        self,
        max_matching_ngram_size: int = 2,
        num_output_tokens: int = 10,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        if max_matching_ngram_size < 1:
            raise ValueError(f"max_matching_ngram_size must be >= 1, got {max_matching_ngram_size}")
        if num_output_tokens < 1:
            raise ValueError(f"num_output_tokens must be >= 1, got {num_output_tokens}")
        self.max_matching_ngram_size = max_matching_ngram_size
        self.num_output_tokens = num_output_tokens
        self.eos_token_ids = tuple(eos_token_ids)

    def propose(self, key: str, context: np.ndarray) -> tuple[list[int], list[int]]:
        """Draft per the class rule; empty when even the last token never occurred before."""
        self._check(key)
        tokens = _as_tokens(context)
        n, start = longest_earliest_suffix_match(tokens, self.max_matching_ngram_size)
        if n == 0:
            return [], []
        draft = tokens[start : start + self.num_output_tokens]
        if self.eos_token_ids:
            eos = np.flatnonzero(np.isin(draft, self.eos_token_ids))
            if eos.size:
                draft = draft[: eos[0]]
        return _chain(draft)


class PLDVLLM(_ActiveKeys):
    """``pld-vllm``: vLLM v1's ``NgramProposer``.

    Upstream rule (vllm/v1/spec_decode/ngram_proposer.py,
    ``_find_longest_matched_ngram_and_propose_tokens``: KMP over the reversed tokens, the
    failure table capped at ``prompt_lookup_max``): the longest n in
    ``[prompt_lookup_min, prompt_lookup_max]`` whose trailing n-gram occurs earlier; among
    its occurrences the one at the "latest position in the reversed tokens", i.e. the
    EARLIEST in the original order (upstream updates on ``>=``); the draft is the next ``k``
    tokens, clipped at the end of the input. No match of length ``>= prompt_lookup_min``:
    empty draft. Not modelled: the ``max_model_len`` clip (no length cap in the replay).

    Defaults: ``prompt_lookup_max=5`` and ``k=5`` as configured for the benchmarks;
    ``prompt_lookup_min=5`` because vLLM's ``SpeculativeConfig`` sets an unset
    ``prompt_lookup_min`` to ``prompt_lookup_max`` (vllm/config/speculative.py).
    """

    name = "pld-vllm"

    def __init__(self, prompt_lookup_min: int = 5, prompt_lookup_max: int = 5, k: int = 5) -> None:
        super().__init__()
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min={prompt_lookup_min}, "
                f"got {prompt_lookup_max}"
            )
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.k = k

    def propose(self, key: str, context: np.ndarray) -> tuple[list[int], list[int]]:
        """Draft per the class rule; empty when no n-gram of ``prompt_lookup_min`` matches."""
        self._check(key)
        tokens = _as_tokens(context)
        n, start = longest_earliest_suffix_match(tokens, self.prompt_lookup_max)
        if n < self.prompt_lookup_min:
            return [], []
        return _chain(tokens[start : start + self.k])


def suffix_decoding_available() -> bool:
    """True when arctic-inference's suffix decoding extension can be imported."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401  (the compiled _C must load too)
    except ImportError:
        return False
    return True


class SuffixDecoding:
    """``suffix-decoding`` / ``suffix-decoding-nocache``: arctic-inference's suffix trees with
    the policy of its ``SuffixDecodingCache``, driven as vLLM's ``SuffixDecodingProposer``
    drives that cache.

    The cache's state is two kinds of arctic-inference ``SuffixTree`` (its native core): a
    per-request prompt tree of the request's prompt and output, and one global tree of the
    responses of up to ``max_cached_requests`` requests (FIFO eviction; a key whose old
    response is still cached is evicted first, as vLLM does). ``propose`` speculates on the
    last ``max_tree_depth`` tokens in both and keeps the prompt tree's draft when its score is
    at least the global one's: ``SuffixDecodingCache.speculate`` exactly.

    The one change from driving ``SuffixDecodingCache`` itself: a request that continues a
    ``session`` (its context extends the previous request's context and output, as each turn
    of an agent does) extends the previous request's prompt tree with the new tokens instead
    of building a tree of the whole prompt again. A suffix tree grows by appending, so the
    tree, and every draft, is the same (``tests/test_baselines.py`` compares every draft with
    ``SuffixDecodingCache`` on real sessions); rebuilding made the replay quadratic in session
    length, where vLLM's cost is its own, not the evaluator's.

    Defaults are vLLM's: ``max_tree_depth=24``, ``max_spec_tokens`` (its
    ``num_speculative_tokens``) 24, ``max_spec_factor=1.0``, ``min_token_prob=0.1``,
    ``max_cached_requests=10000``, chain drafts (vLLM does not enable ``use_tree_spec``).
    With ``cache_responses=False`` (``suffix-decoding-nocache``) the global tree is disabled
    and only the request's own prompt + output is searched; :meth:`cache_responses` fills
    the global tree with earlier traffic (``suffix-decoding-warm``).

    ``tenant`` is ignored: like upstream, the global tree mixes all requests' responses.

    Raises:
        ImportError: arctic-inference is not installed (the message says how to install it).
    """

    def __init__(
        self,
        cache_responses: bool = True,
        max_tree_depth: int = 24,
        max_spec_tokens: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 10000,
    ) -> None:
        if not suffix_decoding_available():
            raise ImportError(SUFFIX_DECODING_INSTALL_HINT)
        from arctic_inference.suffix_decoding._C import SuffixTree

        if max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {max_tree_depth}")
        if max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be >= 1, got {max_spec_tokens}")
        if max_cached_requests < -1:
            raise ValueError(f"max_cached_requests must be >= -1, got {max_cached_requests}")
        self.name = "suffix-decoding" if cache_responses else "suffix-decoding-nocache"
        self.max_tree_depth = max_tree_depth
        self.max_spec_tokens = max_spec_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests if cache_responses else 0
        self._new_tree = lambda: SuffixTree(max_tree_depth)  # noqa: E731
        self._global = self._new_tree() if self.max_cached_requests != 0 else None
        self._seq_of: dict[str, int] = {}  # cached responses, oldest first (FIFO eviction)
        self._next_seq = 0
        self._active: dict[str, _PromptTree] = {}
        self._session_of: dict[str, str | None] = {}
        self._idle: dict[str, _PromptTree] = {}  # a session's tree between its requests

    @staticmethod
    def _int32(tokens: np.ndarray | list[int]) -> np.ndarray:
        # The zero-copy ndarray path of the extension accepts only contiguous 1-D int32.
        return np.ascontiguousarray(_as_tokens(np.asarray(tokens, dtype=np.int32)))

    def _check(self, key: str) -> None:
        if key not in self._active:
            raise ValueError(f"key {key!r} is not active")

    def begin(self, key: str, tenant: str, context: np.ndarray,
              session: str | None = None) -> None:
        if key in self._active:
            raise ValueError(f"key {key!r} is already active")
        context = self._int32(context)
        tree = self._idle.pop(session, None) if session is not None else None
        if tree is None or not tree.continued_by(context):
            tree = _PromptTree(self._new_tree())
        tree.extend(context[tree.num_tokens:])
        self._active[key] = tree
        self._session_of[key] = session
        if self._global is not None:
            if key in self._seq_of:
                self._global.remove(self._seq_of.pop(key))
            self._seq_of[key] = self._next_seq
            self._next_seq += 1
            while len(self._seq_of) > self.max_cached_requests > 0:
                self._global.remove(self._seq_of.pop(next(iter(self._seq_of))))

    def cache_responses(self, responses) -> int:
        """Puts ``responses`` (token arrays: earlier requests' outputs, oldest first) in the
        global tree, as a server that answered them before holds them (FIFO, up to
        ``max_cached_requests``); returns how many responses the tree holds."""
        if self._global is None:
            raise ValueError("cache_responses: this drafter caches no responses "
                             "(cache_responses=False)")
        for tokens in responses:
            seq = self._seq_of[("cached", self._next_seq)] = self._next_seq
            self._next_seq += 1
            self._global.extend_ndarray(seq, self._int32(tokens))
            while len(self._seq_of) > self.max_cached_requests > 0:
                self._global.remove(self._seq_of.pop(next(iter(self._seq_of))))
        return len(self._seq_of)

    def propose(self, key: str, context: np.ndarray) -> tuple[list[int], list[int]]:
        """The better-scored chain of the two trees for the last ``max_tree_depth`` tokens;
        maybe empty."""
        self._check(key)
        pattern = self._int32(_as_tokens(context)[-self.max_tree_depth :])
        args = (pattern, self.max_spec_tokens, self.max_spec_factor, 0.0, self.min_token_prob,
                False)
        draft = self._active[key].tree.speculate_ndarray(*args)
        if self._global is not None:
            other = self._global.speculate_ndarray(*args)
            if other.score > draft.score:
                draft = other
        return list(draft.token_ids), list(draft.parents)

    def accept(self, key: str, tokens: list[int]) -> None:
        self._check(key)
        if len(tokens):
            tokens = self._int32(tokens)
            self._active[key].extend(tokens)
            if key in self._seq_of:
                self._global.extend_ndarray(self._seq_of[key], tokens)

    def end(self, key: str) -> None:
        self._check(key)
        tree = self._active.pop(key)
        session = self._session_of.pop(key)
        if session is not None:
            self._idle[session] = tree

    def end_session(self, session: str) -> None:
        self._idle.pop(session, None)


class _PromptTree:
    """A request's prompt tree and the tokens in it (to check that a next request continues
    them)."""

    def __init__(self, tree) -> None:
        self.tree = tree
        self._chunks: list[np.ndarray] = []
        self.num_tokens = 0

    def extend(self, tokens: np.ndarray) -> None:
        if tokens.size:
            self.tree.extend_ndarray(0, tokens)
            self._chunks.append(tokens)
            self.num_tokens += tokens.size

    def continued_by(self, context: np.ndarray) -> bool:
        if context.size < self.num_tokens:
            return False
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return not self._chunks or np.array_equal(context[:self.num_tokens], self._chunks[0])


def make_host_drafter(name: str, warm_responses: Sequence[np.ndarray] = ()) -> HostDrafter:
    """The baseline drafter called ``name`` (one of ``HOST_DRAFTERS``), with upstream defaults;
    ``suffix-decoding-warm``'s cache holds ``warm_responses`` (earlier traffic's responses,
    token arrays oldest first), as a server that answered them would.

    Raises:
        ValueError: ``name`` is not in ``HOST_DRAFTERS``; ``suffix-decoding-warm`` without
            ``warm_responses``.
        ImportError: a ``suffix-decoding*`` name without arctic-inference installed.
    """
    if name == "suffix-decoding-warm" and not len(warm_responses):
        raise ValueError(f"{name}: no earlier traffic to warm its cache with (the other "
                         f"half's responses: a cross-halves replay, or an e2e run with --half)")
    if name == "none":
        return NoDrafter()
    if name == "pld-hf":
        return PLDHF()
    if name == "pld-vllm":
        return PLDVLLM()
    if name in ("suffix-decoding", "suffix-decoding-warm"):
        d = SuffixDecoding(cache_responses=True)
        d.name = name
        if name == "suffix-decoding-warm":
            d.cache_responses(warm_responses)
        return d
    if name == "suffix-decoding-nocache":
        return SuffixDecoding(cache_responses=False)
    raise ValueError(f"name must be one of {HOST_DRAFTERS}, got {name!r}")
