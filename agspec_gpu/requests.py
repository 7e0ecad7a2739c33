"""The requests of a running generation batch, host side: limits, stop strings, outputs.

:class:`~agspec_gpu.decoder.SpecDecoder` keeps one :class:`Requests` per running batch (a
``generate`` call, or the batch that ``submit`` / ``step`` grow and shrink): row ``b`` is row
``b`` of the runner that holds the requests' KV. Everything here is host bookkeeping: what a
request emitted, whether it ended (EOS, a stop string, its limit, its caller), what of a
step's tokens it takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import Callable

import numpy as np

from agspec_gpu.accept import SamplingParams
from agspec_gpu.checks import check_text, is_int
from agspec_gpu.stops import StopMatcher, StopTokenizer


@dataclass
class SessionState:
    """The decoder's record of one open session (host): its context and its counters."""

    tenant: str
    role: str
    context: list[int]                      # prompt, appended and generated tokens
    message: list[int] = field(default_factory=list)  # generated since the last append
    num_generated: int = 0                  # tokens it generated, in all its requests
    num_steps: int = 0                      # verification steps it was in
    num_step_tokens: int = 0                # tokens those steps emitted for it
    num_drafted: int = 0                    # draft tokens verified for it
    num_accepted: int = 0                   # of those, accepted
    finish_reason: str | None = None        # why its last request ended (Requests.finish)

    def extend(self, tokens: list[int]) -> None:
        """Takes tokens the model generated (context and message)."""
        self.context.extend(tokens)
        self.message.extend(tokens)
        self.num_generated += len(tokens)

    def stats(self) -> "SessionStats":
        return SessionStats(self.tenant, self.role, len(self.context), self.num_generated,
                            self.num_steps, self.num_step_tokens, self.num_drafted,
                            self.num_accepted, self.finish_reason)


@dataclass(frozen=True)
class SessionStats:
    """One session's figures since it opened (:meth:`SpecDecoder.session_stats
    <agspec_gpu.decoder.SpecDecoder.session_stats>`): what speculation bought each request,
    which a server reports per request next to the decoder's cumulative ``stats``.

    Attributes:
        tenant, role: as opened.
        context_len: tokens of its context (prompt, appended and generated).
        num_generated: tokens it generated (every ``generate``, ``step`` and ``commit``;
            a request's first token comes from its prefill, the rest from verification
            steps).
        num_steps: verification steps it was in (one target forward each, shared with the
            batch).
        num_step_tokens: tokens those steps emitted for it (accepted draft tokens and the
            bonus, cut where a request ended).
        num_drafted: draft tokens verified for it (0 for a request that opted out).
        num_accepted: of those, the ones the target accepted (also past where a request
            ended inside an accepted draft, at EOS, a stop string or its length: a measure
            of the drafts, which ``num_step_tokens`` is not; the step's
            :class:`~agspec_gpu.accept.AcceptResult` is cut to the output).
        finish_reason: why its last request ended: ``"eos"``, ``"stop"``, ``"length"`` (as
            :class:`StepOutput`'s), ``"cancelled"`` (``cancel``, an ``on_tokens`` that
            returned False) or ``"error"`` (the step or ``generate`` call it was in
            raised); None: no request yet, or one queued or running. In an own loop
            (:meth:`~agspec_gpu.decoder.SpecDecoder.commit`) it keeps the last commit's
            reason, across an :meth:`~agspec_gpu.decoder.SpecDecoder.append`, until the
            next commit.
    """

    tenant: str
    role: str
    context_len: int
    num_generated: int
    num_steps: int
    num_step_tokens: int
    num_drafted: int
    num_accepted: int
    finish_reason: str | None

    @property
    def tokens_per_step(self) -> float:
        """Tokens per verification step (tau; 1.0 is plain decoding; 0.0 before a step)."""
        return self.num_step_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0.0 before a draft)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass
