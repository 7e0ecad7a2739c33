"""The requests of a running generation batch, host side: limits, stop strings, outputs.

:class:`~agspec_gpu.decoder.SpecDecoder` keeps one :class:`Requests` per running batch (a
``generate`` call, or the batch that ``submit`` / ``step`` grow and shrink): row ``b`` is row
``b`` of the runner that holds the requests' KV. Everything here is host bookkeeping: what a
request emitted, whether it ended (EOS, a stop string, its limit, its caller), what of a
step's tokens it takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from numbers import Integral
from typing import Any

from agspec_gpu.accept import SamplingParams
from agspec_gpu.stops import StopMatcher


@dataclass
class Requests:
    """Requests in the order of their runner rows; :meth:`select` and :meth:`extend` keep
    every list in step. ``states`` are the decoder's per-session records (``context``)."""

    sids: list[str]
    states: list[Any]
    limits: list[int]                       # max new tokens of each request
    params: list[SamplingParams | None]     # None: greedy
    stop: list[StopMatcher]
    eos: list[int | None]
    spec: list[bool]                        # False: opted out of speculation
    outs: list[list[int]]                   # what each request emitted (the caller's lists)
    # why each ended: "eos", "stop" (a stop string), "length" (its limit) or "cancelled"
    # (cancel(), an on_tokens callback that returned False); None: running
    finish: list[str | None]

    @property
    def done(self) -> tuple[bool, ...]:
        """Whether each request ended (read-only: :meth:`cancel` or :meth:`emit` end one)."""
        return tuple(f is not None for f in self.finish)

    def cancel(self, row: int) -> None:
        """Ends request ``row`` at what it emitted (its caller's doing), unless it ended."""
        if self.finish[row] is None:
            self.finish[row] = "cancelled"

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
        what each request took of ``new[b]``. Every row must still be running."""
        taken: list[list[int]] = [[] for _ in new]
        for b, toks in enumerate(new):
            take, out, eos = taken[b], self.outs[b], self.eos[b]
            for t in toks:
                take.append(t)
                stopped = self.stop[b].push(t)  # the matcher sees every token taken
                reason = "eos" if eos is not None and t == eos else "stop" if stopped else \
                    "length" if len(out) + len(take) >= self.limits[b] else None
                if reason is not None:
                    self.finish[b] = reason
                    break
            out.extend(take)
        return taken


@dataclass(frozen=True)
class StepOutput:
    """What one request did in one :meth:`~agspec_gpu.decoder.SpecDecoder.step`.

    Attributes:
        session_id: the request's session.
        token_ids: the tokens it emitted in the step (in order; the last one may be EOS or
            complete a stop string).
        finished: it ended in this step (EOS, a stop string or its limit); it has left
            the batch when ``step`` returns, its KV kept.
        finish_reason: why it ended (None while it runs): ``"eos"`` (the last token is its
            end token), ``"stop"`` (the tokens end with one of its stop strings) or
            ``"length"`` (it emitted ``max_new_tokens``); a server's ``finish_reason``
            (OpenAI's ``"stop"`` is ``"eos"`` or ``"stop"`` here).
    """

    session_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


def stop_lists(stop, n: int) -> list[list[str]]:
    """``stop`` as one list of stop strings per session: a string, strings for every
    session, or one list (or tuple) of strings per session."""
    if isinstance(stop, str):
        stop = [stop]
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
        raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
    return lists


def per_session(value, n: int, name: str, kind) -> list:
    """``value`` for every session, or one per session (checked: ``n`` of type ``kind``)."""
    if isinstance(value, kind):
        return [value] * n
    kinds = kind if isinstance(kind, tuple) else (kind,)
    what = " or ".join("an int" if k is Integral else "None" if k is type(None) else
                       f"a {k.__name__}" for k in kinds)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
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
