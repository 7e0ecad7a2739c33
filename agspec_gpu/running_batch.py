"""One running batch of generation requests: its prefill, its speculative steps, leaving.

:class:`~agspec_gpu.decoder.SpecDecoder` runs one :class:`RunningBatch` per ``generate`` call
and one for the requests of ``submit`` / ``step`` (rebuilt when requests join). Row ``b`` of
the runner (``HFRunner`` or ``PagedBatch``) holds request ``b``'s KV; each step is

    propose (drafter) -> verify (one forward over every root and tree) -> accept -> commit

(the drafter's commit and the next step's propose queued before the host reads the step)
with two host reads: the draft sizes (which pick the verification width) and the accepted
tokens (which the host needs for EOS, stop strings and streaming). A finished request leaves
before the next step, its KV kept for its session's next call.
"""

from __future__ import annotations

from typing import Callable

import nvtx
import torch

from agspec_gpu.accept import (AcceptBuffers, BatchSampling, accept_tree,
                               rows_without_finite_max, sample_tokens)
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.drafter import Drafter
from agspec_gpu.host import HostReader, to_device
from agspec_gpu.requests import Requests
from agspec_gpu.runners.hf import HFRunner
from agspec_gpu.runners.paged_batch import PagedBatch
from agspec_gpu.session_kv import SessionKVCache

# (session ids, tokens each session took, num_output and the verified draft sizes on the
# host): settles the step's deferred drafter commit, counts the step
RecordFn = Callable[[list, list, list, list], None]


