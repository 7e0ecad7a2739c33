"""Continuous batching: submitted requests wait in order, join a running batch, leave it.

:class:`~agspec_gpu.decoder.SpecDecoder` validates a request (``submit``) and hands it here;
each ``step`` either admits waiting requests (one prefill forward that also gives every
running request a token) or runs one speculative step of the batch. Requests that end leave
the batch before ``step`` returns, their KV kept for their sessions' next call. The decoder
owns the sessions; this owns only the queue and the running batch.
"""

from __future__ import annotations

from typing import Callable

import torch

from agspec_gpu.requests import Requests, StepOutput
from agspec_gpu.running_batch import RunningBatch


class Scheduler:
    """The submitted requests of one decoder: a queue in submission order, one running batch.

    Args:
        max_batch: the most requests that run at once (the rest wait).
        new_batch: ``Requests -> RunningBatch`` on the decoder's runner, drafter and KV.
        advance: ``(reqs, new_tokens)``: the decoder extends the sessions' contexts by the
            tokens a step emitted (before the scheduler reads who is done).
    """

    def __init__(self, max_batch: int, new_batch: Callable[[Requests], RunningBatch],
                 advance: Callable[[Requests, list[list[int]]], None]) -> None:
        self.max_batch = max_batch
        self._new_batch, self._advance = new_batch, advance
        self._queue: list[Requests] = []  # one session's request each, in submission order
        self._live: RunningBatch | None = None

    @property
    def running(self) -> list[str]:
        """Sessions whose request is in the running batch, in its row order."""
        return [] if self._live is None else list(self._live.reqs.sids)

    @property
    def queued(self) -> list[str]:
        """Sessions whose request waits for room, in submission order."""
        return [q.sids[0] for q in self._queue]

    def submit(self, reqs: Requests) -> None:
        """Queues ``reqs`` (one validated request of an idle session)."""
        self._queue.append(reqs)

    def step(self, generator: torch.Generator | None) -> list[StepOutput]:
        """Admits waiting requests if the batch has room, else one speculative step; returns
        what each running request emitted. An error ends the step's requests (running and
        joining; their sessions in step at what they emitted) and is raised; requests still
        queued stay queued."""
        live = self._live
        room = self.max_batch - (0 if live is None else len(live.reqs.sids))
        joining = self._queue[:room]
        if not joining and live is None:
            return []
        try:
            if joining:
                del self._queue[:len(joining)]
                live = self._live = self._join(live, joining)
                new = live.prefill(generator)
            else:
                new = live.verify_step(generator)
            self._advance(live.reqs, new)
            r = live.reqs
            out = [StepOutput(s, t, f is not None, f) for s, t, f in zip(r.sids, new, r.finish)]
            self._leave_finished()  # their sessions are idle once step() returns
        except BaseException as exc:
            if self._live is not None:
                live, self._live = self._live, None
                live.end_after(exc)
            raise
        return out

    def cancel(self, sid: str) -> None:
        """Ends ``sid``'s request now (queued: dropped; running: leaves the batch, its KV
        and what it emitted kept); a no-op when it has none."""
        for q in self._queue:
            if q.sids[0] == sid:
                q.cancel(0)
        self._queue = [q for q in self._queue if q.sids[0] != sid]
        live = self._live
        if live is not None and sid in live.reqs.sids:
            live.reqs.cancel(live.reqs.sids.index(sid))
            self._leave_finished()

    def _leave_finished(self) -> None:
        """The running batch's finished requests leave it (their KV kept); the batch ends
        when none is left."""
        live = self._live
        if live is None or not any(live.reqs.done):
            return
        if all(live.reqs.done):
            live.end()
            self._live = None
        else:
            live.leave()

    def _join(self, live: RunningBatch | None, joining: list[Requests]) -> RunningBatch:
        """A new batch: the running requests (their KV kept, to be continued), then
        ``joining``'s."""
        reqs = joining[0] if live is None else live.reqs
        if live is not None:
            live.end(handover=True)
            self._live = None
            reqs.extend(joining[0])
        for q in joining[1:]:
            reqs.extend(q)
        return self._new_batch(reqs)
