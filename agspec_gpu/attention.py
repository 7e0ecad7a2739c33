"""Tree attention over the paged KV cache: plan once per step, run once per layer.

Two backends share one interface and consume the same :class:`~agspec_gpu.tree.TreeMetadata`
(``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, ``packed_mask``,
``mask_indptr``):

- :class:`FlashInferPagedAttention`: ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` with
  the packed custom mask (GPU);
- :class:`TorchPagedAttention`: a reference that gathers the pages and unpacks the mask, so the
  metadata layout is exercised without a GPU.

Either can split a step whose plan holds ``meta.maybe_prefix`` (``plan_tree(prefix_pages=
True)``): each row's attention over its request's prefix without a mask (FlashInfer's fast
path, ``causal=False``), and over its own tree apart, merged by their log-sum-exps
(:mod:`agspec_gpu.kernels.tree_attention`). FlashInfer's custom mask is its slow path: an
H100 ran it at 1.3 TB/s of 3.35 over 4,096-token prefixes at B = 64. Both backends return
the same attention either way (tested); a runner plans the prefix pages when its backend
was built with ``split=True`` and a step's trees are small (:data:`SPLIT_MAX_QO_LEN`).

``run(q, kv_cache)`` takes ``q: [Q, H_qo, D]`` for all ``Q = meta.capacity_q`` rows and the
layer's cache ``[num_pages, 2, page_size, H_kv, D]`` (NHD) and returns ``[Q, H_qo, D]`` with
zeros in the padding rows.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from agspec_gpu.kernels.tree_attention import launch_tree_attention
from agspec_gpu.tree import TreeMetadata, unpack_mask

# the most rows per request a split step may carry: verification trees. A prefill chunk
# (``PagedLlamaRunner.prefill``, up to hundreds of rows of one chain) runs the custom mask
# whatever its length: the tree kernel has no tensor cores
SPLIT_MAX_QO_LEN = 128


def attend_tree(meta: TreeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                o_prefix: torch.Tensor, lse: torch.Tensor, sm_scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """A split step's tree part, merged with its prefix part (``o_prefix [Q, H, D]``,
    ``lse fp32 [Q, H]`` base 2): :func:`~agspec_gpu.kernels.tree_attention.tree_attention`
    over ``meta``'s rows, slots, ancestors and prefix lengths (a sink, when planned, has
    no tree). Run every layer: its launcher's checks are left out (the plan was checked
    when made, the callers check ``q``)."""
    if out is None:
        out = torch.empty_like(q)
    return launch_tree_attention(q, kv_cache, meta.kv_slots, meta.qo_indptr,
                                 meta.ancestor_bits, meta.maybe_prefix.prefix_lens, o_prefix,
                                 lse, out, num_tree=meta.batch_size - meta.has_sink,
                                 sm_scale=sm_scale)


def _gather(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_last_page_len: torch.Tensor, page_size: int, R: int, K: int) -> tuple:
    """``(rows [B, R], row_valid, kv_page [B, K], kv_offset, col_valid)``: each request's
    query rows and the page and offset of its KV columns (``col_valid``: ``< kv_len``)."""
    dev = qo_indptr.device
    r = torch.arange(R, device=dev)
    c = torch.arange(K, device=dev)
    rows = qo_indptr[:-1, None].long() + r[None, :]
    row_valid = r[None, :] < (qo_indptr[1:] - qo_indptr[:-1])[:, None]
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    kv_len = torch.where(num_pages > 0, (num_pages - 1) * page_size + kv_last_page_len, 0)
    page_pos = kv_indptr[:-1, None].long() + (c // page_size)[None, :]
    kv_page = kv_indices[page_pos.clamp(max=kv_indices.numel() - 1)].long()
    kv_offset = (c % page_size)[None, :].expand_as(kv_page)
    return rows, row_valid, kv_page, kv_offset, c[None, :] < kv_len[:, None]


class TorchPagedAttention:
    """Reference paged tree attention: ``softmax(q k^T * scale + mask) v`` per request, fp32.

    ``plan`` builds the gather indices and unpacks the mask into ``bool [B, max_qo_len,
    max_kv_len]``; ``run`` gathers each request's KV from its pages and attends with grouped
    query heads (query head ``h`` reads KV head ``h // (H_qo // H_kv)``). Meant for CPU and
    tests: it allocates dense per-request tensors and uses boolean indexing.

    With ``split``, a plan with ``meta.maybe_prefix`` runs split: the gather over the prefix
    pages without a mask (and the base-2 log-sum-exp FlashInfer returns), then
    :func:`~agspec_gpu.kernels.tree_attention.tree_attention` (torch on a CPU). Any other
    plan runs the custom mask (a split plan holds it too).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 sm_scale: float | None = None, split: bool = False) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.split = split
        self._meta: TreeMetadata | None = None

    def plan(self, meta: TreeMetadata) -> None:
        """Prepares gather indices and the dense mask of one step (of the prefix part, for a
        split plan)."""
        if meta.page_size != self.page_size:
            raise ValueError(f"meta.page_size={meta.page_size}, backend page_size="
                             f"{self.page_size}")
        R, K = meta.max_qo_len, meta.max_kv_len
        p = meta.maybe_prefix if self.split else None
        self._split = p is not None
        if p is None:
            (self._rows, self._row_valid, self._kv_page, self._kv_offset,
             _) = _gather(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                          meta.kv_last_page_len, self.page_size, R, K)
            self._mask = unpack_mask(meta)  # [B, R, K]; False beyond kv_len
        else:
            (self._rows, self._row_valid, self._kv_page, self._kv_offset,
             cols) = _gather(meta.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len,
                             self.page_size, R, K)
            self._mask = cols[:, None, :].expand(-1, R, -1)
        self._meta = meta

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every query row; ``q: [Q, H_qo, D]``, cache ``[P, 2, ps, H_kv, D]``."""
        if self._meta is None:
            raise ValueError("run() before plan()")
        Q, H, D = self._meta.capacity_q, self.num_qo_heads, self.head_dim
        if tuple(q.shape) != (Q, H, D):
            raise ValueError(f"q: expected shape {(Q, H, D)}, got {tuple(q.shape)}")
        if kv_cache.dim() != 5 or kv_cache.shape[1:] != (2, self.page_size, self.num_kv_heads,
                                                        D):
            raise ValueError(f"kv_cache: expected [P, 2, {self.page_size}, {self.num_kv_heads}, "
                             f"{D}], got {tuple(kv_cache.shape)}")
        B, R = self._rows.shape
        G = H // self.num_kv_heads
        qb = q[self._rows.clamp(max=Q - 1)].float()  # [B, R, H, D]
        qb = qb.view(B, R, self.num_kv_heads, G, D)
        k = kv_cache[self._kv_page, 0, self._kv_offset].float()  # [B, K, H_kv, D]
        v = kv_cache[self._kv_page, 1, self._kv_offset].float()
        scores = torch.einsum("brhgd,bkhd->bhgrk", qb, k) * self.sm_scale
        mask = self._mask[:, None, None]  # [B, 1, 1, R, K]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows see nothing
        o = torch.einsum("bhgrk,bkhd->brhgd", probs, v).reshape(B, R, H, D)
        rows, valid = self._rows[self._row_valid], self._row_valid
        meta = self._meta
        if not self._split:
            if out is None:
                out = torch.zeros(Q, H, D, dtype=q.dtype, device=q.device)
            else:
                out.zero_()
            out[rows] = o[valid].to(out.dtype)
            return out
        # split: the prefix part's output and base-2 log-sum-exp, then the tree merged in
        o_prefix = torch.zeros(Q, H, D, dtype=q.dtype, device=q.device)
        lse = torch.zeros(Q, H, dtype=torch.float32, device=q.device)
        o_prefix[rows] = o[valid].to(q.dtype)
        lse[rows] = torch.logsumexp(scores, dim=-1).permute(0, 3, 1, 2).reshape(
            B, R, H)[valid] / math.log(2.0)
        return attend_tree(meta, q, kv_cache, o_prefix, lse, self.sm_scale, out)


def prefill_workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int,
                            num_sms: int, *, max_rows: int = 0, max_requests: int = 0) -> int:
    """Bytes of float workspace a FlashInfer (fa2) batch prefill plan may carve.

    With split KV the plan allocates ``tmp_v float32 [num_qo_heads, tiles * cta_tile_q,
    head_dim]`` and ``tmp_s`` (the same without ``head_dim``), ``tiles`` being the padded
    batch of (request, query tile, KV chunk) work items (FlashInfer's ``scheduler.cuh``,
    ``PrefillPlan``). Eagerly, a split plan has at most the planner's grid cap,
    ``2 * num_sms // num_kv_heads`` items. In CUDA-graph mode (``max_rows > 0``: plans of at
    most ``max_rows`` query rows over ``max_requests`` requests) split KV is always on and
    ``tiles = max(cap, ceil(rows * group / cta_tile_q) + requests - 1)``: 409 MB for the
    Llama-3-8B verification bucket of 4,161 rows over 65 requests (64 and a sink), over
    FlashInfer's 128 MiB default. Bounded here over every ``cta_tile_q`` the planner picks
    (16, 64, 128), with 16 MiB of room for its alignment; at least 128 MiB.
    """
    group = num_qo_heads // num_kv_heads
    cap = 2 * num_sms // num_kv_heads
    rows = 0
    for cta_tile_q in (16, 64, 128):
        graph_tiles = -(-max_rows * group // cta_tile_q) + max_requests - 1 if max_rows else 0
        rows = max(rows, max(cap, graph_tiles) * cta_tile_q)
    return max(128 << 20, num_qo_heads * rows * (head_dim + 1) * 4 + (16 << 20))


def flashinfer_workspace(num_bytes: int, device: torch.device | str) -> torch.Tensor:
    """A FlashInfer float workspace, zeroed (FlashInfer asks for a zeroed buffer on first
    use)."""
    return torch.zeros(num_bytes, dtype=torch.uint8, device=device)


def flashinfer_int_workspace(device: torch.device | str) -> torch.Tensor:
    """An int workspace (a plan's work lists) of the size each FlashInfer 0.7 wrapper
    allocates for itself (8 MiB), for wrappers that are never planned at once to share
    (``wrapper.reset_workspace_buffer(float_workspace, int_workspace)`` before their
    capture): a runner's graph buckets, each planned right before its replay on one stream,
    as they share the float workspace. Otherwise a paged decoder's 49 verification and 7
    decode graphs hold 448 MiB of them. (Each wrapper keeps its own pinned host copy, which
    its plan fills before the copy to the device.)"""
    return torch.zeros(8 << 20, dtype=torch.uint8, device=device)


def num_sms(device: torch.device | str) -> int:
    """The device's streaming multiprocessors (FlashInfer's planner sizes its grid by them)."""
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


class FlashInferPagedAttention:
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (NHD) with a packed custom mask.

    ``plan`` forwards the step's metadata once; ``run`` is called per layer. FlashInfer's
    ``run`` requires ``q.shape[0] == qo_indptr[-1]``, so ``plan`` reads the valid row count
    to the host; FlashInfer's own ``plan`` copies the indptrs to the host as well, so this adds
    no extra stall. Rows past it are padding and come back as zeros.

    The ``fa2`` backend is chosen explicitly: FlashInfer's SM90 (``fa3``) batch-prefill kernels
    do not implement ``MaskMode.CUSTOM``, and ``backend="auto"`` decides once, at the first
    ``plan``.

    With ``split``, a plan with ``meta.maybe_prefix`` runs split: a second wrapper, planned
    unmasked over the prefix pages, returns each row's output and base-2 log-sum-exp, and
    :func:`~agspec_gpu.kernels.tree_attention.tree_attention` adds the tree. Any other plan
    runs the custom mask.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 device: torch.device | str, dtype: torch.dtype,
                 workspace_bytes: int | None = None, sm_scale: float | None = None,
                 split: bool = False) -> None:
        import flashinfer  # imported here: an optional GPU dependency

        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size, self.dtype = head_dim, page_size, dtype
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        if workspace_bytes is None:
            workspace_bytes = prefill_workspace_bytes(num_qo_heads, num_kv_heads, head_dim,
                                                      num_sms(device))
        self._workspace = flashinfer_workspace(workspace_bytes, device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2")
        self.split = split
        # the prefix part's wrapper (run after the custom one's plans, on one stream: they
        # share the workspace), its outputs grown to the largest step's rows
        self._prefix_wrapper = None if not split else \
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        self._prefix_out = torch.empty(0, num_qo_heads, head_dim, dtype=dtype, device=device)
        self._prefix_lse = torch.empty(0, num_qo_heads, dtype=torch.float32, device=device)
        self._meta: TreeMetadata | None = None
        self._num_q: int | None = None
        self._capacity_q = 0

    def plan(self, meta: TreeMetadata) -> None:
        """Plans FlashInfer's batch prefill for one step (a host sync inside FlashInfer
        unless ``meta.maybe_host`` holds the sizes)."""
        if meta.page_size != self.page_size:
            raise ValueError(f"meta.page_size={meta.page_size}, backend page_size="
                             f"{self.page_size}")
        self._split = self.split and meta.maybe_prefix is not None
        if not self._split:
            flashinfer_plan(self._wrapper, meta, self.num_qo_heads, self.num_kv_heads,
                            self.head_dim, self.sm_scale, self.dtype)
        else:
            flashinfer_plan_prefix(self._prefix_wrapper, meta, self.num_qo_heads,
                                   self.num_kv_heads, self.head_dim, self.sm_scale, self.dtype)
            if self._prefix_out.shape[0] < meta.capacity_q:
                self._prefix_out = self._prefix_out.new_empty(
                    (meta.capacity_q, self.num_qo_heads, self.head_dim))
                self._prefix_lse = self._prefix_lse.new_empty(
                    (meta.capacity_q, self.num_qo_heads))
        host = meta.maybe_host
        self._num_q = int((meta.qo_indptr if host is None else host.qo_indptr)[-1])
        self._capacity_q = meta.capacity_q
        self._meta = meta

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every query row; ``q: [Q, H_qo, D]``, cache ``[P, 2, ps, H_kv, D]``."""
        if self._num_q is None:
            raise ValueError("run() before plan()")
        shape = (self._capacity_q, self.num_qo_heads, self.head_dim)
        if tuple(q.shape) != shape:
            raise ValueError(f"q: expected shape {shape}, got {tuple(q.shape)}")
        if out is None:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        n, meta = self._num_q, self._meta
        if not self._split:
            self._wrapper.run(q[:n], kv_cache, out=out[:n])
            out[n:].zero_()
            return out
        Q = self._capacity_q
        o_prefix, lse = self._prefix_out[:Q], self._prefix_lse[:Q]
        self._prefix_wrapper.run(q[:n], kv_cache, out=o_prefix[:n], lse=lse[:n],
                                 return_lse=True)
        return attend_tree(meta, q, kv_cache, o_prefix, lse, self.sm_scale, out)