class RunningBatch:
    """Requests ``reqs`` running on ``runner``.

    Args:
        reqs: the requests, row ``b`` = runner row ``b`` (shrinks as requests leave).
        runner: a fresh ``HFRunner`` or ``PagedBatch``; :meth:`prefill` starts it.
        drafter: proposes the trees and takes the emitted tokens.
        kv: the sessions' kept KV (prefill continues it; leaving and :meth:`end` keep it).
        sampling_rows: ``params -> BatchSampling`` (the decoder's cached device rows).
        record: settles a step's drafter commit (queued before the host read the step) with
            the tokens each request took, and counts them in the decoder's counters.
        reader: the host reads of a step (the decoder's, sized for its largest batch).
    """

    def __init__(self, reqs: Requests, runner: HFRunner | PagedBatch, drafter: Drafter,
                 kv: SessionKVCache, sampling_rows: Callable[[list], BatchSampling],
                 record: RecordFn, reader: HostReader) -> None:
        self.reqs, self.runner, self.drafter, self.kv = reqs, runner, drafter, kv
        self._sampling_rows, self._record, self.reader = sampling_rows, record, reader
        self.device = drafter.state.recent.device
        # greedy acceptance's outputs, the batch's own (its requests only leave): a step's
        # result lives there until the next step's, and the root a step leaves is a view
        # of them (read by the next verification before its acceptance writes them); a
        # batch of another call, suspended or not, never writes them
        self.accept_out = AcceptBuffers(len(reqs.sids), drafter.config.max_nodes, self.device)
        self.root: torch.Tensor | None = None       # int32 [B]: last emitted token, not cached
        # int64 [B]: each request's next sequence position (its root's + 1), where a
        # seeded request's next draw is keyed; kept only when the batch has one
        self.next_pos: torch.Tensor | None = None
        self.sampling: BatchSampling | None = None
        self.caps: torch.Tensor | None = None       # int32 [B] draft caps (opt-outs)
        self.no_draft: DraftBatch | None = None     # B trees of one padding node (all opted out)
        # after a step raised: what each request emitted that its session tier took anyway
        # (a level build failing after the corpora grew); the scheduler reports it (the
        # contexts take it, ``on_tokens`` streams it) before it raises
        self.unreported: list[list[int]] | None = None

    def prefill(self, generator: torch.Generator | None) -> list[list[int]]:
        """Starts the runner on the requests' contexts (after each session's kept KV), picks
        each request's next token from the last logits and emits it: a new request's first
        token; for a request that was running, one plain decoding step."""
        reqs = self.reqs
        logits = self.kv.prefill(self.runner, reqs.sids, [st.context for st in reqs.states],
                                 reqs.remaining())
        self.sampling = self._sampling_rows(reqs.params)
        self.caps = self.no_draft = None
        pos = None
        if self.sampling.any_seeded:
            pos = to_device([len(st.context) for st in reqs.states], torch.int64, self.device)
        first = sample_tokens(logits, self.sampling, generator, pos)
        self.next_pos = None if pos is None else pos + 1
        self.root = first.to(torch.int32)
        if self.sampling.all_greedy:
            first_ids = self.reader.read(self.root)[0]
        else:  # (a sampled request's model fault, read with the tokens: check_model_rows)
            faulty = ~torch.isfinite(logits.amax(-1)) & (self.sampling.temperature > 0)
            first_ids, faulty = self.reader.read(self.root, faulty)
            check_model_rows(reqs.sids, faulty)
        new = reqs.emit([[t] for t in first_ids])
        counts = list(map(len, new))  # the model's own tokens: nothing to validate or read
        before = self.drafter.store.session_lengths(reqs.sids)
        try:
            self.drafter.append_generated(reqs.sids, self.root[:, None],
                                          to_device(counts, torch.int32, self.device),
                                          counts, validate=False)
        except BaseException:
            self._failed_after_emit(new, self.drafter.store.took(reqs.sids, before, counts))
            raise
        return new

    def verify_step(self, generator: torch.Generator | None) -> list[list[int]]:
        """One speculative step (the finished requests leave first); the tokens each
        request emitted."""
        reqs, runner = self.reqs, self.runner
        if any(reqs.done):
            self.leave()
        cut = False  # the loop verifies fewer nodes than the drafter proposed
        # a step emits at most its accepted depth and the bonus token: no request drafts
        # past what it may still emit (its max_new_tokens, its context's room under
        # max_model_len: no node at a position the model has not)
        remaining = reqs.remaining()
        if any(reqs.spec):
            with nvtx.annotate("agspec.propose"):
                # verified and committed before the next propose: no clones
                draft = self.drafter.propose(reqs.sids, stable=False,
                                             max_depths=[r - 1 for r in remaining])
            if not all(reqs.spec):
                if self.caps is None:  # per request: max_nodes, or 0 (opted out)
                    self.caps = to_device([draft.max_nodes if s else 0 for s in reqs.spec],
                                          torch.int32, self.device)
                draft, cut = draft.capped(self.caps), True
            # host read 1 of 2 (the drafter's tokens come from the store's corpora, which
            # hold ids of the model's vocabulary only: no check of the ids here)
            (num_draft,) = self.reader.read(draft.num_draft_tokens)
        else:  # every request opted out: a plain decoding step, the drafter is not asked
            # (it still takes the emitted tokens), and its draft sizes are known here
            if self.no_draft is None:
                self.no_draft = DraftBatch.from_lists([[]] * len(reqs.sids), self.device)
            draft, num_draft = self.no_draft, [0] * len(reqs.sids)
        # The HF forward's cost grows with the padded width: verify the widest tree's
        # nodes, not the drafter's static max_nodes
        width = max(max(num_draft), 1)
        if isinstance(runner, PagedBatch):
            # the batch's growth comes before idle sessions' kept KV (as at its prefill):
            # a request that left, or a session between its calls, gives its pages up
            # before a draft is cut or the step raises
            width, num_draft, fitted = runner.fit_draft(width, num_draft, draft,
                                                        self.kv.free_idle)
            cut, draft = cut or fitted is not draft, fitted
        draft = draft.narrowed(width)
        with nvtx.annotate("agspec.verify"):
            # the paged runner's flat rows (no [B, 1 + N, V] copy), the hf runner's padded
            logits, qo_indptr = runner.verify_rows(draft, self.root, num_draft_host=num_draft)
            res = accept_tree(draft, logits, self.sampling, generator, qo_indptr,
                              out=self.accept_out, positions=self.next_pos)
            # a sampled request's model fault in the rows that chose its tokens, read with
            # them (a reduction over the logits; a greedy request takes a NaN's column, as
            # plain greedy decoding does)
            faulty = None if self.sampling.all_greedy else \
                rows_without_finite_max(draft, logits, qo_indptr, res.accepted_nodes) & \
                (self.sampling.temperature > 0)
        with nvtx.annotate("agspec.commit"):
            # host read 2 of 2, its copy queued; the KV commit and the drafter's commit need
            # no host value: queued behind it, they run while the host waits (the drafter's
            # host time too) and then emits the tokens. The drafter commits the nodes that
            # were verified, not all it proposed
            self.reader.start(res.num_output, res.output_ids,
                              *(() if faulty is None else (faulty,)))
            runner.commit_kv(res)
            self.root = res.bonus_ids().to(torch.int32)
            if self.next_pos is not None:
                self.next_pos += res.num_output
            new = None
            try:
                self.drafter.observe(reqs.sids, res.output_ids, res.num_output,
                                     res.num_accepted, validate=False,
                                     path_nodes=res.accepted_nodes,
                                     num_verified=draft.num_draft_tokens if cut else None,
                                     defer=True)
                # the next step's draft, when no request can reach its limit in this one
                # (at most its draft's nodes and the bonus), under the bounds a step that
                # accepts whole drafts leaves (no step tightens them): the next propose
                # takes it if the step ended none (EOS, a stop string) and built no index
                # level. (In the try: if it raises, the queued commit is taken back as
                # below)
                if any(reqs.spec) and all(r > n + 1 for r, n in zip(remaining, num_draft)):
                    self.drafter.propose_ahead(
                        reqs.sids, max_depths=[r - n - 2 for r, n in zip(remaining, num_draft)])
                n_out, rows, *faulty = self.reader.wait()
                if faulty:  # (raised: the step did not happen)
                    check_model_rows(reqs.sids, faulty[0])
                runner.commit_lengths([n - 1 for n in n_out])
                new = reqs.emit([r[:n] for r, n in zip(rows, n_out)])
                # the session tier gets what the session emitted: nothing past EOS, a stop
                # string or the limit
                self._record(reqs.sids, list(map(len, new)), n_out, num_draft)
            except BaseException as exc:
                # (with new: the step's settle ran; none pending then: the corpora took it)
                took = not self.drafter.commit_pending
                if not took:  # the sessions took nothing of the step: nor their tiers
                    try:
                        self.drafter.withdraw()
                    except Exception as cleanup:  # noqa: BLE001 - noted on the error
                        exc.add_note(f"then settling the drafter's commit failed too: "
                                     f"{cleanup!r}")
                if new is not None:  # (an observe that raised queued nothing)
                    self._failed_after_emit(new, [took] * len(new))
                raise
        return new

    def _failed_after_emit(self, new: list[list[int]], took: list[bool]) -> None:
        """After a step raised once it emitted ``new``: a request whose session tier took
        its tokens anyway (a level build failing after the corpora grew; the KV has them)
        keeps them, to be reported (:attr:`unreported`); the others' are taken back (the
        step did not happen for them: their outputs and finish reasons as before it)."""
        self.unreported = [t if k else [] for t, k in zip(new, took)]
        self.reqs.unemit([[] if k else t for t, k in zip(new, took)])

    def leave(self) -> None:
        """Takes the finished requests out of the batch and the runner (keeping their KV)."""
        self._drop([r for r, d in enumerate(self.reqs.done) if d])

    def step_fits(self) -> bool:
        """Whether the next step can verify each request's root and, for one that may
        draft (it speculates and may emit two tokens or more), one draft node (``paged``:
        after freeing idle sessions' KV as far as it needs); always for ``hf``. Host
        arithmetic, O(1) while the pool has a few pages free per request."""
        if not isinstance(self.runner, PagedBatch):
            return True
        cache = self.runner.runner.kv_cache
        # each request holds pages for its cached prefix: two more slots add at most
        # ceil(2 / page_size) pages to it (the common case needs no per-request sum)
        if cache.num_free_pages >= len(self.reqs.sids) * -(-2 // cache.page_size):
            return True
        drafts = [int(s and r > 1) for s, r in zip(self.reqs.spec, self.reqs.remaining())]
        return self.runner.fit_width(1, self.kv.free_idle, drafts) == 1

    def preempt(self) -> Requests:
        """Takes the newest request (the last row) out of the batch unfinished and returns
        it, to wait again: its KV is kept as an idle session's (freed only if the pool
        needs the pages; else its next prefill continues it)."""
        last = len(self.reqs.sids) - 1
        row = self.reqs.row(last)
        try:
            self._drop([last])
        except BaseException:  # neither waiting nor running: it ends with the error
            row.fail()
            raise
        return row

    def _drop(self, gone: list[int]) -> None:
        """Takes rows ``gone`` out of the batch and the runner, keeping their KV."""
        reqs = self.reqs
        stay = [r for r in range(len(reqs.sids)) if r not in gone]
        self.kv.keep(self.runner, [reqs.sids[r] for r in gone],
                     [reqs.states[r].context for r in gone], rows=gone)
        self.runner.select_rows(stay)
        reqs.select(stay)
        rows = to_device(stay, torch.int64, self.root.device)
        self.root = self.root[rows]
        if self.next_pos is not None:
            self.next_pos = self.next_pos[rows]
        self.sampling = self._sampling_rows(reqs.params)
        self.caps = self.no_draft = None

    def end(self, handover: bool = False) -> None:
        """Keeps the KV of every request still in the batch and frees the runner;
        ``handover``: a new batch of these requests prefills next (a join), so the ``hf``
        runner's KV is handed over as views, not copied twice."""
        reqs = self.reqs
        self.kv.keep(self.runner, reqs.sids, [st.context for st in reqs.states],
                     handover=handover)
        if isinstance(self.runner, PagedBatch):
            self.runner.close()

    def end_after(self, exc: BaseException) -> None:
        """Ends the batch after ``exc`` failed its call: an error of the ending (a runner
        left broken) is noted on ``exc``, which the caller re-raises, rather than replacing
        it. A proposal of the batch's that no step committed is dropped (it would hold
        off ``set_cost`` and calibration until these sessions run again)."""
        self.drafter.forget(self.reqs.sids)
        try:
            self.end()
        except Exception as cleanup:  # noqa: BLE001 - noted on the error that matters
            exc.add_note(f"then ending the running batch failed too: {cleanup!r}")


def check_model_rows(sids: list[str], faulty: list[int]) -> None:
    """Raises RuntimeError naming the sampled sessions whose logits rows that chose their
    tokens (the root's, the accepted nodes') hold a NaN or +inf, or only -inf (``faulty``,
    host flags per request): no distribution to sample, a model fault (a half-precision
    overflow, say), which sampling would turn into the last vocabulary id (Hugging Face's
    sampling raises too). Greedy requests are not checked: they take the NaN's column, as
    plain greedy decoding does, whatever shares their batch."""
    bad = [s for s, f in zip(sids, faulty) if f]
    if bad:
        raise RuntimeError(f"the model's logits for session(s) {bad} hold a NaN or +inf, or "
                           f"only -inf (no next token): a model fault; the step emitted "
                           f"nothing")
