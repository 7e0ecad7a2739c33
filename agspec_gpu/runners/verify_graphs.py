"""Tree-verification steps of a :class:`~agspec_gpu.runners.paged.PagedLlamaRunner` as CUDA
graphs: the forward over every request's root and draft tree, replayed instead of launched.

Why: launched eagerly, a verification forward of an 8B model is ~1,350 kernel launches driven
from Python, and on an H200 that host work, not the GPU, sets its time: verifying 1 draft
token at batch 1 took 20.3 ms where the graphed plain decode step took 7.9 ms
(``bench/results/cost-llama3-8b-h200.json``), so no drafter could win. A graph replays the
same kernels in one launch.

A graph has fixed shapes, so steps are padded into buckets ``(S, Q)``: ``S`` requests
(the real ``b`` plus ``S - b`` padding requests of one row on the KV cache's null page) and
``Q`` query rows. FlashInfer's batch prefill in CUDA-graph mode fixes the batch size and
sizes its grid from the row count of the plan it was captured with, so every plan of a
bucket has exactly ``Q`` rows: a *sink* request ``S`` (one KV entry on the null page, every
row attending to it) takes the rows the step leaves over. Padding and sink rows write their
KV to the null page and their logits are junk; the real requests' rows, KV slots and logits
are those of the unpadded step (tested against it on CPU, where the same padded metadata
runs eagerly through the torch backend).

Buckets: ``S`` from ``batch_sizes``; ``Q = S + 1 + 8 * 2**j`` up to the most a bucket can
need, ``S * (max_nodes + 1) + 1``. Each bucket owns its planner buffers (their pages and
mask bytes bounded by the KV pool as well as by the rows: ``padded_step_capacity``; the
page list and the mask, the large ones, are views of one pair the buckets share) and a
FlashInfer wrapper planned before every replay (outside the graph: FlashInfer plans on the
host); the attention output and the logits a graph writes are the first rows of one
buffer each that all buckets share, as are FlashInfer's workspaces and the graphs' memory
pool. So a step's plan and logits hold until the next step's plan, whatever its bucket.

With a split runner (``PagedLlamaRunner(split_attention=True)`` and trees small enough:
``runner.splits(max_nodes)``) a bucket's wrapper plans the prefix part, unmasked, over the
prefix pages its planner writes too, and the graph runs the tree kernel after it
(:class:`SplitGraphAttention`); the prefix outputs and log-sum-exps are shared buffers too.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from agspec_gpu.attention import (attend_tree, flashinfer_int_workspace, flashinfer_plan,
                                  flashinfer_plan_prefix, flashinfer_workspace, num_sms,
                                  prefill_workspace_bytes)
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import HostWriter, copy_grouped, synchronize
from agspec_gpu.runners.graphs import GraphAttention, GraphSteps, capture_forward, shared_outputs
from agspec_gpu.tree import (HostSizes, TreeMetadata, host_sizes, padded_step_capacity,
                             plan_tree)


class _StepInputs(NamedTuple):
    """A bucket's planner inputs, allocated once: page tables ``int32 [S, P]``, prefix
    lengths and roots ``int32 [S]``, drafts ``[S, max_nodes]``."""

    page_table: torch.Tensor
    prefix: torch.Tensor
    root: torch.Tensor
    draft: DraftBatch


class SplitGraphAttention:
    """A bucket's split attention inside its graph: the prefix wrapper (CUDA-graph mode,
    planned before each replay, outside the graph) writes each row's output and base-2
    log-sum-exp over its prefix into ``o_prefix`` / ``lse``, then the tree kernel merges
    each row's tree into ``out``, reading the bucket's planned buffers (``meta``)."""

    def __init__(self, wrapper, out: torch.Tensor, o_prefix: torch.Tensor, lse: torch.Tensor,
                 meta: TreeMetadata, sm_scale: float) -> None:
        self.wrapper, self.out, self.meta, self.sm_scale = wrapper, out, meta, sm_scale
        self.o_prefix, self.lse = o_prefix, lse

    def plan(self, meta: TreeMetadata) -> None:
        pass

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        self.wrapper.run(q, kv_cache, out=self.o_prefix, lse=self.lse, return_lse=True)
        return attend_tree(self.meta, q, kv_cache, self.o_prefix, self.lse, self.sm_scale,
                           self.out)


def row_buckets(S: int, max_nodes: int) -> list[int]:
    """Query-row capacities of the graphs for ``S`` requests (ascending, the last the most
    a step of ``S`` requests with ``max_nodes``-node drafts and the sink can need)."""
    top = S * (max_nodes + 1) + 1
    out, j = [], 0
    while not out or out[-1] < top:
        out.append(min(S + 1 + 8 * (1 << j), top))
        j += 1
    return out


class VerifyGraphs(GraphSteps):
    """Verification forwards at fixed ``(requests, rows)`` buckets: CUDA graphs on a GPU with
    FlashInfer, the same padded steps run eagerly elsewhere.

    Parameters
    ----------
    runner : PagedLlamaRunner
    batch_sizes : request counts to prepare (a step of ``b`` requests uses the smallest
        ``S >= b``; more than the largest is an error).
    max_nodes : the largest draft (nodes per request) a step may carry.
    use_graphs : capture (default: on CUDA when the runner's attention is FlashInfer). When
        capture fails, :attr:`graph_error` holds why and steps run eagerly.

    Example
    -------
    A runner on a GPU whose pool holds sequence ``"s0"`` (17 tokens cached), a draft of 5
    nodes::

        vg = VerifyGraphs(runner, [1, 2, 4], max_nodes=16)
        meta, logits = vg.verify(["s0"], draft, roots, [17], num_draft_host=[5])
        logits[:6]          # the root's and the 5 nodes' rows, as meta.qo_indptr[:2] says
    """

    def __init__(self, runner, batch_sizes: Sequence[int], max_nodes: int, *,
                 use_graphs: bool | None = None, warmup: int = 2) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be >= 1, got {list(batch_sizes)}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.runner, self.max_nodes = runner, max_nodes
        self.split = runner.splits(max_nodes)  # the prefix unmasked, the tree apart
        self.sizes = sorted(set(int(b) for b in batch_sizes))
        cache, dev = runner.kv_cache, runner.device
        P, ps = cache.max_pages_per_seq, cache.page_size
        self.buckets = {S: row_buckets(S, max_nodes) for S in self.sizes}
        # pages and mask bytes: bounded by the rows and the table width, and by the pool (a
        # table as wide as the pool would size every bucket for S pools)
        caps = {(S, Q): padded_step_capacity(S, max_nodes + 1, Q, P, ps, cache.num_pages,
                                             sink=True)
                for S in self.sizes for Q in self.buckets[S]}
        # one page list and one mask for every bucket, the largest's: a step plans one
        # bucket and is read before the next plan (its logits are the graphs' pool's too)
        max_pages = max(p for p, _ in caps.values())
        shared = (torch.zeros(max_pages, dtype=torch.int32, device=dev),
                  torch.zeros(max(m for _, m in caps.values()), dtype=torch.uint8, device=dev))
        if self.split:  # the prefix pages: no more than the pages
            shared += (torch.zeros(max_pages, dtype=torch.int32, device=dev),)
        self._meta: dict[tuple[int, int], TreeMetadata] = {
            (S, Q): TreeMetadata.empty(S + 1, max_nodes + 1, P, ps, dev, max_total_q=Q,
                                       max_total_pages=pages, max_mask_bytes=mask_bytes,
                                       shared=shared, with_prefix=self.split)
            for (S, Q), (pages, mask_bytes) in caps.items()}
        i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=dev)  # noqa: E731
        self._inputs = {S: _StepInputs(i32(S, P).fill_(cache.null_page), i32(S), i32(S),
                                       DraftBatch(i32(S, max_nodes), i32(S, max_nodes), i32(S)))
                        for S in self.sizes}
        # per bucket: rows [used, S) of its inputs are padding (a smaller step re-pads the
        # rows a larger one wrote, not every row every step)
        self._used = dict.fromkeys(self.sizes, 0)
        self._writer = HostWriter(1 << 14, dev)  # the prefix lengths, staged pinned
        self._start(use_graphs, warmup)

    def bucket(self, num_requests: int, num_rows: int) -> tuple[int, int]:
        """``(S, Q)`` of a step of ``num_requests`` requests and ``num_rows`` real rows."""
        S = next((s for s in self.sizes if s >= num_requests), None)
        if S is None:
            raise ValueError(f"{num_requests} requests exceed the largest prepared batch "
                             f"{self.sizes[-1]}")
        need = num_rows + (S - num_requests) + 1  # + padding requests' rows + the sink's
        Q = next((q for q in self.buckets[S] if q >= need), None)
        if Q is None:
            raise ValueError(f"a step of {num_rows} rows over {num_requests} requests exceeds "
                             f"the largest bucket ({self.buckets[S][-1]} rows for {S}; "
                             f"max_nodes={self.max_nodes})")
        return S, Q

    def plan(self, seq_ids: Sequence[Hashable], draft: DraftBatch, roots: torch.Tensor,
             prefix_lens_host: Sequence[int], num_draft_host: Sequence[int]
             ) -> tuple[tuple[int, int], TreeMetadata]:
        """Allocates pages and plans the padded step into its bucket's buffers.

        ``draft``: ``B`` trees on the runner's device; ``roots``: ``int32 [B]``;
        ``num_draft_host``: ``draft.num_draft_tokens`` as host ints (their sum picks the
        bucket; with them FlashInfer plans without reading the device). Returns the bucket
        and the step's metadata over ``S + 1`` requests, the real ones first (their rows as
        in the unpadded plan).
        """
        b, N = draft.token_ids.shape
        if b != len(seq_ids) or len(prefix_lens_host) != b or len(num_draft_host) != b:
            raise ValueError(f"draft: {b} rows for {len(seq_ids)} seq_ids, "
                             f"{len(prefix_lens_host)} prefix lengths and "
                             f"{len(num_draft_host)} draft sizes")
        if N > self.max_nodes:
            raise ValueError(f"draft: {N} nodes per request exceed max_nodes={self.max_nodes}")
        total = int(sum(num_draft_host))
        S, Q = self.bucket(b, b + total)
        cache = self.runner.kv_cache
        # each request's root and nodes (the padding columns past them write no KV)
        cache.allocate_many(seq_ids, [p + 1 + int(n)
                                      for p, n in zip(prefix_lens_host, num_draft_host)])
        # the bucket's step inputs, rewritten in place: padding requests have no nodes, a
        # zero prefix and the null page (their roots are any earlier token). The planner
        # reads a request's first num_draft_tokens node columns only, so the columns past
        # them keep whatever an earlier step left.
        inp = self._inputs[S]
        if b < self._used[S]:  # rows a larger step wrote: padding again
            inp.page_table[b:self._used[S]].fill_(cache.null_page)
            inp.draft.num_draft_tokens[b:self._used[S]].zero_()
        self._used[S] = b
        # the prefix lengths, padding's zeros included: one host-to-device copy
        self._writer.copy_to(inp.prefix, list(prefix_lens_host) + [0] * (S - b))
        if b:
            cache.page_table(seq_ids, out=inp.page_table[:b])
            copy_grouped([inp.root[:b], inp.draft.num_draft_tokens[:b],
                          inp.draft.token_ids[:b, :N], inp.draft.parents[:b, :N]],
                         [x.to(torch.int32) for x in (roots, draft.num_draft_tokens,
                                                      draft.token_ids, draft.parents)])
        pad = [0] * (S - b)
        host = host_sizes([int(n) for n in num_draft_host] + pad, list(prefix_lens_host) + pad,
                          cache.page_size, sink_rows=Q - S - total, out=self._meta[S, Q])
        meta = self._plan_padded(S, Q, inp.draft, inp.root, inp.prefix, inp.page_table,
                                 used_rows=S + total, host=host)
        return (S, Q), meta

    def _plan_padded(self, S: int, Q: int, draft: DraftBatch, root: torch.Tensor,
                     prefix: torch.Tensor, page_table: torch.Tensor, used_rows: int,
                     host: HostSizes | None = None) -> TreeMetadata:
        """plan_tree over the ``S`` requests and the sink request ``S`` over rows
        ``[used_rows, Q)``: one KV entry (null page, slot 0) that each of its rows sees."""
        if Q - used_rows < 1:
            raise ValueError(f"bucket ({S}, {Q}) has no row left for the sink")
        return plan_tree(draft, root, prefix, page_table.contiguous(),
                         self.runner.kv_cache.page_size, out=self._meta[S, Q],
                         sink_page=self.runner.kv_cache.null_page, host=host,
                         prefix_pages=self.split)

    @torch.inference_mode()
    def verify(self, seq_ids: Sequence[Hashable], draft: DraftBatch, roots: torch.Tensor,
               prefix_lens_host: Sequence[int], num_draft_host: Sequence[int]
               ) -> tuple[TreeMetadata, torch.Tensor]:
        """One verification forward: ``(meta, logits [Q, vocab])``; request ``i < b``'s rows
        are ``meta.qo_indptr[i]:meta.qo_indptr[i + 1]``. With graphs ``logits`` is the
        graph's buffer: read it before the next call (the buckets' graphs share one memory pool,
        so any bucket's replay may reuse it); ``meta``'s pages and mask too (the buckets share
        them)."""
        key, meta = self.plan(seq_ids, draft, roots, prefix_lens_host, num_draft_host)
        if key in self._graphs:
            graph, wrapper, logits, _ = self._graphs[key]
            self._plan_wrapper(wrapper, meta)
            graph.replay()
            return meta, logits
        return meta, self.runner.forward(meta)

    # ------------------------------------------------------------------ capture (GPU)
    def _plan_wrapper(self, wrapper, meta: TreeMetadata) -> None:
        s = self.runner.shape
        plan = flashinfer_plan_prefix if self.split else flashinfer_plan
        plan(wrapper, meta, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.head_dim ** -0.5,
             self.runner.dtype)

    def _capture(self, warmup: int) -> None:
        import flashinfer

        runner, s = self.runner, self.runner.shape
        dev = runner.device
        # one workspace for every bucket (one replays at a time), sized for the largest plan:
        # S padding requests and the sink
        workspace = flashinfer_workspace(max(
            prefill_workspace_bytes(s.num_qo_heads, s.num_kv_heads, s.head_dim, num_sms(dev),
                                    max_rows=Q, max_requests=S + 1)
            for S, Q in self._meta), dev)
        int_workspace = flashinfer_int_workspace(dev)  # shared as the float one
        # one attention output and one logits buffer too: a step reads its logits before
        # the next step replays any bucket
        max_q = max(Q for _, Q in self._meta)
        attn_buf, logits_buf = shared_outputs(runner, max_q)
        if self.split:  # the prefix part's outputs, shared as the attention's
            prefix_buf = torch.empty_like(attn_buf)
            lse_buf = torch.empty(max_q, s.num_qo_heads, dtype=torch.float32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        for (S, Q) in sorted(self._meta, reverse=True):  # largest first: the rest reuse its pool
            out = self._meta[S, Q]
            if self.split:  # unmasked over the prefix pages
                p = out.maybe_prefix
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=out.qo_indptr[:S + 2],
                    paged_kv_indptr_buf=p.kv_indptr[:S + 2], paged_kv_indices_buf=p.kv_indices,
                    paged_kv_last_page_len_buf=p.kv_last_page_len[:S + 1], backend="fa2")
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=out.qo_indptr[:S + 2],
                    paged_kv_indptr_buf=out.kv_indptr[:S + 2],
                    paged_kv_indices_buf=out.kv_indices,
                    paged_kv_last_page_len_buf=out.kv_last_page_len[:S + 1],
                    custom_mask_buf=out.packed_mask,
                    mask_indptr_buf=torch.zeros(S + 2, dtype=torch.int32, device=dev),
                    backend="fa2")
            wrapper.reset_workspace_buffer(workspace, int_workspace)
            # the capture plan has the most rows a replay may have: S padding requests (no
            # nodes, over the bucket's own draft buffers: a real step's width, which the
            # tree kernel's strides take) and the sink over the rest
            inp = self._inputs[S]
            zeros = torch.zeros(S, dtype=torch.int32, device=dev)
            # the bucket's own page table (all null pages until a step): as wide as a real
            # step's, so the planner's kernels compile the variants real steps launch here
            meta = self._plan_padded(S, Q, inp.draft, zeros, zeros, inp.page_table,
                                     used_rows=S)
            self._plan_wrapper(wrapper, meta)
            attention = GraphAttention(wrapper, attn_buf[:Q]) if not self.split else \
                SplitGraphAttention(wrapper, attn_buf[:Q], prefix_buf[:Q], lse_buf[:Q], meta,
                                    s.head_dim ** -0.5)
            graph, logits, view = capture_forward(runner, attention, meta, warmup, pool,
                                                  logits_buf[:Q])
            self._graphs[S, Q] = (graph, wrapper, logits, view)
        synchronize(dev)