def flashinfer_plan(wrapper, meta: TreeMetadata, num_qo_heads: int, num_kv_heads: int,
                    head_dim: int, sm_scale: float, dtype: torch.dtype) -> None:
    """``wrapper.plan`` (a ``BatchPrefillWithPagedKVCacheWrapper``) for ``meta``'s step.

    FlashInfer plans on the host: it copies ``qo_indptr``, ``kv_indptr`` and
    ``kv_last_page_len`` there, which for device tensors waits for every kernel queued before
    (the drafter's, the planner's). With ``meta.maybe_host`` it gets them from the host and
    copies them into its device buffers without waiting; they equal what the planner wrote.

    Contract: between two plans of one wrapper the host waits for the device once (every
    loop here reads its step's tokens back). FlashInfer writes its plan into one pinned
    host buffer per wrapper and copies it to the device asynchronously, so a second plan
    issued before the first copy ran would overwrite the first step's plan.
    """
    host = meta.maybe_host
    if host is None:
        qo, kv, last, indices = (meta.qo_indptr, meta.kv_indptr, meta.kv_last_page_len,
                                 meta.kv_indices)
    else:
        qo, kv, last = host.qo_indptr, host.kv_indptr, host.kv_last_page_len
        indices = meta.kv_indices[:int(kv[-1])]
    wrapper.plan(qo, kv, indices, last, num_qo_heads, num_kv_heads, head_dim, meta.page_size,
                 packed_custom_mask=meta.packed_mask, sm_scale=sm_scale, q_data_type=dtype,
                 kv_data_type=dtype)
    # flashinfer 0.7.2 (prefill.py, BatchPrefillWithPagedKVCacheWrapper.plan): given only
    # `packed_custom_mask`, plan() keeps mask_indptr from _compute_page_mask_indptr, which
    # counts mask *elements* (cumsum of qo_len * kv_len); the kernel adds it to a uint8
    # pointer (include/flashinfer/attention/variants.cuh: `maybe_custom_mask +
    # maybe_mask_indptr[batch_idx]`), i.e. needs *byte* offsets, as segment_packbits returns
    # on the `custom_mask` path (flashinfer-ai/flashinfer#2201). Our byte offsets are right
    # for both the buggy and a fixed plan(); a CUDA graph reads them from this buffer.
    wrapper._mask_indptr_buf.copy_(meta.mask_indptr)


