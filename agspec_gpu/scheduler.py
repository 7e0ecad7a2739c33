"""Continuous batching: submitted requests wait in order, join a running batch, leave it.

:class:`~agspec_gpu.decoder.SpecDecoder` validates a request (``submit``) and hands it here;
each ``step`` either admits waiting requests (one prefill forward that also gives every
running request a token) or runs one speculative step of the batch. Requests that end leave
the batch before ``step`` returns, their KV kept for their sessions' next call. The decoder
owns the sessions; this owns only the queue and the running batch.

Admission (``fits``), by default (``DecoderConfig.admission="reserve"``), reserves KV as
a token budget does (TGI's router, SGLang's conservative mode): a waiting request joins
only when the KV pool holds every running and joining request's context, its remaining
``max_new_tokens`` and a step's draft, idle sessions' kept KV counted as free; such a batch
never runs short of pages. ``"optimistic"`` (vLLM's way) counts the contexts and one step
only, so more requests run at once when most end well before their limits. Admission is in
order: the first request that does not fit waits, and those behind it wait too (no
starvation of a long prompt). One that does not fit even alone runs when nothing else does,
as far as the pool allows (a ``KVCacheFull`` then ends that request only).

Preemption: when the pool cannot give the running batch's next step its roots and one draft
node per request that may draft (idle sessions' KV freed first), the newest request leaves
the batch unfinished and waits again at the head of the queue, until the batch fits or one
request is left. Its KV stays in the pool as an idle session's, freed only if the pages are
needed (then it is recomputed when the request joins again: vLLM's preemption by
recompute); it resumes where it stopped, its output the same tokens (greedy, seeded), or the
same distribution.
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
        fits: ``(sids, contexts, max_new_tokens) -> bool``: whether the KV pool holds these
            requests (to their ends, or for a step: :meth:`SessionKVCache.fits
            <agspec_gpu.session_kv.SessionKVCache.fits>`).
    """

    def __init__(self, max_batch: int, new_batch: Callable[[Requests], RunningBatch],
                 advance: Callable[[Requests, list[list[int]]], None],
                 fits: Callable[[list[str], list[list[int]], list[int]], bool]) -> None:
        self.max_batch = max_batch
        self._new_batch, self._advance, self._fits = new_batch, advance, fits
        self._queue: list[Requests] = []  # one session's request each, in submission order
        self._live: RunningBatch | None = None
        self.num_preemptions = 0  # requests that left the running batch to wait again
        # what a step that raised had emitted into its sessions' contexts: the next step
        # returns it first (a server that goes on after an error streams every token)
        self._undelivered: list[StepOutput] = []

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
        queued stay queued. What the failed step had emitted into its sessions' contexts
        (tokens a session tier took before a level build raised, or a step whose requests
        failed to leave) is passed to ``advance`` (so ``on_tokens`` has every token) and
        returned first by the next step, each output finished with its request's reason."""
        undelivered = list(self._undelivered)  # (cleared once this step returns)
        live = self._live
        joining = self._admitted(live)
        if not joining and live is None:
            self._undelivered = []
            return undelivered
        out: list[StepOutput] | None = None
        try:
            if joining:
                del self._queue[:len(joining)]
                live = self._live = self._join(live, joining)
                new = live.prefill(generator)
            else:
                self._preempt(live)
                new = live.verify_step(generator)
            self._advance(live.reqs, new)
            r = live.reqs
            out = [StepOutput(s, t, f is not None, f, i)
                   for s, t, f, i in zip(r.sids, new, r.finish, r.rids)]
            self._leave_finished()  # their sessions are idle once step() returns
        except BaseException as exc:
            if live is not None and live.unreported is not None:
                out = self._report(live, exc)
            for q in joining:  # out of the queue: they end here, joined or not (a join
                q.fail()       # that failed handing the old batch over left them outside)
            if self._live is not None:
                self._end_live_after(exc)
            elif live is not None:  # the new batch was never made
                live.reqs.fail()
            if out is not None:
                reason = dict(zip(live.reqs.sids, live.reqs.finish))
                self._undelivered += [StepOutput(o.session_id, o.token_ids, True,
                                                 reason.get(o.session_id) or "error",
                                                 o.request_id)
                                      for o in out if o.token_ids]
            raise
        self._undelivered = []
        return undelivered + out

    def _report(self, live: RunningBatch, exc: BaseException) -> list[StepOutput]:
        """The tokens ``live``'s failed step emitted that its session tiers took anyway:
        advanced (contexts, ``on_tokens``) and returned as the step's outputs; an error of
        the advance is noted on ``exc``."""
        new, live.unreported = live.unreported, None
        try:
            self._advance(live.reqs, new)
        except BaseException as cleanup:  # noqa: BLE001 - noted on the error that matters
            exc.add_note(f"then reporting the step's tokens failed too: {cleanup!r}")
        return [StepOutput(s, t, True, None, i)
                for s, t, i in zip(live.reqs.sids, new, live.reqs.rids)]

    def cancel(self, sid: str, rid: int | None = None) -> None:
        """Ends ``sid``'s request now (queued: dropped; running: leaves the batch, its KV
        and what it emitted kept; a failed step's undelivered output: dropped, its client
        gone); a no-op when it has none, or (``rid`` given) when its request is another."""
        def mine(s: str, r: int) -> bool:
            return s == sid and (rid is None or r == rid)

        self.discard([sid], rid)
        for q in self._queue:
            if mine(q.sids[0], q.rids[0]):
                q.cancel(0)
        self._queue = [q for q in self._queue if not mine(q.sids[0], q.rids[0])]
        live = self._live
        row = live.reqs.sids.index(sid) if live is not None and sid in live.reqs.sids else -1
        if row >= 0 and mine(sid, live.reqs.rids[row]):
            live.reqs.cancel(row)
            try:
                self._leave_finished()
            except BaseException as exc:  # its leaving failed: as a step's error, the batch
                if self._live is not None:  # ends (no request of it runs on, and none
                    ended = self._live.reqs  # ended emits again); the error reaches the
                    self._end_live_after(exc)  # caller, the others' ends the loop: the
                    self._undelivered += [     # next step returns them, as a failed one's
                        StepOutput(s, [], True, f or "error", i)
                        for s, f, i in zip(ended.sids, ended.finish, ended.rids) if s != sid]
                raise

    def discard(self, sids: list[str], rid: int | None = None) -> None:
        """Drops what a failed step had not yet returned of ``sids`` (of request ``rid``
        only, if given): their sessions moved on (a new request, an append, a close), and
        an output of the ended request would read as the new one's."""
        gone = set(sids)
        self._undelivered = [o for o in self._undelivered if o.session_id not in gone or
                             (rid is not None and o.request_id != rid)]

    def end_after(self, exc: BaseException) -> None:
        """Ends what the scheduler holds after ``exc`` (raised by the caller, outside a
        step's own handling: a ``generate`` call's loop interrupted between steps, or a
        step's admission check that raised): the running batch as a failed step ends it
        (its sessions' KV kept, their in-use marks cleared), the queued requests
        failed."""
        for q in self._queue:
            q.fail()
        self._queue = []
        if self._live is not None:
            self._end_live_after(exc)

    def _end_live_after(self, exc: BaseException) -> None:
        """Ends the running batch after ``exc`` (raised by the caller): its requests end at
        what they emitted, their KV kept as far as the batch still can."""
        live, self._live = self._live, None
        live.reqs.fail()
        live.end_after(exc)

    def _admitted(self, live: RunningBatch | None) -> list[Requests]:
        """The waiting requests that join now: in order, while the batch has room and the
        KV pool holds them to their ends beside the running ones; the first request alone
        when nothing runs (it runs as far as the pool allows)."""
        room = self.max_batch - (0 if live is None else len(live.reqs.sids))
        if not self._queue or room == 0:  # a step with nobody to admit reads no contexts
            return []
        sids, contexts, limits = [], [], []
        if live is not None:
            r = live.reqs
            sids, contexts, limits = list(r.sids), [st.context for st in r.states], \
                r.remaining()
        take = 0
        for q in self._queue[:room]:
            sids, contexts, limits = sids + q.sids, contexts + [q.states[0].context], \
                limits + q.remaining()
            if not self._fits(sids, contexts, limits):
                break
            take += 1
        if take == 0 and live is None:
            take = min(len(self._queue), 1)
        return self._queue[:take]

    def _preempt(self, live: RunningBatch) -> None:
        """While the running batch's next step does not fit the KV pool and more than one
        request runs, its newest request goes back to the head of the queue (the newest
        first out, so they rejoin in their order)."""
        while len(live.reqs.sids) > 1 and not live.step_fits():
            self._queue.insert(0, live.preempt())
            self.num_preemptions += 1

    def _leave_finished(self) -> None:
        """The running batch's finished requests leave it (their KV kept); the batch ends
        when none is left."""
        live = self._live
        if live is None or not any(live.reqs.done):
            return
        if all(live.reqs.done):
            self._live = None  # first: an end that raises leaves no ended batch running
            try:
                live.end()
            except BaseException as exc:  # (interrupted) ended again, past its error: its
                live.end_after(exc)       # sessions' KV kept, none left marked in use
                raise
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
