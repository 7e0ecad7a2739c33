"""Each session's KV between ``generate`` calls: what a multi-turn agent does not prefill again.

An agent calls ``generate`` once per assistant message on its whole context so far. A session
that keeps its KV from one call to the next prefills only what was appended since (the tool
output and the last token; ``bench/prefill_tokens.py``: 40x fewer prompt tokens on the dev
sessions). :class:`SessionKVCache` holds that KV for :class:`~agspec_gpu.decoder.SpecDecoder`:

- ``runner="paged"``: the session's sequence in the runner's page pool (named by the session
  id) holds its first ``length`` context tokens; a call that needs pages frees idle sessions'
  KV first, least recently generated first.
- ``runner="hf"``: a :class:`~agspec_gpu.runners.hf.SessionKV` of tensors of its own; at most
  ``budget_tokens`` kept tokens over all sessions, least recently generated freed first.

Lifecycle per call: :meth:`SessionKVCache.prefill` (marks the batch used, makes room, prefills
each context after its kept KV), the call's steps, then :meth:`SessionKVCache.keep` (also
after a failure), and :meth:`SessionKVCache.drop` when the session closes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agspec_gpu.kv_cache import KVCacheFull
from agspec_gpu.runners.hf import HFRunner, SessionKV
from agspec_gpu.runners.paged import PagedLlamaRunner
from agspec_gpu.runners.paged_batch import PagedBatch


@dataclass
class _Kept:
    length: int = 0                  # context tokens whose KV is kept
    tensors: SessionKV | None = None  # runner="hf": those tokens' keys / values
    last_used: int = 0               # the call that last generated for the session
    in_use: bool = False             # a running batch holds it (prefilled, not yet kept)
    views: bool = False              # hf: ``tensors`` are views of a handed-over batch's
                                     # whole cache (a join), for the prefill that follows


class SessionKVCache:
    """The kept KV of a decoder's sessions.

    Args:
        paged: the decoder's paged runner (its pool holds the KV), or None for ``hf``.
        budget_tokens: ``hf``: the most tokens kept over all sessions.
        reserve_tokens: ``paged``: tokens a call may write per session beyond its context
            and ``max_new_tokens`` (the root and a draft tree).
        reserve_new_tokens: ``paged``: :meth:`fits` and a prefill's room hold each
            request's ``max_new_tokens`` too (``DecoderConfig.admission="reserve"``);
            False: its context and one step only (``"optimistic"``: the scheduler
            preempts when the batch outgrows the pool).
    """

    def __init__(self, paged: PagedLlamaRunner | None, budget_tokens: int,
                 reserve_tokens: int, reserve_new_tokens: bool = True) -> None:
        self.paged = paged
        self.budget_tokens = budget_tokens
        self.reserve_tokens = reserve_tokens
        self.reserve_new_tokens = reserve_new_tokens
        self._kept: dict[str, _Kept] = {}
        self._calls = 0  # the least-recently-generated clock
        self.num_prefills = 0        # cumulative: prefill forwards,
        self.num_prefill_tokens = 0  # and the context tokens they ran (past the kept KV)

    def kept_tokens(self, sid: str) -> int:
        """Context tokens of ``sid`` whose KV is kept (0: its next call prefills it all)."""
        k = self._kept.get(sid)
        return 0 if k is None else k.length

    def drop(self, sid: str) -> None:
        """Frees the session's KV (at close, or to make room). The record goes first: a
        free that fails leaves pages a later prefill of the session rewrites from its
        start, never a record of KV the pool no longer holds."""
        self._kept.pop(sid, None)
        if self.paged is not None and sid in self.paged.kv_cache:
            self.paged.kv_cache.free(sid)

    def prefill(self, runner: HFRunner | PagedBatch, sids: list[str],
                contexts: list[list[int]], max_new_tokens: list[int]) -> torch.Tensor:
        """Starts ``runner``'s batch on ``contexts``, each after its session's kept KV
        (``max_new_tokens``: what each request may still emit); returns ``[B, V]`` logits
        after each context."""
        self._calls += 1
        kept = [self._kept.setdefault(s, _Kept()) for s in sids]
        for k in kept:
            k.last_used = self._calls
            k.in_use = True
        if isinstance(runner, PagedBatch):
            self._make_room(sids, contexts, max_new_tokens)
        tokens = sum(len(c) - k.length for c, k in zip(contexts, kept))
        if isinstance(runner, PagedBatch):
            logits = runner.prefill(contexts, seq_ids=sids, cached=[k.length for k in kept])
        else:
            try:
                logits = runner.prefill(contexts, past=[k.tensors for k in kept])
            except BaseException:
                for k in kept:  # a handed-over cache must not stay alive whole (it may
                    if k.views:  # have failed for memory): these prefill anew next time
                        k.length, k.tensors, k.views = 0, None, False
                raise
            for k in kept:  # the batch's cache holds it now; keep() cuts it anew
                k.length, k.tensors, k.views = 0, None, False
        self.num_prefills += 1  # (counted once it ran: a failed forward is no prefill)
        self.num_prefill_tokens += tokens
        return logits

    def keep(self, runner: HFRunner | PagedBatch, sids: list[str],
             contexts: list[list[int]], rows: list[int] | None = None, *,
             handover: bool = False) -> None:
        """After a call (finished or failed), or when requests leave its batch (``rows``:
        their rows in ``runner``'s batch; default: every row, in order): each session's KV
        holds the prompt, then the emitted stream (and, past a request's end, what the model
        went on to produce while others ran), so it is a prefix of the context up to the
        shorter of the two; the last context token stays the next root. A call that failed
        before its batch had a committed prefix keeps the sessions' earlier KV: those slots
        are never rewritten. ``handover``: a :meth:`prefill` of these sessions follows at
        once and ``runner`` is done (a join): ``hf`` keeps views of its cache instead of
        copies, so their KV is copied once (into the next batch), not twice; if that
        prefill fails, the views are dropped (they would keep the whole cache alive). An
        ``hf`` copy that runs out of memory keeps nothing for its session (its next call
        prefills it)."""
        for sid in sids:  # no longer the batch's: evictable again
            self._kept[sid].in_use = False
        paged = isinstance(runner, PagedBatch)
        lens = runner.prefix_lens_host if paged else runner.seq_lens_host
        if rows is None:
            if len(lens) != len(sids):
                return
            rows = list(range(len(sids)))
        for b, sid, ctx in zip(rows, sids, contexts):
            k = self._kept[sid]
            k.length = min(lens[b], len(ctx) - 1)
            if not paged:
                # kept KV is a cache: with no memory for its copy, the session's next call
                # prefills it, and the step that emitted the tokens still returns them
                try:
                    k.tensors = runner.session_kv(b, k.length, copy=not handover) \
                        if k.length > 0 else None
                except torch.OutOfMemoryError:
                    k.length, k.tensors = 0, None
                k.views = handover and k.tensors is not None
        if not paged and not handover:  # (handed-over KV is the next batch's at once)
            held = sorted((k.last_used, -k.length, sid) for sid, k in self._kept.items()
                          if k.tensors is not None)
            total = sum(-neg for _, neg, _ in held)
            for _, neg, sid in held:  # the least recently generated go first
                if total <= self.budget_tokens:
                    break
                self.drop(sid)
                total += neg

    def fits(self, sids: list[str], contexts: list[list[int]], max_new_tokens: list[int]
             ) -> bool:
        """Whether the pool holds every one of ``sids`` grown to its context, its
        ``max_new_tokens`` (unless not ``reserve_new_tokens``) and the reserve, once idle
        sessions' KV is freed (those not in a running batch); always True for ``hf``. A
        scheduler's admission test: with ``reserve_new_tokens``, a batch that passes it
        never runs short of pages (unless other calls take them meanwhile)."""
        if self.paged is None:
            return True
        cache = self.paged.kv_cache
        return self._pages_to_grow(sids, contexts, max_new_tokens) <= \
            cache.num_free_pages + self._freeable(set(sids))

    def check_fits_alone(self, sids: list[str], contexts: list[list[int]],
                         max_new_tokens: list[int], beside_running: bool = False) -> None:
        """Raises :class:`KVCacheFull` naming ``kv_cache_tokens`` (and the session) when a
        request could not run even alone in an empty pool: its context and first step (the
        root and one node, the root alone for two tokens) need more pages than the pool, or
        a sequence, has; ``beside_running`` (a ``generate`` call, which runs while the
        running batches hold their pages): more than the pool has beside them. A call
        checks this before anything runs, so no other request of it emits first. A no-op
        for ``hf`` and for requests of limit 0."""
        if self.paged is None:
            return
        cache = self.paged.kv_cache
        ps, most = cache.page_size, min(cache.num_pages, cache.max_pages_per_seq)
        running = self._running_pages(set(sids)) if beside_running else 0
        for sid, ctx, m in zip(sids, contexts, max_new_tokens):
            need = -(-(len(ctx) + _first_step_tokens(m)) // ps)
            if m > 0 and need > most:
                raise KVCacheFull(
                    f"kv_cache_tokens: session {sid!r}'s context ({len(ctx)} tokens) and "
                    f"first step need {need} pages of {ps} tokens, more than the pool's "
                    f"{most} for one sequence even with every other session's KV freed; "
                    f"raise DecoderConfig.kv_cache_tokens or shorten its context")
            if m > 0 and need > cache.num_pages - running:
                raise KVCacheFull(
                    f"kv_cache_tokens: session {sid!r}'s context ({len(ctx)} tokens) and "
                    f"first step need {need} pages of {ps} tokens, more than the "
                    f"{cache.num_pages - running} the pool has beside the running requests' "
                    f"{running} (step() the submitted requests to their end first, or "
                    f"raise DecoderConfig.kv_cache_tokens)")

    def free_idle(self, num_pages: int, num_rows: int = 0) -> None:
        """Frees idle sessions' KV (not in a running batch), least recently generated
        first, until ``num_pages`` pages and ``num_rows`` sequence rows are free or no idle
        session holds any (a session's next call prefills its context again)."""
        cache = self.paged.kv_cache
        for _, sid in self._idle(set()):
            if cache.num_free_pages >= num_pages and cache.num_free_rows >= num_rows:
                break
            self.drop(sid)

    def _pages_to_grow(self, sids: list[str], contexts: list[list[int]],
                       max_new_tokens: list[int]) -> int:
        """Pages ``sids`` add to hold each context, its ``max_new_tokens`` (if
        ``reserve_new_tokens``) and the reserve (a sequence grows no further than
        ``max_pages_per_seq``)."""
        cache = self.paged.kv_cache
        most = cache.max_pages_per_seq * cache.page_size
        if not self.reserve_new_tokens:
            max_new_tokens = [0] * len(sids)
        return sum(cache.pages_needed(s, min(len(ctx) + m + self.reserve_tokens, most))
                   for s, ctx, m in zip(sids, contexts, max_new_tokens))

    def _running_pages(self, exclude: set[str]) -> int:
        """Pages held by sessions outside ``exclude`` in a running batch (``step``'s, a
        ``generate`` call's): not freeable while it runs."""
        cache = self.paged.kv_cache
        return sum(cache.capacity(sid) // cache.page_size for sid, k in self._kept.items()
                   if k.in_use and sid not in exclude)

    def _freeable(self, exclude: set[str]) -> int:
        """Pages held by idle sessions outside ``exclude``."""
        cache = self.paged.kv_cache
        return sum(cache.capacity(sid) // cache.page_size for _, sid in self._idle(exclude))

    def _idle(self, exclude: set[str]) -> list[tuple[int, str]]:
        """``(last_used, sid)`` of the sessions outside ``exclude`` whose KV is in the pool
        and in no running batch, least recently generated first."""
        cache = self.paged.kv_cache
        return sorted((k.last_used, sid) for sid, k in self._kept.items()
                      if sid not in exclude and sid in cache and not k.in_use)

    def _make_room(self, sids: list[str], contexts: list[list[int]],
                   max_new_tokens: list[int]) -> None:
        """Frees the KV of sessions outside ``sids``, least recently generated first, until
        the pool holds what this call may grow ``sids`` to (context + ``max_new_tokens``,
        if ``reserve_new_tokens``, + the reserve); a call that still does not fit runs (its
        drafts shrink to the pages left, then its newest requests are preempted, and a lone
        request that cannot get one more slot, its root, raises). Raises
        :class:`KVCacheFull` before freeing anything when not even the contexts and the
        first step fit."""
        cache = self.paged.kv_cache
        ps = cache.page_size
        need = self._pages_to_grow(sids, contexts, max_new_tokens)
        first_step = _first_step_tokens(max(max_new_tokens))
        least = sum(cache.pages_needed(s, len(ctx) + first_step)
                    for s, ctx in zip(sids, contexts))
        can_free = self._freeable(set(sids))
        if least > cache.num_free_pages + can_free:
            total = sum(-(-(len(ctx) + first_step) // ps) for ctx in contexts)
            running = self._running_pages(set(sids))
            raise KVCacheFull(
                f"kv_cache_tokens: {len(sids)} sessions' contexts and first step need {total} "
                f"pages of {ps} tokens ({total - least} already theirs, {least} more), the "
                f"pool has {cache.num_pages} ({cache.num_free_pages} free, {can_free} held by "
                f"idle sessions, {running} by running requests); raise DecoderConfig."
                f"kv_cache_tokens or generate for fewer sessions at a time")
        self.free_idle(need)


def _first_step_tokens(max_new_tokens: int) -> int:
    """KV slots a request's first verification needs beyond its context (the prefill
    emits the first token, the root): the root and one node; the root alone when it may
    emit two tokens (its one step drafts nothing); none for one token (no step)."""
    return min(max(max_new_tokens - 1, 0), 2)
