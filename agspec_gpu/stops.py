"""Stop strings, checked as tokens arrive without decoding the whole output each time.

A request with stop strings ends at the first token after which one of them appears in its
decoded output. Decoding the output so far at every token costs time linear in the output
(quadratic over a request: 54 ms for 2,000 tokens with cl100k, and growing); a
:class:`StopMatcher` decodes only a window of the last tokens, sized by the longest stop
string, and confirms a hit on the whole output.
"""

from __future__ import annotations

import os
from typing import Callable, Container, Protocol, Sequence

# Tokens kept in front of the longest stop string's bytes: a UTF-8 character cut at the
# window's start decodes as up to three U+FFFD, a SentencePiece decoder drops the first
# token's leading space, and a completed multi-byte character can reach three bytes back.
_MARGIN_TOKENS = 8


class StopTokenizer(Protocol):
    """What stop strings need of a tokenizer (:class:`~agspec_gpu.tokenizer.Tokenizer`
    has it): its decoder, its byte-fallback ids and which ids it has no token for."""

    byte_pieces: Container[int]

    def decode(self, ids: Sequence[int]) -> str: ...

    def has_no_token(self, token_id: int) -> bool: ...


class StopMatcher:
    """Finds the token that completes one of a request's stop strings.

    ``push(t)`` answers what ``any(s in decode(tokens) for s in stops)`` answers after
    appending ``t`` (the reference, checked at every token), given that no earlier token
    completed a stop string. An occurrence that the newest token completes ends in the
    text that token changed: its own bytes, or, for a byte-fallback piece
    (``byte_pieces``), anywhere in the run of byte pieces it belongs to (the ids that
    decode to nothing between them included): such a decoder turns a whole run into
    U+FFFD while its bytes are not valid UTF-8, so the piece that completes a character
    can reveal the run's text from its first piece on. The occurrence then starts within
    the last ``len(s.encode())`` tokens before that text that decode to some text other
    than whitespace (such a token adds at least a byte in context; whitespace alone may
    add nothing: ``clean_up_tokenization_spaces`` turns ``" ."`` into ``"."``, a
    SentencePiece decoder strips a leading space; special and padding ids add nothing)
    or a character's width before them. The window decoded at each token reaches back
    ``max bytes + 8`` such tokens (or twice as many with any text: see :meth:`_reach`)
    and never starts inside a run (a cut run is not valid UTF-8), so it holds every
    occurrence, with decoding artefacts of the cut in front of it. A hit in the window is
    confirmed on the whole output, so the window never ends a request that the reference
    would not. Ids the tokenizer has no token for (``void``: its decoder never sees them)
    are left out of both: a model stuck on one costs no decoding.

    Args:
        decode: the tokenizer's ``decode(list[int]) -> str``.
        stops: non-empty stop strings (none: ``push`` is always False).
        byte_pieces: the tokenizer's byte-fallback ids
            (:attr:`~agspec_gpu.tokenizer.Tokenizer.byte_pieces`; none: no runs).
        void: whether an id has no token (:meth:`~agspec_gpu.tokenizer.Tokenizer.
            has_no_token`; None: every id is decoded). Only ids the decoder drops before
            it runs qualify: one that decodes to nothing alone may still change its
            neighbours' text (a CTC decoder's pad keeps two equal tokens apart).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str],
                 byte_pieces: Container[int] = frozenset(),
                 void: Callable[[int], bool] | None = None):
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops: expected non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self._decode = decode
        self._byte_pieces = byte_pieces
        self._is_void = void
        self._window = max((len(s.encode()) for s in self.stops), default=0) + _MARGIN_TOKENS
        # the output's tokens but the void ones: a model stuck on a padded id had every
        # push decode the whole run since the last token with text (quadratic)
        self.tokens: list[int] = []
        self._seed_text = ""  # what seeded tokens decode to (seed)
        self._alone: dict[int, str] = {}  # per id: what it decodes to alone
        self._voids: dict[int, bool] = {}  # per id: _void
        self._silents: dict[int, bool] = {}  # per id: _silent

    @classmethod
    def for_tokenizer(cls, tokenizer: StopTokenizer, stops: Sequence[str]) -> "StopMatcher":
        """The matcher of ``stops`` under ``tokenizer``'s decoder, byte-fallback runs and
        ids without a token."""
        return cls(tokenizer.decode, stops, tokenizer.byte_pieces, tokenizer.has_no_token)

    def seed(self, tokens: Sequence[int]) -> None:
        """Takes ``tokens`` as the output so far, unchecked (a request that goes on: an own
        loop's next step, its message so far): from now on a stop string counts only where
        it ends in text that the pushed tokens add, not in text the seeded output already
        decodes to (which may hold one). Only the tail that a window can reach is kept
        (twice a window's tokens before the run of byte pieces the output ends in, if
        any), so seeding a long output decodes a few of its tokens, not all of it. Call it
        before any :meth:`push`."""
        if self.tokens:
            raise ValueError("seed(): the matcher has taken tokens already")
        if not self.stops:
            return
        tokens = list(tokens)
        self.tokens = [t for t in tokens[self._reach(tokens, 2 * self._window):]
                       if not self._void(t)]
        self._seed_text = self._decode(self.tokens)

    def push(self, token: int) -> bool:
        """Appends ``token``; True if a stop string appears in the output now."""
        if not self.stops or self._void(token):
            return False  # (a void id leaves the text as it was: no stop string in it)
        self.tokens.append(token)
        start = self._reach(self.tokens, self._window)
        text = self._decode(self.tokens[start:])
        if not any(s in text for s in self.stops):
            return False
        if start == 0 and not self._seed_text:
            return True  # the window was the whole output
        text = self._decode(self.tokens)
        # past the seeded text (where the output's text first differs from it: a
        # character the seed left cut decodes whole now)
        new = len(os.path.commonprefix([self._seed_text, text]))
        return any(text.find(s, max(0, new - len(s) + 1)) >= 0 for s in self.stops)

    def _reach(self, tokens: list[int], count: int) -> int:
        """Where a window of ``count`` bytes or more starts, before the text the last token
        changed: back from the last token (its run's first piece, for a byte piece) over
        ``count`` tokens with text other than whitespace, or ``2 * count`` with text in
        context (whichever comes first: a whitespace token adds a byte unless a cleanup
        removes it before a later token with text, so those hold ``count`` bytes too, and
        a run of whitespace costs a bounded window), then back to the first piece of a run
        it would cut. Void ids count as nothing."""
        end = len(tokens)
        while end > 0 and self._void(tokens[end - 1]):
            end -= 1
        start = self._run_start(tokens, end - 1) if end else 0
        if start == end - 1:  # no run behind the last token: counted with it
            start += 1
        seen = with_text = 0
        while start > 0 and seen < count and with_text < 2 * count:
            start -= 1
            if not self._void(tokens[start]):
                seen += bool(self._text(tokens[start]).strip())
                with_text += not self._silent(tokens[start])
        return self._run_start(tokens, start)

    def _text(self, token: int) -> str:
        text = self._alone.get(token)
        if text is None:
            text = self._alone[token] = self._decode([token])
        return text

    def _void(self, token: int) -> bool:
        """Whether the tokenizer has no token for ``token`` (``void``): decoded nowhere."""
        void = self._voids.get(token)
        if void is None:
            void = self._voids[token] = self._is_void is not None and \
                token not in self._byte_pieces and bool(self._is_void(token))
        return void

    def _silent(self, token: int) -> bool:
        """Whether ``token`` decodes to nothing alone and twice (not a byte piece): text
        only in some context, if any (a CTC pad; a padding id when ``void`` is not given).
        A SentencePiece ``▁``, nothing alone after the decoder strips a leading space, is a
        space twice: it counts toward the window as text (a model stuck on it had every
        push decode the whole run)."""
        silent = self._silents.get(token)
        if silent is None:
            silent = self._silents[token] = token not in self._byte_pieces and \
                self._text(token) == "" and self._decode([token, token]) == ""
        return silent

    def _run_start(self, tokens: list[int], start: int) -> int:
        """``start``, moved back to the first piece of the run of byte pieces (and the ids
        between them that decode to nothing: void or silent) that the piece at ``start``
        is in."""
        if not self._byte_pieces or not 0 <= start < len(tokens) or \
                tokens[start] not in self._byte_pieces:
            return start
        first = start
        while start > 0 and (tokens[start - 1] in self._byte_pieces or
                             self._void(tokens[start - 1]) or self._silent(tokens[start - 1])):
            start -= 1
            if tokens[start] in self._byte_pieces:
                first = start
        return first
