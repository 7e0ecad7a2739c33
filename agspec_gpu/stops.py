"""Stop strings, checked as tokens arrive without decoding the whole output each time.

A request with stop strings ends at the first token after which one of them appears in its
decoded output. Decoding the output so far at every token costs time linear in the output
(quadratic over a request: 54 ms for 2,000 tokens with cl100k, and growing); a
:class:`StopMatcher` decodes only a window of the last tokens, sized by the longest stop
string, and confirms a hit on the whole output.
"""

from __future__ import annotations

import codecs
import os
from typing import Callable, Container, Protocol, Sequence

# Tokens kept in front of the longest stop string's bytes: a UTF-8 character cut at the
# window's start decodes as up to three U+FFFD, a SentencePiece decoder drops the first
# token's leading space, and a completed multi-byte character can reach three bytes back.
_MARGIN_TOKENS = 8


class StopTokenizer(Protocol):
    """What stop strings need of a tokenizer (:class:`~agspec_gpu.tokenizer.Tokenizer`
    has it): its decoder, its byte-fallback ids and the byte each stands for, and which
    ids it has no token for."""

    byte_pieces: Container[int]

    def decode(self, ids: Sequence[int]) -> str: ...

    def has_no_token(self, token_id: int) -> bool: ...

    def byte_value(self, token_id: int) -> int | None: ...


