"""A batch of requests on the paged runner, behind the interface :class:`HFRunner` offers.

:class:`agspec_gpu.decoder.SpecDecoder` drives a verifier through three calls: ``prefill``
(cache the prompts, return the first logits), ``verify_rows`` (one forward over every
request's root and draft tree, its logits in the runner's own layout: flat rows and their
``qo_indptr`` here, ``[B, 1 + N, V]`` there) and ``commit`` (keep the accepted
path's KV). :class:`PagedBatch` implements them on a :class:`PagedLlamaRunner` (paged KV,
tree attention through FlashInfer on a GPU, the torch backend elsewhere) so the same loop
runs on the fast runner.

KV layout per request: the committed tokens in slots ``[0, prefix_len)``; a step writes the
root at ``prefix_len`` and draft node ``j`` at ``prefix_len + 1 + j``; ``commit`` moves the
accepted nodes to consecutive slots with :func:`agspec_gpu.kernels.kv_compact.kv_compact`.

A batch owns its KV sequences and frees them in :meth:`PagedBatch.close`, unless the caller
names them (``prefill(..., seq_ids=...)``): such sequences outlive the batch, and a later
batch continues them from the tokens they already hold (``cached``), as ``SpecDecoder`` does
with a session's KV from one ``generate`` to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from agspec_gpu.accept import AcceptResult, pad_tree_logits
from agspec_gpu.checks import is_int
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import to_device
from agspec_gpu.kernels._launch import cast
from agspec_gpu.kernels.kv_compact import kv_compact
from agspec_gpu.kv_cache import KVCacheFull
from agspec_gpu.runners.common import check_lengths_settled, check_verify_call
from agspec_gpu.runners.paged import PagedLlamaRunner
from agspec_gpu.runners.verify_graphs import VerifyGraphs


class PagedBatch:
    """One batch of requests on ``runner``'s KV pool; :meth:`close` frees its pages.

    Example::

        batch = PagedBatch(runner)
        root = batch.prefill([[1, 2, 3], [4, 5]]).argmax(-1)
        logits, qo_indptr = batch.verify_rows(draft, root)      # [total_q, V], [B + 1]
        batch.commit(greedy_accept(draft, logits, qo_indptr))
        batch.close()
    """

    def __init__(self, runner: PagedLlamaRunner,
                 verify_graphs: VerifyGraphs | None = None) -> None:
        self.runner = runner
        self.verify_graphs = verify_graphs  # steps that fit its buckets replay its graphs
        self.device = runner.device
        # the batch's own sequence ids are (tag, row): unique while any of them lives
        # (they hold the tag), with no counter shared between batches
        self._tag = object()
        self._seq_ids: list = []
        self._owns_seqs = True  # close() frees the sequences (False: the caller's)
        self._prefix: torch.Tensor | None = None     # int32 [B] committed slots, on device
        self._prefix_host: list[int] = []
        # the last verify's prefix lengths (int32 [B]) and its plan's pages (kv_indptr,
        # kv_indices): the commit compacts KV within them
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._lengths_owed = False  # commit_kv() ran, commit_lengths() not yet

    @property
    def batch_size(self) -> int:
        return len(self._seq_ids)

    @property
    def prefix_lens_host(self) -> list[int]:
        """Committed KV slots per request: its prompt, then the root and accepted nodes of
        every committed step (the last bonus token is not among them: it is the next root)."""
        return list(self._prefix_host)

    @torch.no_grad()
    def prefill(self, input_ids: list[list[int]], *, seq_ids: list | None = None,
                cached: list[int] | None = None) -> torch.Tensor:
        """Caches every prompt (a new batch); ``[B, V]`` logits after each prompt.

        Parameters
        ----------
        input_ids : ``B`` non-empty token lists.
        seq_ids : the KV sequences to use, the caller's (kept by :meth:`close`); default:
            the batch's own (freed by :meth:`close`).
        cached : per request, how many leading tokens of ``input_ids[b]`` sequence
            ``seq_ids[b]`` already holds, in ``[0, len(input_ids[b]))``: only the rest is
            computed. Needs ``seq_ids``.
        """
        if not input_ids or any(len(p) == 0 for p in input_ids):
            raise ValueError("input_ids: expected a non-empty list of non-empty prompts")
        B = len(input_ids)
        if seq_ids is not None and len(seq_ids) != B:
            raise ValueError(f"seq_ids: {len(seq_ids)} ids for {B} prompts")
        cache = self.runner.kv_cache
        if cached is not None and (seq_ids is None or len(cached) != B or any(
                not 0 <= c < len(p) for c, p in zip(cached, input_ids))):
            raise ValueError("cached: needs seq_ids and one count in [0, len(prompt)) per "
                             "prompt")
        if cached is not None and any(c > cache.capacity(s) for c, s in zip(cached, seq_ids)):
            # (a sequence the pool does not hold, or holds shorter, would attend whatever
            # a freed page last held)
            raise ValueError(f"cached: more tokens than the pool holds for their sequences "
                             f"({list(cached)} against "
                             f"{[cache.capacity(s) for s in seq_ids]} slots)")
        self.close()
        self._owns_seqs = seq_ids is None
        self._seq_ids = [(self._tag, b) for b in range(B)] if seq_ids is None else list(seq_ids)
        cached = cached or [0] * B
        try:
            logits = self.runner.prefill(self._seq_ids,
                                         [p[c:] for p, c in zip(input_ids, cached)],
                                         prefix_lens=cached)
        except BaseException:  # (KVCacheFull, say): no batch, its own sequences freed
            self.close()
            raise
        self._prefix_host = [len(p) for p in input_ids]
        self._prefix = torch.tensor(self._prefix_host, dtype=torch.int32, device=self.device)
        return logits

    def select_rows(self, rows: list[int]) -> None:
        """Keeps requests ``rows`` (in that order) and drops the rest from the batch: a
        request that finished stops taking a row and pages at every step. A dropped
        sequence of the batch's own is freed; the caller's keep their KV."""
        if self._pending is not None:
            raise ValueError("select_rows() between verify() and commit()")
        check_lengths_settled(self._lengths_owed, "select_rows")
        if any(not is_int(r) or not 0 <= r < self.batch_size for r in rows) or \
                len(set(rows)) != len(rows):
            raise ValueError(f"rows: expected distinct rows in [0, {self.batch_size}), got "
                             f"{list(rows)}")
        # (the device copy first, what can fail: a copy out of memory had left the batch
        # with its dropped rows freed and the old device prefix)
        prefix = self._prefix[to_device(rows, torch.int64, self.device)]
        if self._owns_seqs:
            for b in sorted(set(range(self.batch_size)) - set(rows)):
                self.runner.kv_cache.free(self._seq_ids[b])
        self._seq_ids = [self._seq_ids[b] for b in rows]
        self._prefix_host = [self._prefix_host[b] for b in rows]
        self._prefix = prefix

    def pages_needed(self, width: int, num_draft: Sequence[int] | None = None) -> int:
        """Pages a step verifying ``width`` nodes per request adds to the batch's sequences:
        request ``b``'s KV grows to ``prefix + 1 + min(width, num_draft[b])`` slots (its
        root and the nodes it has; ``num_draft`` None: ``width`` each). Host arithmetic."""
        cache = self.runner.kv_cache
        if num_draft is None:
            num_draft = [width] * self.batch_size
        return sum(cache.pages_needed(s, p + 1 + min(width, n))
                   for s, p, n in zip(self._seq_ids, self._prefix_host, num_draft))

    def fit_width(self, width: int, make_room: Callable[[int], None] | None = None,
                  num_draft: Sequence[int] | None = None) -> int | None:
        """The most nodes per request, at most ``width``, that a step can verify with the
        pool's free pages (:meth:`pages_needed`: a request of ``num_draft[b]`` nodes writes
        no more); 0: the roots alone; None when not even they fit. ``make_room(pages)``,
        when ``width`` does not fit: the caller frees pages (idle KV) toward that many free
        first. Host arithmetic, no device read."""
        check_lengths_settled(self._lengths_owed, "fit_width")
        cache = self.runner.kv_cache
        need = self.pages_needed(width, num_draft)
        if need > cache.num_free_pages and make_room is not None:
            make_room(need)
        free = cache.num_free_pages

        def fits(w: int) -> bool:
            return self.pages_needed(w, num_draft) <= free

        if need <= free:  # the common case: one pass
            return width
        if not fits(0):
            return None
        lo, hi = 0, width  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def fit_draft(self, width: int, num_draft: list[int], draft: DraftBatch,
                  make_room: Callable[[int], None] | None = None
                  ) -> tuple[int, list[int], DraftBatch]:
        """``(width, num_draft, draft)`` cut to what the page pool holds now, after
        ``make_room`` (:meth:`fit_width`): at the last, no nodes, a plain decoding step (a
        shorter draft changes the speed, never the tokens); the width stays at least 1 (a
        padded tree of one column). Raises :class:`KVCacheFull` naming ``kv_cache_tokens``
        when not even the roots fit."""
        fit = self.fit_width(width, make_room, num_draft)
        if fit == width:
            return width, num_draft, draft
        if fit is None:
            cache = self.runner.kv_cache
            own = sum(cache.capacity(s) for s in self._seq_ids) // cache.page_size
            others = cache.num_pages - cache.num_free_pages - own
            raise KVCacheFull(
                f"kv_cache_tokens: the page pool ({cache.num_pages} pages of "
                f"{cache.page_size}, {cache.num_free_pages} free; {own} held by this "
                f"batch's {self.batch_size} sessions, {others} by other sessions: a batch "
                f"running beside it, or KV it could not free) cannot hold its next step; "
                f"raise DecoderConfig.kv_cache_tokens, or generate for fewer sessions or "
                f"fewer tokens at a time")
        return max(fit, 1), [min(n, fit) for n in num_draft], draft.capped(fit)

    @torch.no_grad()
    def verify_rows(self, draft: DraftBatch, root_ids: torch.Tensor,
                    num_draft_host: Sequence[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over each request's root and draft nodes, logits in the flat layout.

        Returns ``(logits [total_q, V], qo_indptr int32 [B + 1])``: row ``qo_indptr[b] + r``
        holds request ``b``'s root (``r = 0``) or node ``r - 1``; ``total_q = B + the draft's
        nodes``. ``num_draft_host``: ``draft.num_draft_tokens`` as host ints if the caller
        holds them (else read from the device): they pick the bucket and ``total_q``, and
        FlashInfer plans with them instead of reading the device. The logits are views of
        the step's buffers, valid until the next verify.
        """
        check_lengths_settled(self._lengths_owed, "verify")
        B, N = check_verify_call(draft, root_ids, batch_size=self.batch_size,
                                 has_batch=self._prefix is not None,
                                 pending=self._pending is not None)
        if num_draft_host is None:
            num_draft_host = draft.num_draft_tokens.tolist()
        elif len(num_draft_host) != B:
            raise ValueError(f"num_draft_host: {len(num_draft_host)} sizes for {B} requests")
        vg = self.verify_graphs
        if vg is not None and N <= vg.max_nodes and B <= vg.sizes[-1]:
            # the padded bucket (CUDA graph on a GPU); its first B requests are these
            meta, flat = vg.verify(self._seq_ids, draft, root_ids, self._prefix_host,
                                   num_draft_host)
        else:
            meta = self.runner.plan(self._seq_ids, draft, root_ids, self._prefix,
                                    prefix_lens_host=self._prefix_host,
                                    num_draft_host=num_draft_host)
            flat = self.runner.forward(meta)                           # [capacity_q, V]
        self._pending = (self._prefix, meta.kv_indptr, meta.kv_indices)
        return flat[:B + int(sum(num_draft_host))], meta.qo_indptr[:B + 1]

    def verify_padded(self, draft: DraftBatch, root_ids: torch.Tensor,
                      num_draft_host: Sequence[int] | None = None) -> torch.Tensor:
        """:meth:`verify_rows` gathered to ``[B, 1 + N, V]``
        (:func:`~agspec_gpu.accept.pad_tree_logits`): row 0 each request's root, row ``1 +
        j`` node ``j``; rows of padding nodes are unspecified. (A copy of every row:
        acceptance takes the flat layout directly.)"""
        flat, qo = self.verify_rows(draft, root_ids, num_draft_host)
        return pad_tree_logits(flat, qo, draft.max_nodes)

    @torch.no_grad()
    def commit(self, result: AcceptResult, num_accepted_host: list[int] | None = None) -> None:
        """Keeps the root and the accepted path of the last verify in each request's KV
        (``num_accepted_host``: ``result.num_accepted`` if the caller read it already):
        :meth:`commit_kv` then :meth:`commit_lengths`."""
        self.commit_kv(result)
        self.commit_lengths(num_accepted_host)

    def commit_kv(self, result: AcceptResult) -> None:
        """The commit's device half: compacts the accepted path's KV and grows the device
        prefix lengths, reading nothing on the host, so a loop can queue it behind its read
        of the accepted tokens before it waits for them. :meth:`commit_lengths` must follow
        before the batch verifies, fits or drops rows again."""
        if self._pending is None:
            raise ValueError("commit() without a preceding verify()")
        B = self.batch_size
        if tuple(result.num_output.shape) != (B,) or result.accepted_nodes.shape[0] != B:
            raise ValueError(f"result: an AcceptResult of {B} requests expected (the "
                             f"batch's), got num_output {list(result.num_output.shape)}")
        prefix, kv_indptr, kv_indices = self._pending
        if result.max_depth:  # within the pages the verification planned (views of its plan)
            kv_compact(self.runner.kv_cache.data, kv_indptr, kv_indices, prefix,
                       cast(result.accepted_nodes, torch.int32, self.device).contiguous())
        # the root and the accepted nodes: num_output (= num_accepted + 1) slots, in place
        # (the batch's own tensor; the compaction above read it first, in stream order)
        prefix.add_(cast(result.num_output, torch.int32, self.device))
        self._pending = None
        self._lengths_owed = True

    def commit_lengths(self, num_accepted_host: list[int] | None = None) -> None:
        """The commit's host half: the prefix lengths the planner sizes pages with, from
        ``num_accepted_host`` (``result.num_accepted`` as host ints) or read from the
        device."""
        if not self._lengths_owed:
            raise ValueError("commit_lengths() without a preceding commit_kv()")
        if num_accepted_host is None:
            self._prefix_host = self._prefix.tolist()
        elif len(num_accepted_host) != self.batch_size:
            raise ValueError(f"num_accepted_host: {len(num_accepted_host)} counts for "
                             f"{self.batch_size} requests")
        else:
            self._prefix_host = [p + 1 + a for p, a in zip(self._prefix_host, num_accepted_host)]
        self._lengths_owed = False

    def close(self) -> None:
        """Ends the batch (idempotent): frees its own KV sequences' pages; the caller's
        (``prefill(seq_ids=...)``) keep theirs."""
        if self._owns_seqs:
            for sid in self._seq_ids:
                if sid in self.runner.kv_cache:  # (a failed prefill made none, or some)
                    self.runner.kv_cache.free(sid)
        self._seq_ids, self._prefix, self._prefix_host, self._pending = [], None, [], None
        self._lengths_owed = False