def flashinfer_plan_prefix(wrapper, meta: TreeMetadata, num_qo_heads: int,
                           num_kv_heads: int, head_dim: int, sm_scale: float,
                           dtype: torch.dtype) -> None:
    """``wrapper.plan`` of a split step's prefix part: ``meta``'s rows over
    ``meta.maybe_prefix``'s pages, unmasked (``causal=False``: every row sees its whole
    prefix). With ``meta.maybe_host`` from the host's sizes, as :func:`flashinfer_plan`."""
    host, p = meta.maybe_host, meta.maybe_prefix
    if host is None:
        qo, kv, last, indices = meta.qo_indptr, p.kv_indptr, p.kv_last_page_len, p.kv_indices
    else:
        qo, kv, last = host.qo_indptr, host.prefix_kv_indptr, host.prefix_kv_last_page_len
        indices = p.kv_indices[:int(kv[-1])]
    wrapper.plan(qo, kv, indices, last, num_qo_heads, num_kv_heads, head_dim, meta.page_size,
                 causal=False, sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype)


def make_attention_backend(device: torch.device | str, num_qo_heads: int, num_kv_heads: int,
                           head_dim: int, page_size: int, *, dtype: torch.dtype,
                           sm_scale: float | None = None, split: bool = False
                           ) -> TorchPagedAttention | FlashInferPagedAttention:
    """FlashInfer where it runs (CUDA, fp16/bf16, installed); the torch reference otherwise.
    ``split``: the backend takes split plans (a prefix part and the tree apart)."""
    device = torch.device(device)
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flashinfer") is not None):
        return FlashInferPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size,
                                        device=device, dtype=dtype, sm_scale=sm_scale,
                                        split=split)
    return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size,
                               sm_scale=sm_scale, split=split)