class _Run:
    """A run of byte pieces in a matcher's output (the ids that decode to nothing between
    them included), as far as it has been pushed: enough to cut it where it decodes as its
    whole does, and to tell when its text can hold no stop string.

    Attributes:
        first: the index of its first piece.
        lead: the index of the first piece of its last character while that character is
            unfinished (the run decodes as U+FFFD), else None.
        error: the index where its bytes stop being valid UTF-8 for good (the first byte of
            the bad sequence: the run decodes as U+FFFD whatever follows), else None.
        opaque: an id that decodes to nothing stands between its pieces, or a piece's byte
            is unknown: it is cut only at its first piece.
        checked: the last index at which its text was whole and was checked (a push) or
            seeded; ``first - 1`` if none.
        fffd_checked: the output was checked (or seeded) while the run decoded as U+FFFD.
    """

    __slots__ = ("first", "lead", "error", "opaque", "checked", "fffd_checked", "_utf8")

    def __init__(self, first: int):
        self.first, self.lead, self.error, self.opaque = first, None, None, False
        self.checked, self.fffd_checked = first - 1, False
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def add(self, index: int, byte: int | None) -> None:
        """Takes the piece at ``index``, which stands for ``byte`` (None: unknown)."""
        if byte is None:
            self.opaque = True
        if self.opaque or self.error is not None:
            return
        try:
            self._utf8.decode(bytes((byte,)))
        except UnicodeDecodeError:
            self.error = index if self.lead is None else self.lead
            return
        unfinished = bool(self._utf8.getstate()[0])
        self.lead = (index if self.lead is None else self.lead) if unfinished else None

    def cut(self, index: int, byte_value: Callable[[int], int | None],
            tokens: list[int]) -> int:
        """Where a window that would start at ``index`` (in this run) starts, so that the
        run's part in it decodes as the tail of the run's text: at the first byte of the
        character ``index`` is in (a run decodes as U+FFFD while it ends mid-character,
        and so does its part from any character on), at most at the bad byte sequence
        (the part from there on is bad too), and at its first piece if opaque."""
        if self.opaque:
            return self.first
        if self.error is not None and index >= self.error:
            return self.error
        while index > self.first and 0x80 <= (byte_value(tokens[index]) or 0) < 0xC0:
            index -= 1  # (a continuation byte: 10xxxxxx)
        return index


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
    and never starts where it would cut a run into text the whole run does not decode to
    (a run cut mid-character is not valid UTF-8), so it holds every occurrence, with
    decoding artefacts of the cut in front of it. A hit in the window is confirmed on the
    whole output, so the window never ends a request that the reference would not. Ids
    the tokenizer has no token for (``void``: its decoder never sees them) are left out
    of both: a model stuck on one costs no decoding.

    With the pieces' bytes (``byte_value``), a long run costs no more than other text
    unless a stop string holds a U+FFFD (a vocabulary without CJK or emoji writes them as
    runs: 4,000 pieces had taken 10-16 s, each push decoding the whole run). The
    window may start at any character's first byte in a run (up to a byte sequence that
    is not UTF-8, after which the run decodes as U+FFFD from anywhere), and the text a
    piece reveals is the run's text since its last check. While a run decodes as U+FFFD
    (it ends mid-character, or holds a bad sequence) a piece changes only U+FFFDs, so
    after the first such check (the text in front of the run is the same each time)
    it is not decoded at all, unless a stop string holds a U+FFFD. Without
    ``byte_value`` (or where it is None for a piece) a run is cut only at its first piece
    and decoded whole at each of its pieces, which is right for any decoder whose run
    text depends on the run alone.

    Args:
        decode: the tokenizer's ``decode(list[int]) -> str``.
        stops: non-empty stop strings (none: ``push`` is always False).
        byte_pieces: the tokenizer's byte-fallback ids
            (:attr:`~agspec_gpu.tokenizer.Tokenizer.byte_pieces`; none: no runs).
        void: whether an id has no token (:meth:`~agspec_gpu.tokenizer.Tokenizer.
            has_no_token`; None: every id is decoded). Only ids the decoder drops before
            it runs qualify: one that decodes to nothing alone may still change its
            neighbours' text (a CTC decoder's pad keeps two equal tokens apart).
        byte_value: the byte a byte piece stands for (:meth:`~agspec_gpu.tokenizer.
            Tokenizer.byte_value`; None: unknown). Its decoder must decode a run as UTF-8
            when its bytes are valid and as U+FFFD otherwise, as byte-fallback decoders
            do; ids that decode to nothing between pieces make a run opaque (cut only at
            its first piece).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str],
                 byte_pieces: Container[int] = frozenset(),
                 void: Callable[[int], bool] | None = None,
                 byte_value: Callable[[int], int | None] | None = None):
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops: expected non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self._decode = decode
        self._byte_pieces = byte_pieces
        self._is_void = void
        self._byte_value = byte_value
        self._window = max((len(s.encode()) for s in self.stops), default=0) + _MARGIN_TOKENS
        self._stops_fffd = any("\ufffd" in s for s in self.stops)
        # the output's tokens but the void ones: a model stuck on a padded id had every
        # push decode the whole run since the last token with text (quadratic)
        self.tokens: list[int] = []
        self._runs: list[_Run | None] = []  # per token: the run it is in (byte_value given)
        self._seed_text = ""  # what seeded tokens decode to (seed)
        self._alone: dict[int, str] = {}  # per id: what it decodes to alone
        self._voids: dict[int, bool] = {}  # per id: _void
        self._silents: dict[int, bool] = {}  # per id: _silent
        self._bytes: dict[int, int | None] = {}  # per byte piece: byte_value

    @classmethod
    def for_tokenizer(cls, tokenizer: StopTokenizer, stops: Sequence[str]) -> "StopMatcher":
        """The matcher of ``stops`` under ``tokenizer``'s decoder, byte-fallback runs (and
        their bytes, if it has ``byte_value``) and ids without a token."""
        return cls(tokenizer.decode, stops, tokenizer.byte_pieces, tokenizer.has_no_token,
                   getattr(tokenizer, "byte_value", None))

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
        end = len(tokens)
        while end > 0 and self._void(tokens[end - 1]):
            end -= 1
        changed = self._run_start(tokens, end - 1) if end else 0
        start = self._reach(tokens, 2 * self._window, changed + (changed == end - 1),
                            lambda i: self._run_start(tokens, i))
        for t in tokens[start:]:
            if not self._void(t):
                self.tokens.append(t)
                self._join()
        run = self._runs[-1] if self._runs else None
        if run is not None and run.lead is None and run.error is None:
            run.checked = len(self.tokens) - 1  # (seeded whole)
        elif run is not None:
            run.fffd_checked = True
        self._seed_text = self._decode(self.tokens)

    def push(self, token: int) -> bool:
        """Appends ``token``; True if a stop string appears in the output now."""
        if not self.stops or self._void(token):
            return False  # (a void id leaves the text as it was: no stop string in it)
        self.tokens.append(token)
        run = self._join()
        last = len(self.tokens) - 1
        if run is None or self._byte_value is None:
            changed = self._run_start(self.tokens, last)
        elif run.opaque:
            changed = run.first
        elif run.lead is not None or run.error is not None:
            # the run decodes as U+FFFD. After the first such check, a piece only adds a
            # U+FFFD: the text in front of the run is as it was then (a decoder's cleanup
            # sees a U+FFFD after it either way)
            if run.fffd_checked and not self._stops_fffd:
                return False
            run.fffd_checked = True
            changed = run.first
        else:  # whole: text past the run's last check is new
            changed = run.checked + 1
            run.checked = last
        start = self._reach(self.tokens, self._window, changed + (changed == last), self._cut)
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

    def _reach(self, tokens: list[int], count: int, start: int,
               cut: Callable[[int], int]) -> int:
        """Where a window of ``count`` bytes or more starts, before the text the last token
        changed (``tokens[start:]``, or the last token's own text when ``start`` is past
        it): back from ``start`` over ``count`` tokens with text other than whitespace, or
        ``2 * count`` with text in context (whichever comes first: a whitespace token adds
        a byte unless a cleanup removes it before a later token with text, so those hold
        ``count`` bytes too, and a run of whitespace costs a bounded window), then back to
        where ``cut`` says a window may start. Void ids count as nothing."""
        seen = with_text = 0
        while start > 0 and seen < count and with_text < 2 * count:
            start -= 1
            if not self._void(tokens[start]):
                seen += bool(self._text(tokens[start]).strip())
                with_text += not self._silent(tokens[start])
        return cut(start)

    def _join(self) -> _Run | None:
        """Puts the last token in its run of byte pieces (the run of the piece before it,
        across ids that decode to nothing, or a new one), if it is a byte piece, and returns
        that run. Without ``byte_value``, runs are not kept (None)."""
        last = len(self.tokens) - 1
        self._runs.append(None)
        if self._byte_value is None or self.tokens[last] not in self._byte_pieces:
            return None
        prev = last - 1
        while prev >= 0 and self.tokens[prev] not in self._byte_pieces and \
                self._silent(self.tokens[prev]):
            prev -= 1
        run = self._runs[prev] if prev >= 0 else None
        if run is None:
            run = _Run(last)
        elif prev < last - 1:  # across ids that decode to nothing
            run.opaque = True
            self._runs[prev + 1:last] = [run] * (last - 1 - prev)
        self._runs[last] = run
        run.add(last, self._byte(self.tokens[last]))
        return run

    def _cut(self, index: int) -> int:
        """Where a window of the output that would start at ``index`` starts: not inside a
        run of byte pieces, but where the run decodes as its whole does (:meth:`_Run.cut`;
        its first piece without ``byte_value``)."""
        run = self._runs[index] if index < len(self._runs) else None
        if run is None:
            return self._run_start(self.tokens, index)
        return run.cut(index, self._byte, self.tokens)

    def _byte(self, token: int) -> int | None:
        if token not in self._bytes:
            self._bytes[token] = self._byte_value(token) if self._byte_value else None
        return self._bytes[token]

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