class Requests:
    """Requests in the order of their runner rows; :meth:`select` and :meth:`extend` keep
    every list in step. ``states`` are their sessions' records, which take each request's
    finish reason when it ends."""

    sids: list[str]
    states: list[SessionState]
    limits: list[int]                       # max new tokens of each request
    params: list[SamplingParams | None]     # None: greedy
    stop: list[StopMatcher]
    eos: list[int | None]
    spec: list[bool]                        # False: opted out of speculation
    outs: list[list[int]]                   # what each request emitted (the caller's lists)
    # why each ended: "eos", "stop" (a stop string), "length" (its limit), "cancelled"
    # (cancel(), an on_tokens callback that returned False) or "error" (a failed step or
    # call ended it); None: running
    finish: list[str | None]
    rids: list[int]                         # each request's id (StepOutput.request_id)

    @property
    def done(self) -> tuple[bool, ...]:
        """Whether each request ended (read-only: :meth:`start`, :meth:`emit`,
        :meth:`cancel` and :meth:`fail` end requests)."""
        return tuple(f is not None for f in self.finish)

    @classmethod
    def build(cls, sids: list[str], states: list[SessionState], max_new_tokens, sampling, stop,
              speculate, eos: int | None, vocab_size: int, tokenizer: StopTokenizer,
              first_id: int = 0, max_context: int | None = None) -> "Requests":
        """The requests of ``sids`` from a call's per-session arguments (as ``generate``
        takes them), validated (nothing changes on an error); their outputs are new lists.
        ``eos``: the end token of every request (None: none); ``tokenizer``: whose decoder
        reads the stop strings (:meth:`~agspec_gpu.stops.StopMatcher.for_tokenizer`); the
        requests' ids are ``first_id``, ``first_id + 1``, ...; ``max_context``: the most
        tokens a session's context may hold (the decoder's ``max_model_len``; None: no
        limit): a request's limit is at most the room its context has left, and it ends at
        ``"length"`` when that is full."""
        n = len(sids)
        limits = per_session(max_new_tokens, n, "max_new_tokens", Integral)
        if any(isinstance(m, bool) or m < 0 for m in limits):
            raise ValueError(f"max_new_tokens: expected ints >= 0, got {max_new_tokens!r}")
        spec = per_session(speculate, n, "speculate", bool)
        params = per_session(sampling, n, "sampling", (SamplingParams, type(None)))
        if eos is not None and (not is_int(eos) or
                                not 0 <= eos < vocab_size):
            raise ValueError(f"eos_id: expected None or an int in the vocabulary [0, "
                             f"{vocab_size}), got {eos!r}")
        stops = stop_lists(stop, n)
        limits = [int(m) for m in limits]
        if max_context is not None:
            limits = [max(0, min(m, max_context - len(st.context)))
                      for m, st in zip(limits, states)]
        return cls(list(sids), list(states), limits, list(params),
                   [StopMatcher.for_tokenizer(tokenizer, s) for s in stops], [eos] * n,
                   list(spec),
                   [[] for _ in sids], [None] * n, list(range(first_id, first_id + n)))

    def start(self) -> None:
        """The requests begin (their sessions' last finish reasons are cleared); one of no
        tokens (a limit of 0) ends at once, at its ``"length"``."""
        for b, st in enumerate(self.states):
            st.finish_reason = None
            if self.limits[b] == 0:
                self._end(b, "length")

    def cancel(self, row: int) -> None:
        """Ends request ``row`` at what it emitted (its caller's doing), unless it ended."""
        if self.finish[row] is None:
            self._end(row, "cancelled")

    def fail(self) -> None:
        """Ends every request still running at what it emitted: an error ended their step
        (or their call). A row that ended in a batch of its own (:meth:`rows`) keeps its
        reason: its session's record holds it."""
        for row, f in enumerate(self.finish):
            if f is None:
                self._end(row, self.states[row].finish_reason or "error")

    def _end(self, row: int, reason: str) -> None:
        self.finish[row] = reason
        self.states[row].finish_reason = reason

    def rows(self) -> list["Requests"]:
        """One :class:`Requests` per row, sharing this one's records (its output lists,
        sessions and stop matchers): each joins a batch on its own."""
        return [self.row(b) for b in range(len(self.sids))]

    def row(self, b: int) -> "Requests":
        """Row ``b`` alone, sharing this one's records (:meth:`rows`)."""
        return Requests(*([getattr(self, f.name)[b]] for f in fields(self)))

    def select(self, rows: list[int]) -> None:
        """Keeps rows ``rows``, in that order."""
        for f in fields(self):
            values = getattr(self, f.name)
            setattr(self, f.name, [values[r] for r in rows])

    def extend(self, other: "Requests") -> None:
        """Appends ``other``'s rows after these."""
        for f in fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))

    def remaining(self) -> list[int]:
        """Tokens each request may still emit."""
        return [m - len(o) for m, o in zip(self.limits, self.outs)]

    def emit(self, new: list[list[int]]) -> list[list[int]]:
        """Appends each request's new tokens to its output, ending at its EOS, a stop string
        (its matcher sees every token it takes) or its limit (then ``finish[b]`` says which:
        ``"eos"`` before ``"stop"`` before ``"length"`` when one token is several); returns
        what each request took of ``new[b]``. Every row must still be running. All or
        nothing: a stop string's decode that raises takes back the rows before it."""
        taken: list[list[int]] = [[] for _ in new]
        try:
            for b, toks in enumerate(new):
                take, out, eos = [], self.outs[b], self.eos[b]
                for t in toks:
                    take.append(t)
                    stopped = self.stop[b].push(t)  # the matcher sees every token taken
                    reason = "eos" if eos is not None and t == eos else "stop" if stopped \
                        else "length" if len(out) + len(take) >= self.limits[b] else None
                    if reason is not None:
                        self._end(b, reason)
                        break
                out.extend(take)
                taken[b] = take
        except BaseException:
            self.unemit(taken)  # (the failing row's tokens never joined its output)
            raise
        return taken

    def unemit(self, taken: list[list[int]]) -> None:
        """Takes back what :meth:`emit` returned (``taken``): a step whose tokens no
        session took (it failed before its drafter commit settled). Each output loses
        them; a request the step ended runs again (its finish reason cleared: the step
        never happened), so :meth:`fail` ends it at ``"error"``."""
        for b, toks in enumerate(taken):
            if toks:  # (a row emit ended had been running: emit takes running rows only)
                del self.outs[b][len(self.outs[b]) - len(toks):]
                self.finish[b] = self.states[b].finish_reason = None

    def advance(self, new: list[list[int]],
                on_tokens: Callable[[str, list[int]], bool | None] | None = None) -> None:
        """Extends each session's context by the tokens its drafter tier just took (the two
        never disagree, even when the call fails later), then streams them to
        ``on_tokens``; a callback that returns False ends its request (:meth:`cancel`). A
        callback that raises (a ``KeyboardInterrupt`` too) does not keep the others from
        their tokens (each joined its context): the first error is raised once every
        session had its call."""
        for st, toks in zip(self.states, new):
            st.extend(toks)
        if on_tokens is None:
            return
        error = None
        for b, (sid, toks) in enumerate(zip(self.sids, new)):
            try:
                if toks and _ends_request(sid, on_tokens(sid, toks)):
                    self.cancel(b)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                error = error or exc
        if error is not None:
            raise error


