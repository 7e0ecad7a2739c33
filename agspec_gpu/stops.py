"""Stop strings, checked as tokens arrive without decoding the whole output each time.

A request with stop strings ends at the first token after which one of them appears in its
decoded output. Decoding the output so far at every token costs time linear in the output
(quadratic over a request: 54 ms for 2,000 tokens with cl100k, and growing); a
:class:`StopMatcher` decodes only a window of the last tokens, sized by the longest stop
string, and confirms a hit on the whole output.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Callable, Sequence

# Tokens kept in front of the longest stop string's bytes: a UTF-8 character cut at the
# window's start decodes as up to three U+FFFD, a SentencePiece decoder drops the first
# token's leading space, and a completed multi-byte character can reach three bytes back.
_MARGIN_TOKENS = 8


class StopMatcher:
    """Finds the token that completes one of a request's stop strings.

    ``push(t)`` answers what ``any(s in decode(tokens) for s in stops)`` answers after
    appending ``t`` (the reference, checked at every token), given that no earlier token
    completed a stop string. An occurrence that the newest token completes ends in that
    token's bytes, so it starts within the last ``len(s.encode())`` tokens that decode to
    some text (a token alone decodes to at least one byte, or to nothing: special and
    padding ids, which the window steps over) or a character's width before them: the
    window back to the ``max bytes + 8``-th last such token holds it, with decoding
    artefacts of the cut in front of it. A hit in the window is confirmed on the whole
    output, so the window never ends a request that the reference would not.

    Args:
        decode: the tokenizer's ``decode(list[int]) -> str``.
        stops: non-empty stop strings (none: ``push`` is always False).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]):
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops: expected non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self._decode = decode
        self._window = max((len(s.encode()) for s in self.stops), default=0) + _MARGIN_TOKENS
        self.tokens: list[int] = []
        self._seed_text = ""  # what seeded tokens decode to (seed)
        self._textless: dict[int, bool] = {}  # per id: decodes alone to nothing
        # positions of the last ``_window`` tokens that decode to some text
        self._texts: deque[int] = deque(maxlen=self._window)

    def seed(self, tokens: Sequence[int]) -> None:
        """Takes ``tokens`` as the output so far, unchecked (a request that goes on: an own
        loop's next step, its message so far): from now on a stop string counts only where
        it ends in text that the pushed tokens add, not in text the seeded output already
        decodes to (which may hold one). Only the tail that a window can reach is kept
        (twice the window's tokens with text), so seeding a long output decodes a few of its
        tokens, not all of it. Call it before any :meth:`push`."""
        if self.tokens:
            raise ValueError("seed(): the matcher has taken tokens already")
        if not self.stops:
            return
        start, seen = len(tokens), 0
        while start > 0 and seen < 2 * self._window:
            start -= 1
            seen += not self._is_textless(tokens[start])
        for t in tokens[start:]:
            self.tokens.append(t)
            if not self._is_textless(t):
                self._texts.append(len(self.tokens) - 1)
        self._seed_text = self._decode(self.tokens)

    def _is_textless(self, token: int) -> bool:
        textless = self._textless.get(token)
        if textless is None:
            textless = self._textless[token] = self._decode([token]) == ""
        return textless

    def push(self, token: int) -> bool:
        """Appends ``token``; True if a stop string appears in the output now."""
        self.tokens.append(token)
        if not self.stops:
            return False
        if not self._is_textless(token):
            self._texts.append(len(self.tokens) - 1)
        start = self._texts[0] if len(self._texts) == self._window else 0
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
