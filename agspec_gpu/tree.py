"""Tree-attention metadata: plan once per verification step, run every layer with it.

A verification step feeds, for every request ``b``, its root token (the last committed token,
whose KV is not in the cache yet) followed by its draft nodes: ``qo_len[b] = 1 +
num_draft_tokens[b]`` query rows. Tree row ``r`` is the root for ``r = 0`` and draft node
``r - 1`` otherwise. Two orders matter and differ:

- KV slots follow node order: row ``r`` is written at logical slot ``prefix_len + r``;
- RoPE positions follow depth: row ``r`` has position ``prefix_len + depth(r)`` (root depth 0).

The attention mask is FlashInfer's custom mask: per request a row-major ``[qo_len, kv_len]``
boolean matrix, ``kv_len = prefix_len + qo_len`` (the tree's own KV is appended before
attention), where a row sees every prefix column and its ancestors-or-self in the tree; the
matrices are bit-packed little-endian, each padded to a whole byte, concatenated at byte offsets
``mask_indptr`` -- exactly ``flashinfer.quantization.segment_packbits(mask, indptr,
bitorder="little")``, which ``BatchPrefillWithPagedKVCacheWrapper.plan`` itself uses.

Planning needs no host sync: every buffer has a capacity known from static shapes (or given by
the caller) and the valid extents live in the indptr tensors on the device. Entries past them
are padding (see :class:`TreeMetadata`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.kernels._checks import check_ints, check_sink_page
from agspec_gpu.kernels._launch import cast
from agspec_gpu.kernels.prefix_pages import (PrefixPages, check_prefix_out,
                                             launch_prefix_pages as plan_prefix_pages)
from agspec_gpu.kernels.tree_mask import (TreeMaskBuffers, check_tree_inputs, check_tree_out,
                                         launch_tree_mask)


class HostSizes(NamedTuple):
    """A planned step's sizes on the host, as :func:`plan_tree` writes them on the device
    (``int32`` CPU tensors; a sink request included). FlashInfer's ``plan`` reads its indptrs
    on the host: handed these, it does not copy them back from the device, which would wait
    for every kernel queued before it."""

    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_last_page_len: torch.Tensor  # int32 [B]
    num_mask_bytes: int  # the packed mask's bytes (mask_indptr[-1])
    # a split attention's prefix part (plan_tree(prefix_pages=True), TreeMetadata.maybe_prefix)
    prefix_kv_indptr: torch.Tensor  # int32 [B + 1]
    prefix_kv_last_page_len: torch.Tensor  # int32 [B]


def host_sizes(num_draft: Sequence[int], prefix_lens: Sequence[int], page_size: int, *,
               sink_rows: int | None = None, out: TreeMetadata | None = None) -> HostSizes:
    """The sizes :func:`plan_tree` computes for drafts of ``num_draft[b]`` nodes after
    ``prefix_lens[b]`` cached tokens (``qo_len = 1 + num_draft``, ``kv_len = prefix_len +
    qo_len``), from host numbers; ``sink_rows``: a last request of that many rows over one
    KV entry (``plan_tree(sink_page=...)``). ``out``: the buffers the step is to be planned
    into; a step that needs more rows, pages or mask bytes than they hold raises ValueError
    (the planner's kernels would drop what does not fit, and a check of the sizes they
    compute would wait for the device)."""
    n = np.asarray(num_draft, dtype=np.int64)
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    if n.shape != prefix.shape or n.ndim != 1 or (n < 0).any() or (prefix < 0).any():
        raise ValueError(f"num_draft, prefix_lens: expected as many non-negative sizes, got "
                         f"{len(n)} and {len(prefix)}")
    qo_len = 1 + n
    kv_len = prefix + qo_len
    pages = -(-kv_len // page_size)
    last = kv_len - (pages - 1) * page_size
    # the prefix part (kernels/prefix_pages.py): no prefix is one entry on the first page
    prefix_pages = np.maximum(-(-prefix // page_size), 1)
    prefix_last = np.where(prefix > 0, prefix - (prefix_pages - 1) * page_size, 1)
    if sink_rows is not None:
        qo_len, kv_len, pages, last, prefix_pages, prefix_last = (np.append(x, v) for x, v in (
            (qo_len, sink_rows), (kv_len, 1), (pages, 1), (last, 1), (prefix_pages, 1),
            (prefix_last, 1)))
    qo_indptr, kv_indptr, prefix_indptr = (np.concatenate([[0], np.cumsum(x)])
                                           for x in (qo_len, pages, prefix_pages))
    mask_bytes = int(((qo_len * kv_len + 7) // 8).sum())  # the kernels' mask layout
    if mask_bytes >= 1 << 31:  # FlashInfer's mask_indptr (and the planner's) are int32
        raise ValueError(f"num_draft, prefix_lens: the step's packed mask takes {mask_bytes} "
                         f"bytes, past int32 offsets; verify fewer rows at once (a smaller "
                         f"prefill chunk or batch)")
    if out is not None:
        need = (int(qo_indptr[-1]), int(kv_indptr[-1]), mask_bytes)
        have = (out.capacity_q, out.kv_indices.numel(), out.packed_mask.numel())
        if any(n > h for n, h in zip(need, have)):
            raise ValueError(f"a step of {need[0]} rows, {need[1]} pages and {need[2]} mask "
                             f"bytes exceeds the buffers' {have[0]}, {have[1]} and {have[2]}")

    def i32(x):
        return torch.from_numpy(x.astype(np.int32))
    return HostSizes(i32(qo_indptr), i32(kv_indptr), i32(last), mask_bytes, i32(prefix_indptr),
                     i32(prefix_last))


def padded_step_capacity(num_requests: int, max_qo_len: int, max_total_q: int,
                         max_pages_per_seq: int, page_size: int, pool_pages: int, *,
                         sink: bool) -> tuple[int, int]:
    """``(max_total_pages, max_mask_bytes)`` that hold every padded step of a graph bucket
    planned over a :class:`~agspec_gpu.kv_cache.PagedKVCache` of ``pool_pages`` pages: the
    capacities to hand :meth:`TreeMetadata.empty` (``DecodeGraphs``, ``VerifyGraphs``).

    A padded step: ``S = num_requests`` requests, ``b`` of them real and ``S - b`` padding
    (no draft, prefix 0: ``qo_len = kv_len = 1``, one page), and with ``sink`` a last
    request of one page and one KV entry over the rows left of ``Q = max_total_q``. A real
    request has ``qo_len <= R = max_qo_len`` and its ``ceil(kv_len / page_size)`` pages are
    pages it holds (allocated before planning): at most ``P = max_pages_per_seq``, and
    distinct from every other request's (a pool page belongs to one sequence), so the real
    requests' pages sum to at most ``pool_pages``. Hence, ``ps = page_size``:

    - pages <= ``min(b * P, pool_pages) + (S - b) + sink <= min(S * P, pool_pages + S) +
      sink`` (``b * P + S - b <= S * P`` as ``P >= 1``);
    - mask bytes: request ``i`` takes ``ceil(qo_i * kv_i / 8)``, at most its bits / 8 plus
      one. Every row sees at most ``P * ps`` columns: bytes <= ``Q * P * ps // 8 + S +
      sink``. Or by the pool: real bits <= ``R * ps * (real pages) <= R * ps *
      pool_pages``, a padding request 1 byte, the sink's ``Q - S`` rows at most
      ``ceil((Q - S) / 8)`` bytes: bytes <= ``R * ps * pool_pages // 8 + S + sink *
      ceil((Q - S) / 8)``.

    The first bounds (``S * P``, ``Q * P * ps / 8``) alone grow with the page-table width
    times the bucket; a decoder whose table is as wide as the pool would hold hundreds of
    MB of mask per bucket for a pool that cannot fill them. ``host_sizes(..., out=...)``
    checks a step against the capacities of its buffers.
    """
    S, R, Q, P, ps = num_requests, max_qo_len, max_total_q, max_pages_per_seq, page_size
    if min(S, R, Q, P, ps, pool_pages) < 1:
        raise ValueError(f"padded_step_capacity: sizes must be >= 1, got S={S}, R={R}, "
                         f"Q={Q}, P={P}, page_size={ps}, pool_pages={pool_pages}")
    k = int(sink)
    pages = min(S * P, pool_pages + S) + k
    mask_bytes = min(Q * P * ps // 8 + S + k,
                     R * ps * pool_pages // 8 + S + k * -(-max(Q - S, 0) // 8))
    return pages, mask_bytes


@dataclass
class TreeMetadata:
    """Everything attention and the KV cache need for one tree-verification step.

    ``B`` requests; capacities ``Q`` (query rows), ``P`` (pages), ``M`` (mask bytes) are static.
    Per-row arrays are valid in ``[0, qo_indptr[B])``; the tail is padding with
    ``input_ids = 0``, ``position_ids = 0``, ``kv_slots = -1``.

    Attributes:
        input_ids: ``int32 [Q]`` per request: root token, then its draft tokens.
        position_ids: ``int32 [Q]`` RoPE position ``prefix_len + depth``.
        kv_slots: ``int32 [Q]`` physical cache slot ``page * page_size + offset`` where the
            row's KV is written (logical slot ``prefix_len + r``); -1 for padding rows.
        qo_indptr: ``int32 [B + 1]`` query rows of request ``b`` are
            ``qo_indptr[b] : qo_indptr[b + 1]``.
        kv_indptr: ``int32 [B + 1]`` pages of request ``b`` are
            ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``.
        kv_indices: ``int32 [P]`` page ids, concatenated over requests; 0 past ``kv_indptr[B]``.
        kv_last_page_len: ``int32 [B]`` entries in each request's last page, in
            ``[1, page_size]``; ``kv_len = (num_pages - 1) * page_size + kv_last_page_len``.
        packed_mask: ``uint8 [M]`` FlashInfer's packed custom mask; 0 past ``mask_indptr[B]``.
        mask_indptr: ``int32 [B + 1]`` byte offsets of each request's mask in ``packed_mask``.
        ancestor_bits: ``int32 [B, max_qo_len, ceil(max_qo_len / 32)]`` bit ``t`` of
            ``[b, r]`` is set iff tree row ``t`` is an ancestor-or-self of tree row ``r``.
        page_size: tokens per page.
        max_qo_len: static bound on ``qo_len`` (``1 + DraftBatch.max_nodes``).
        max_kv_len: static bound on ``kv_len`` (page-table width times ``page_size``).
        maybe_tree_mask: ``bool [Q, max_kv_len]`` or None: the unpacked mask, row ``i`` holding
            its request's columns ``0 .. kv_len - 1`` (debugging and tests only).
        maybe_host: :class:`HostSizes` or None: ``qo_indptr``, ``kv_indptr`` and
            ``kv_last_page_len`` on the host, when the planner's caller knew them.
        maybe_prefix: :class:`~agspec_gpu.kernels.prefix_pages.PrefixPages` or None: the
            pages of each request's prefix alone, for a split tree attention (an unmasked
            prefix part, the tree apart: :mod:`agspec_gpu.kernels.tree_attention`); planned
            by ``plan_tree(prefix_pages=True)``.
        has_sink: the last request is a sink (``plan_tree(sink_page=...)``): it has no tree.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    kv_slots: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    packed_mask: torch.Tensor
    mask_indptr: torch.Tensor
    ancestor_bits: torch.Tensor
    page_size: int
    max_qo_len: int
    max_kv_len: int
    maybe_tree_mask: torch.Tensor | None = None
    maybe_host: HostSizes | None = None
    maybe_prefix: PrefixPages | None = None
    has_sink: bool = False

    def __post_init__(self) -> None:
        # plan_tree's views of these buffers by step shape (not a field: filled as planned)
        self._plans: dict[tuple, tuple] = {}
        B = self.kv_last_page_len.shape[0]
        Q = self.input_ids.shape[0]
        for f in fields(self):
            x = getattr(self, f.name)
            if not isinstance(x, torch.Tensor) or f.name in ("packed_mask", "maybe_tree_mask"):
                continue
            if x.dtype != torch.int32:
                raise ValueError(f"{f.name}: expected int32, got {x.dtype}")
            if x.device != self.input_ids.device:
                raise ValueError(f"{f.name}: on {x.device}, input_ids on {self.input_ids.device}")
        if self.packed_mask.dtype != torch.uint8 or self.packed_mask.ndim != 1:
            raise ValueError(f"packed_mask: expected uint8 [M], got {self.packed_mask.dtype} "
                             f"{tuple(self.packed_mask.shape)}")
        if self.packed_mask.device != self.input_ids.device:
            raise ValueError(f"packed_mask: on {self.packed_mask.device}, input_ids on "
                             f"{self.input_ids.device}")
        for name in ("position_ids", "kv_slots"):
            if getattr(self, name).shape != (Q,):
                raise ValueError(f"{name}: expected shape ({Q},), got "
                                 f"{tuple(getattr(self, name).shape)}")
        for name in ("qo_indptr", "kv_indptr", "mask_indptr"):
            if getattr(self, name).shape != (B + 1,):
                raise ValueError(f"{name}: expected shape ({B + 1},), got "
                                 f"{tuple(getattr(self, name).shape)}")
        if self.page_size < 1 or self.max_qo_len < 1 or self.max_kv_len < self.max_qo_len:
            raise ValueError(f"bad static sizes: page_size={self.page_size}, max_qo_len="
                             f"{self.max_qo_len}, max_kv_len={self.max_kv_len}")
        if self.ancestor_bits.shape[:2] != (B, self.max_qo_len):
            raise ValueError(f"ancestor_bits: expected shape ({B}, {self.max_qo_len}, W), got "
                             f"{tuple(self.ancestor_bits.shape)}")
        if self.maybe_tree_mask is not None and (
                self.maybe_tree_mask.dtype != torch.bool
                or self.maybe_tree_mask.shape != (Q, self.max_kv_len)):
            raise ValueError(f"maybe_tree_mask: expected bool [{Q}, {self.max_kv_len}]")
        p = self.maybe_prefix
        if p is not None and (p.kv_indptr.shape != (B + 1,) or p.kv_last_page_len.shape != (B,)
                              or p.prefix_lens.shape != (B,)
                              or any(x.dtype != torch.int32 or x.device != self.input_ids.device
                                     for x in p)):
            raise ValueError(f"maybe_prefix: expected int32 buffers of {B} requests on "
                             f"{self.input_ids.device}")
        h = self.maybe_host
        if h is not None and (h.qo_indptr.shape != (B + 1,) or h.kv_indptr.shape != (B + 1,)
                              or h.kv_last_page_len.shape != (B,)):
            raise ValueError(f"maybe_host: sizes of {h.kv_last_page_len.shape[0]} requests "
                             f"for a step of {B}")

    def with_host(self, host: HostSizes) -> "TreeMetadata":
        """A copy (the same buffers) with ``maybe_host = host``, checked against the batch
        size only (``__post_init__``'s other checks hold for the copy of a checked plan)."""
        B = self.batch_size
        if host.qo_indptr.shape != (B + 1,) or host.kv_indptr.shape != (B + 1,) \
                or host.kv_last_page_len.shape != (B,):
            raise ValueError(f"maybe_host: sizes of {host.kv_last_page_len.shape[0]} requests "
                             f"for a step of {B}")
        meta = copy.copy(self)
        meta.maybe_host = host
        return meta

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def capacity_q(self) -> int:
        """Number of query rows the buffers hold (valid ones: ``qo_indptr[-1]``)."""
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def qo_lens(self) -> torch.Tensor:
        """``int32 [B]`` query rows per request."""
        return self.qo_indptr[1:] - self.qo_indptr[:-1]

    def kv_lens(self) -> torch.Tensor:
        """``int32 [B]`` KV entries per request, the tree's own included."""
        num_pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (num_pages - 1) * self.page_size + self.kv_last_page_len

    @staticmethod
    def empty(max_batch_size: int, max_qo_len: int, max_pages_per_seq: int, page_size: int,
              device: torch.device | str, *, max_total_q: int | None = None,
              max_total_pages: int | None = None, max_mask_bytes: int | None = None,
              shared: tuple[torch.Tensor, ...] | None = None,
              with_prefix: bool = False) -> "TreeMetadata":
        """Preallocated buffers for :func:`plan_tree` ``out=`` (a CUDA-graph-friendly pool).

        Capacities default to the static worst case: ``max_total_q = max_batch_size *
        max_qo_len``, ``max_total_pages = max_batch_size * max_pages_per_seq``,
        ``max_mask_bytes = max_batch_size * ceil(max_qo_len * max_pages_per_seq *
        page_size / 8)``. Smaller values are a contract: the caller's drafts must fit (a
        batch-level token budget does this for ``max_total_q``; :func:`padded_step_capacity`
        bounds pages and mask bytes by the KV pool; ``host_sizes(..., out=...)`` checks).

        ``shared``: ``(int32 [>= P], uint8 [>= M])`` whose first ``P`` and ``M`` entries
        become ``kv_indices`` and ``packed_mask``, for buffers that are never planned at
        once (a runner's graph buckets: one plan a step, read before the next); with
        ``with_prefix`` a third, ``int32 [>= P]``, for the prefix pages.

        ``with_prefix``: also the buffers of ``maybe_prefix`` (``plan_tree(prefix_pages=
        True)``; a request's prefix pages are no more than its pages, so ``P`` holds them).
        """
        B, R = max_batch_size, max_qo_len
        Q = max_total_q if max_total_q is not None else B * R
        P = max_total_pages if max_total_pages is not None else B * max_pages_per_seq
        M = max_mask_bytes if max_mask_bytes is not None else \
            B * (-(-R * max_pages_per_seq * page_size // 8))

        def i32(*shape):
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        if shared is None:
            kv_indices, packed_mask = i32(P), torch.zeros(M, dtype=torch.uint8, device=device)
            prefix_indices = i32(P) if with_prefix else None
        else:
            if shared[0].numel() < P or shared[1].numel() < M or (
                    with_prefix and (len(shared) < 3 or shared[2].numel() < P)):
                raise ValueError(f"shared: {shared[0].numel()} pages and {shared[1].numel()} "
                                 f"mask bytes (and {[x.numel() for x in shared[2:]]} prefix "
                                 f"pages) for capacities of {P} and {M}"
                                 f"{f' and {P} prefix pages' if with_prefix else ''}")
            kv_indices, packed_mask = shared[0][:P], shared[1][:M]
            prefix_indices = shared[2][:P] if with_prefix else None
        prefix = None if not with_prefix else PrefixPages(i32(B + 1), prefix_indices,
                                                          i32(B).fill_(1), i32(B))
        return TreeMetadata(
            input_ids=i32(Q), position_ids=i32(Q), kv_slots=i32(Q), qo_indptr=i32(B + 1),
            kv_indptr=i32(B + 1), kv_indices=kv_indices, kv_last_page_len=i32(B).fill_(1),
            packed_mask=packed_mask,
            mask_indptr=i32(B + 1), ancestor_bits=i32(B, R, -(-R // 32)), page_size=page_size,
            max_qo_len=R, max_kv_len=max(R, max_pages_per_seq * page_size), maybe_prefix=prefix)


def plan_tree(draft: DraftBatch, root_ids: torch.Tensor, prefix_lens: torch.Tensor,
              page_table: torch.Tensor, page_size: int, *, max_total_q: int | None = None,
              out: TreeMetadata | None = None, with_dense_mask: bool = False,
              sink_page: int | None = None, host: HostSizes | None = None,
              prefix_pages: bool = False, use_triton: bool | None = None) -> TreeMetadata:
    """Plans one tree-verification step for a batch, entirely on the device.

    Parameters
    ----------
    draft : DraftBatch
        ``B`` draft trees of at most ``N`` nodes (``num_draft_tokens`` may be 0).
    root_ids : ``int32 [B]``
        The last committed token of each request (its KV is not in the cache yet).
    prefix_lens : ``int32 [B]``
        Tokens of each request already in the KV cache.
    page_table : ``int32 [B, max_pages]``
        Pages of each request in logical order; they must cover ``prefix_len + 1 + N`` slots
        (``PagedKVCache.allocate`` before planning).
    page_size : int
    max_total_q : int, optional
        Query-row capacity when ``out`` is not given (default ``B * (N + 1)``, always enough).
    out : TreeMetadata, optional
        Buffers from :meth:`TreeMetadata.empty` to reuse; the result holds views of them.
    with_dense_mask : bool
        Also unpack the mask into ``maybe_tree_mask`` (debugging; allocates).
    sink_page : int, optional
        Plan a *sink* as request ``B`` (``out`` must hold ``B + 1`` requests): the rows
        past the batch's, up to ``out``'s capacity, over one KV entry on page ``sink_page``
        (see :func:`agspec_gpu.kernels.tree_mask.tree_mask`); the result then describes
        ``B + 1`` requests. A CUDA graph of a fixed row count needs it.
    host : HostSizes, optional
        The step's sizes on the host (:func:`host_sizes` of the same sizes), kept as
        ``maybe_host`` for FlashInfer's plan; they must equal what this plans. The
        kernels drop what exceeds ``out``'s capacities (a check of the sizes they compute
        would wait for the device): ``host_sizes(..., out=out)`` checks on the host.
    prefix_pages : bool
        Also plan ``maybe_prefix``, each request's prefix pages alone
        (:func:`agspec_gpu.kernels.prefix_pages.prefix_pages`), for a split tree attention;
        ``out`` must hold its buffers (``TreeMetadata.empty(with_prefix=True)``).
    use_triton : bool, optional
        Forwarded to :func:`agspec_gpu.kernels.tree_mask.tree_mask` (and ``prefix_pages``).

    Returns
    -------
    TreeMetadata

    Example
    -------
    >>> d = DraftBatch.from_lists([[(7, -1), (8, 0)]])         # root -> 7 -> 8
    >>> m = plan_tree(d, torch.tensor([5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
    ...               torch.tensor([[0, 1]], dtype=torch.int32), page_size=4)
    >>> m.position_ids[:3].tolist(), m.kv_last_page_len.tolist()
    ([3, 4, 5], [2])
    """
    B, N = draft.token_ids.shape
    device = draft.token_ids.device
    R = N + 1
    max_pages = page_table.shape[1] if page_table.dim() == 2 else 0
    check_ints(("page_size", page_size, 1, 2 ** 31))  # before it sizes any buffer
    if root_ids.shape != (B,) or prefix_lens.shape != (B,):
        raise ValueError(f"root_ids, prefix_lens: expected shape ({B},), got "
                         f"{tuple(root_ids.shape)}, {tuple(prefix_lens.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table: expected shape ({B}, max_pages), got "
                         f"{tuple(page_table.shape)}")
    if out is None:  # with the host's sizes, the step's own pages and mask bytes
        out = TreeMetadata.empty(
            B, R, max_pages, page_size, device, max_total_q=max_total_q,
            max_total_pages=None if host is None else int(host.kv_indptr[-1]),
            max_mask_bytes=None if host is None else host.num_mask_bytes,
            with_prefix=prefix_pages)
    elif out.batch_size < B or out.max_qo_len < R or out.page_size != page_size:
        raise ValueError(f"out: buffers for batch {out.batch_size}, max_qo_len "
                         f"{out.max_qo_len}, page_size {out.page_size} cannot plan batch {B}, "
                         f"max_qo_len {R}, page_size {page_size}")
    if max_pages * page_size > out.max_kv_len:
        raise ValueError(f"page_table: {max_pages} pages of {page_size} exceed out.max_kv_len="
                         f"{out.max_kv_len}")
    if max_total_q is not None and out.capacity_q < max_total_q:
        raise ValueError(f"out holds {out.capacity_q} rows < max_total_q={max_total_q}")
    check_sink_page(sink_page)  # (out's checks, cached per shape, saw another step's)
    nb = B + (sink_page is not None)  # requests planned, the sink included
    if out.batch_size < nb:
        raise ValueError(f"out: buffers for batch {out.batch_size} cannot plan {B} requests "
                         f"and a sink")
    if prefix_pages and out.maybe_prefix is None:
        raise ValueError("out: no prefix-page buffers for prefix_pages=True (TreeMetadata."
                         "empty(with_prefix=True))")

    # the step's views of out, and out's checks, made once per shape: a planner reusing its
    # buffers pays a step only for the checks of its inputs and the launch (the views, the
    # result's checks and out's took ~35 us of a step's host time when rebuilt every step)
    key = (nb, B, R, max_pages, page_size, prefix_pages)
    views = out._plans.get(key)
    if views is None:
        if len(out._plans) >= _MAX_PLAN_SHAPES:  # a pool planned at page-table widths that
            out._plans.clear()                   # keep growing: start over, stay bounded
        views = out._plans[key] = _plan_views(out, nb, B, N, max_pages, page_size, sink_page,
                                              prefix_pages)
    buffers, planned = views
    tok, par, num, root, prefix, table = (_int32(x) for x in (
        draft.token_ids, draft.parents, draft.num_draft_tokens, root_ids, prefix_lens,
        page_table))
    check_tree_inputs(tok, par, num, root, prefix, table, page_size)
    # sizes, indptrs, rows, pages and mask (and the sink): two kernels on a GPU
    launch_tree_mask(tok, par, num, root, prefix, table, page_size, buffers,
                     sink_page=sink_page, use_triton=use_triton)
    if prefix_pages:
        plan_prefix_pages(prefix, table, page_size, planned.maybe_prefix, sink_page=sink_page,
                          use_triton=use_triton)
    meta = planned if host is None else planned.with_host(host)
    if with_dense_mask:
        dense = unpack_mask(meta)  # [B, R, max_kv_len]
        rows = meta.qo_indptr[:-1, None].long() + torch.arange(R, device=device)[None, :]
        valid = torch.arange(R, device=device)[None, :] < meta.qo_lens()[:, None]
        tree = torch.zeros(meta.capacity_q, meta.max_kv_len, dtype=torch.bool, device=device)
        tree[rows[valid]] = dense[valid]
        if sink_page is not None:  # the sink's rows, R of them or more, see its one KV entry
            at = torch.arange(meta.capacity_q, device=device)
            tree[:, 0] |= (at >= meta.qo_indptr[B]) & (at < meta.qo_indptr[B + 1])
        meta = replace(meta, maybe_tree_mask=tree)
    return meta


_MAX_PLAN_SHAPES = 256  # step shapes whose views a buffer pool keeps (a few KB each)


def _int32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as int32 and contiguous (no op, and none of a no-op's host time, when it is)."""
    x = cast(x, torch.int32)
    return x if x.is_contiguous() else x.contiguous()


def _plan_views(out: TreeMetadata, nb: int, B: int, N: int, max_pages: int, page_size: int,
                sink_page: int | None, prefix_pages: bool
                ) -> tuple[TreeMaskBuffers, TreeMetadata]:
    """The buffers :func:`plan_tree` hands the kernels and the metadata it returns for a
    step of ``nb`` planned requests (``B`` and the sink) of ``N``-node drafts: views of
    ``out``, checked once."""
    R, W = N + 1, -(-(N + 1) // 32)
    qo_indptr, kv_indptr, mask_indptr = (x[:nb + 1] for x in
                                         (out.qo_indptr, out.kv_indptr, out.mask_indptr))
    kv_last_page_len = out.kv_last_page_len[:nb]
    ancestor_bits = out.ancestor_bits.view(-1)[:nb * R * W].view(nb, R, W)
    buffers = TreeMaskBuffers(qo_indptr, kv_indptr, mask_indptr, kv_last_page_len,
                              out.input_ids, out.position_ids, out.kv_slots, out.kv_indices,
                              out.packed_mask, ancestor_bits[:B])
    check_tree_out(buffers, B, N, out.device, sink_page)
    prefix = None
    if prefix_pages:
        p = out.maybe_prefix
        prefix = PrefixPages(p.kv_indptr[:nb + 1], p.kv_indices, p.kv_last_page_len[:nb],
                             p.prefix_lens[:nb])
        check_prefix_out(prefix, nb, out.device)
    meta = replace(out, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_indptr=mask_indptr,
                   kv_last_page_len=kv_last_page_len, ancestor_bits=ancestor_bits,
                   max_qo_len=R, max_kv_len=max(R, max_pages * page_size), maybe_tree_mask=None,
                   maybe_host=None, maybe_prefix=prefix, has_sink=sink_page is not None)
    return buffers, meta


def unpack_mask(meta: TreeMetadata) -> torch.Tensor:
    """Unpacks ``meta.packed_mask`` into ``bool [B, max_qo_len, max_kv_len]``.

    Entry ``[b, r, c]`` is bit ``e % 8`` of byte ``mask_indptr[b] + e // 8`` with
    ``e = r * kv_len[b] + c``; rows ``>= qo_len[b]`` and columns ``>= kv_len[b]`` are False.
    """
    dev = meta.device
    R, K = meta.max_qo_len, meta.max_kv_len
    qo_len = meta.qo_lens().long()[:, None, None]
    kv_len = meta.kv_lens().long()[:, None, None]
    r = torch.arange(R, device=dev)[None, :, None]
    c = torch.arange(K, device=dev)[None, None, :]
    valid = (r < qo_len) & (c < kv_len)
    e = r * kv_len + c
    byte_idx = (meta.mask_indptr[:-1].long()[:, None, None] + e // 8)
    byte_idx = torch.where(valid, byte_idx, 0).clamp(max=meta.packed_mask.numel() - 1)
    bits = (meta.packed_mask[byte_idx].to(torch.int32) >> (e % 8).to(torch.int32)) & 1
    return valid & (bits != 0)