def _ends_request(sid: str, returned) -> bool:
    """What an ``on_tokens`` return says: None or True go on, False (numpy's too) ends the
    request. Anything else raises: a count of 0 (a ``write`` of an empty chunk, say) must
    not end a stream, nor a count end none."""
    if returned is None or isinstance(returned, (bool, np.bool_)):
        return returned is not None and not returned
    raise TypeError(f"on_tokens: returned {type(returned).__name__} {returned!r} for session "
                    f"{sid!r}; return None or True to go on, False to end its request")


@dataclass(frozen=True)
class StepOutput:
    """What one request did in one :meth:`~agspec_gpu.decoder.SpecDecoder.step`.

    Attributes:
        session_id: the request's session.
        token_ids: the tokens it emitted in the step (in order; the last one may be EOS or
            complete a stop string).
        finished: it ended in this step (EOS, a stop string or a limit); it has left
            the batch when ``step`` returns, its KV kept.
        finish_reason: why it ended (None while it runs): ``"eos"`` (the last token is its
            end token), ``"stop"`` (the tokens end with one of its stop strings) or
            ``"length"`` (it emitted ``max_new_tokens``, or its context holds the decoder's
            ``max_model_len`` tokens); a server's ``finish_reason``
            (OpenAI's ``"stop"`` is ``"eos"`` or ``"stop"`` here). ``"error"``: an error
            ended it, raised by the call that met it (a failed step, or another thread's
            ``cancel`` of a request in its batch whose leaving failed); its ``token_ids``
            may be empty then.
        request_id: the id :meth:`~agspec_gpu.decoder.SpecDecoder.submit` returned for the
            request (unique in its decoder): a loop that hands outputs on after another
            thread cancelled the session's request and submitted a new one tells the old
            request's tokens from the new one's.
    """

    session_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    request_id: int = -1


def stop_lists(stop, n: int) -> list[list[str]]:
    """``stop`` as one list of stop strings per session: a string, strings for every
    session, or one list (or tuple) of strings per session; None: none."""
    if stop is None:
        return [[] for _ in range(n)]
    given = stop
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (bytes, bytearray, Mapping)):
        raise ValueError(f"stop: expected a string or strings, got {given!r}")
    try:
        stop = list(stop)
    except TypeError:
        raise ValueError(f"stop: expected a string or strings, got {stop!r}") from None
    if stop and all(isinstance(x, (list, tuple)) for x in stop):
        if len(stop) != n:
            raise ValueError(f"stop: {len(stop)} lists of stop strings for {n} sessions")
        lists = [list(x) for x in stop]
    else:
        lists = [stop] * n
    if not all(isinstance(x, str) and x for xs in lists for x in xs):
        raise ValueError(f"stop: expected non-empty strings, got {given!r}")
    for x in {x for xs in lists for x in xs}:
        check_text(x, "stop")
    return lists


def per_session(value, n: int, name: str, kind) -> list:
    """``value`` for every session, or one per session (checked: ``n`` of type ``kind``)."""
    if isinstance(value, kind):
        return [value] * n
    kinds = kind if isinstance(kind, tuple) else (kind,)
    what = " or ".join("an int" if k is Integral else "None" if k is type(None) else
                       f"a {k.__name__}" for k in kinds)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name}: expected {what}, or a list of one per session, got "
                         f"{value!r}")
    try:
        values = list(value)
    except TypeError:  # an iterable that is not one (a 0-d tensor)
        raise ValueError(f"{name}: expected {what}, or a list of one per session, got "
                         f"{value!r}") from None
    if len(values) != n:
        raise ValueError(f"{name}: expected one per session ({n}), got {len(values)}")
    bad = [v for v in values if not isinstance(v, kind)]
    if bad:
        raise ValueError(f"{name}: expected {what} per session, got {bad[0]!r}")
    return values
