"""Plain one-token decode steps of a :class:`~agspec_gpu.runners.paged.PagedLlamaRunner`
as CUDA graphs: how a serving engine runs the steps that carry no draft.

:class:`DecodeGraphs` holds, per batch size, the planner's fixed-capacity buffers of a
draft-free step and, on a GPU with FlashInfer, a captured graph of the runner's forward with
FlashInfer's tensor-core decode kernel over those buffers (re-planned outside the graph before
each replay). Elsewhere the same steps run eagerly, so the code path is tested on CPU.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Sequence

import torch

from agspec_gpu.attention import (flashinfer_int_workspace, flashinfer_workspace, num_sms,
                                  prefill_workspace_bytes)
from agspec_gpu.cuda_graph import capture, capture_error
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import HostWriter, synchronize
from agspec_gpu.tree import TreeMetadata, host_sizes, padded_step_capacity, plan_tree


class GraphAttention:
    """A FlashInfer wrapper in CUDA-graph mode inside a captured forward (one bucket).

    ``plan`` is a no-op: the owner (:class:`DecodeGraphs`, ``VerifyGraphs``) plans the wrapper
    before every replay, outside the graph, into the fixed buffers the graph reads; ``run``
    writes into the output buffer it was given (the bucket's rows of one its owner's graphs
    share).
    """

    def __init__(self, wrapper, out: torch.Tensor) -> None:
        self.wrapper, self.out = wrapper, out

    def plan(self, meta: TreeMetadata) -> None:
        pass

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        return self.wrapper.run(q, kv_cache, out=self.out)


def capture_forward(runner, attention, meta: TreeMetadata, warmup: int, pool,
                    logits_out: torch.Tensor) -> tuple:
    """Captures ``runner.forward(meta)`` as a CUDA graph with ``attention`` (a
    :class:`GraphAttention` whose wrapper is planned for ``meta``, or another with its
    ``plan`` / ``run``) as its attention, writing the logits into ``logits_out``
    (``[meta.capacity_q, vocab]``); ``(graph, logits, view)``, ``logits`` being
    ``logits_out``.

    The attention's output and ``logits_out`` may be views of buffers that other graphs write
    too (one replays at a time, read before the next). ``view`` is the runner's copy that
    holds the graph's attention: keep it as long as the graph.
    """
    view = copy.copy(runner)  # same weights and KV cache, the graph's attention
    view.attention = attention
    graph, logits = capture(lambda: view.forward(meta, out=logits_out), runner.device,
                            warmup, pool)
    return graph, logits, view


def shared_outputs(runner, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention [max_rows, H_qo, D], logits [max_rows, vocab])`` in the runner's dtype
    for every graph of one owner, each graph writing their first rows: the largest bucket's
    instead of the sum over buckets (the logits of a paged decoder's 49 verification graphs
    at max_batch 64, 64 nodes and a 128K vocabulary: 4.46 GB, now 1.07 GB)."""
    s, dev = runner.shape, runner.device
    return (torch.empty(max_rows, s.num_qo_heads, s.head_dim, dtype=runner.dtype, device=dev),
            torch.empty(max_rows, runner.lm_head.shape[0], dtype=runner.dtype, device=dev))


class GraphSteps:
    """Captured forwards of a runner, one per bucket, with an eager fallback: the part
    :class:`DecodeGraphs` and ``VerifyGraphs`` share. A subclass sets ``runner`` and
    implements ``_capture(warmup)``, filling ``_graphs``."""

    def _start(self, use_graphs: bool | None, warmup: int) -> None:
        """Captures (default: on CUDA when the runner's attention is FlashInfer); a failure
        is kept in :attr:`graph_error` and every step then runs eagerly."""
        if use_graphs is None:
            from agspec_gpu.attention import FlashInferPagedAttention

            use_graphs = self.runner.device.type == "cuda" and isinstance(
                self.runner.attention, FlashInferPagedAttention)
        self.graph_error: str | None = None
        self._graphs: dict = {}
        if use_graphs:
            try:
                self._capture(warmup)
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
                self._graphs.clear()
                self.graph_error = capture_error(exc)

    @property
    def uses_graphs(self) -> bool:
        return bool(self._graphs)


class DecodeGraphs(GraphSteps):
    """One-token decode steps at fixed batch sizes: CUDA graphs on a GPU, eager elsewhere.

    For each size ``S`` it holds the planner buffers of a step of ``S`` requests with no draft
    (:meth:`TreeMetadata.empty` with ``max_qo_len = 1``). A step of ``b <= S`` requests is
    padded to the smallest size that fits with requests of one token on the KV cache's null
    page. With ``use_graphs`` (CUDA and FlashInfer) every size's forward is captured once: the
    runner's forward with FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores,
    ``use_cuda_graph=True``) over the same buffers, which are re-planned before each replay.

    Parameters
    ----------
    runner : PagedLlamaRunner
    batch_sizes : sizes to prepare (a step larger than the largest is an error).
    use_graphs : capture CUDA graphs (default: on CUDA when FlashInfer is the backend). When
        capture fails, the error is kept in :attr:`graph_error` and steps run eagerly.

    Example
    -------
    A runner on a GPU whose pool holds sequence ``"s0"`` (17 tokens cached)::

        graphs = DecodeGraphs(runner, [1, 2, 4])
        logits = graphs.decode(["s0"], torch.tensor([42]), [17])     # [1, vocab]
    """

    def __init__(self, runner, batch_sizes: Sequence[int], *, use_graphs: bool | None = None,
                 warmup: int = 2) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be >= 1, got {list(batch_sizes)}")
        self.runner = runner
        self.sizes = sorted(set(int(b) for b in batch_sizes))
        cache = runner.kv_cache
        dev = runner.device
        P, ps = cache.max_pages_per_seq, cache.page_size
        self._meta = {}
        for S in self.sizes:  # pages and mask bytes bounded by the pool too
            pages, mask_bytes = padded_step_capacity(S, 1, S, P, ps, cache.num_pages,
                                                     sink=False)
            self._meta[S] = TreeMetadata.empty(S, 1, P, ps, dev, max_total_q=S,
                                               max_total_pages=pages,
                                               max_mask_bytes=mask_bytes)
        self._empty = {S: DraftBatch(torch.zeros(S, 0, dtype=torch.int32, device=dev),
                                     torch.zeros(S, 0, dtype=torch.int32, device=dev),
                                     torch.zeros(S, dtype=torch.int32, device=dev))
                       for S in self.sizes}
        # each size's step inputs (page table, prefix lengths, roots), rewritten in place;
        # rows [used, S) are padding: one token on the null page
        self._inputs = {S: (torch.full((S, P), cache.null_page, dtype=torch.int32, device=dev),
                            torch.zeros(S, dtype=torch.int32, device=dev),
                            torch.zeros(S, dtype=torch.int32, device=dev))
                        for S in self.sizes}
        self._used = dict.fromkeys(self.sizes, 0)
        self._writer = HostWriter(1 << 14, dev)  # the prefix lengths, staged pinned
        self._start(use_graphs, warmup)

    def size_for(self, num_requests: int) -> int:
        for S in self.sizes:
            if S >= num_requests:
                return S
        raise ValueError(f"{num_requests} requests exceed the largest prepared batch "
                         f"{self.sizes[-1]}")

    def plan(self, seq_ids: Sequence, roots: torch.Tensor, prefix_lens_host: Sequence[int]
             ) -> tuple[int, TreeMetadata]:
        """Allocates a slot per request and plans the padded step; ``(size, metadata)``."""
        b = len(seq_ids)
        S = self.size_for(b)
        cache = self.runner.kv_cache
        cache.allocate_many(seq_ids, [n + 1 for n in prefix_lens_host])
        page_table, prefix, root = self._inputs[S]
        if b < self._used[S]:  # rows a larger step wrote: padding again (roots: any token)
            page_table[b:self._used[S]].fill_(cache.null_page)
        self._used[S] = b
        prefix_host = list(prefix_lens_host) + [0] * (S - b)
        self._writer.copy_to(prefix, prefix_host)
        cache.page_table(seq_ids, out=page_table[:b])
        root[:b].copy_(roots)
        # the sizes on the host too: FlashInfer's plan reads them there
        meta = plan_tree(self._empty[S], root, prefix, page_table, cache.page_size,
                         out=self._meta[S],
                         host=host_sizes([0] * S, prefix_host, cache.page_size,
                                         out=self._meta[S]))
        return S, meta

    @torch.inference_mode()
    def decode(self, seq_ids: Sequence, roots: torch.Tensor, prefix_lens_host: Sequence[int]
               ) -> torch.Tensor:
        """Writes each root's KV at its slot ``prefix_len``; ``[len(seq_ids), vocab]`` logits.

        With graphs the result is a view of the graph's output buffer: read it before the
        next call.
        """
        S, meta = self.plan(seq_ids, roots, prefix_lens_host)
        if S in self._graphs:
            graph, wrapper, logits, _ = self._graphs[S]
            self._plan_wrapper(wrapper, meta)
            graph.replay()
            return logits[:len(seq_ids)]
        return self.runner.forward(meta)[:len(seq_ids)]

    @torch.inference_mode()
    def step_fn(self, seq_ids: Sequence, roots: torch.Tensor,
                prefix_lens_host: Sequence[int]) -> Callable[[], object]:
        """One decode step of ``seq_ids``, planned once, as a callable that repeats its
        device work: the captured graph's ``replay`` (or the eager forward), valid until
        the next plan of any size (the sizes' graphs share FlashInfer's workspaces)."""
        S, meta = self.plan(seq_ids, roots, prefix_lens_host)
        if S in self._graphs:
            graph, wrapper, _, _ = self._graphs[S]
            self._plan_wrapper(wrapper, meta)
            return graph.replay
        return lambda: self.runner.forward(meta)

    def time_step(self, seq_ids: Sequence, roots: torch.Tensor, prefix_lens_host: Sequence[int],
                  iters: int = 50, warmup: int = 5) -> float:
        """Mean ms of one decode step's device work (planned once, then repeated).

        With graphs this is ``graph.replay()`` back to back: the step's kernels alone, the
        figure to hold against the memory-bandwidth roofline.
        """
        step = self.step_fn(seq_ids, roots, prefix_lens_host)
        dev = self.runner.device
        for _ in range(warmup):
            step()
        synchronize(dev)
        if dev.type == "cuda":
            # on the runner's device's stream, whatever device is current
            stream = torch.cuda.current_stream(dev)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record(stream)
            for _ in range(iters):
                step()
            ev[1].record(stream)
            synchronize(dev)
            return ev[0].elapsed_time(ev[1]) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return 1e3 * (time.perf_counter() - t0) / iters

    # ------------------------------------------------------------------ capture
    def _plan_wrapper(self, wrapper, meta: TreeMetadata) -> None:
        s, host = self.runner.shape, meta.maybe_host
        # BatchDecode's plan copies the indptrs to the host too: from the host, no wait (and
        # one host wait between two plans of a wrapper: attention.flashinfer_plan says why)
        kv, indices, last = (meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len) \
            if host is None else (host.kv_indptr, meta.kv_indices[:int(host.kv_indptr[-1])],
                                  host.kv_last_page_len)
        wrapper.plan(kv, indices, last, s.num_qo_heads,
                     s.num_kv_heads, s.head_dim, self.runner.page_size, pos_encoding_mode="NONE",
                     q_data_type=self.runner.dtype, kv_data_type=self.runner.dtype,
                     sm_scale=s.head_dim ** -0.5)

    def _capture(self, warmup: int) -> None:
        import flashinfer

        runner, s = self.runner, self.runner.shape
        dev = runner.device
        # decode on tensor cores plans as a batch prefill of one row per request
        S_max = max(self.sizes)
        workspace = flashinfer_workspace(prefill_workspace_bytes(
            s.num_qo_heads, s.num_kv_heads, s.head_dim, num_sms(dev), max_rows=S_max,
            max_requests=S_max), dev)
        int_workspace = flashinfer_int_workspace(dev)  # shared as the float one
        attn_buf, logits_buf = shared_outputs(runner, S_max)  # one decode replays at a time
        pool = torch.cuda.graph_pool_handle()
        for S in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            meta = self._meta[S]
            kwargs = dict(use_cuda_graph=True, use_tensor_cores=True,
                          paged_kv_indptr_buffer=meta.kv_indptr,
                          paged_kv_indices_buffer=meta.kv_indices,
                          paged_kv_last_page_len_buffer=meta.kv_last_page_len)
            try:  # fa2 explicitly: its module is the one tree verification compiled already
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", backend="fa2", **kwargs)
            except TypeError:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                       **kwargs)
            wrapper.reset_workspace_buffer(workspace, int_workspace)
            meta = self._plan_padding(S)
            self._plan_wrapper(wrapper, meta)
            graph, logits, view = capture_forward(runner, GraphAttention(wrapper, attn_buf[:S]),
                                                  meta, warmup, pool, logits_buf[:S])
            self._graphs[S] = (graph, wrapper, logits, view)
        torch.cuda.synchronize(dev)

    def _plan_padding(self, S: int) -> TreeMetadata:
        """A step of ``S`` padding requests (capture input: one token on the null page), on
        the size's own page table (all null pages before the first step): as wide as a real
        step's, so the planner's kernels compile here the variants real steps launch, not
        inside a timed run."""
        cache, dev = self.runner.kv_cache, self.runner.device
        page_table = self._inputs[S][0]
        zeros = torch.zeros(S, dtype=torch.int32, device=dev)
        return plan_tree(self._empty[S], zeros, zeros, page_table, cache.page_size,
                         out=self._meta[S])
