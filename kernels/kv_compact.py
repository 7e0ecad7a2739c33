"""Commit the accepted path of a verified draft tree: compact its KV in the paged cache.

During verification request ``b``'s tree row ``r`` (root ``r = 0``, draft node ``j`` at
``r = j + 1``) wrote its KV at logical slot ``prefix_len + r``. After acceptance the sequence
continues with the root and the accepted nodes ``a_0 < a_1 < ...`` (a root-to-leaf path, so
node indices increase), which must sit at consecutive slots: node ``a_i`` moves from slot
``prefix_len + 1 + a_i`` to ``prefix_len + 1 + i``. The root stays where it is.

In-place safety: ``a_i >= i`` (the ``a_i`` are distinct and increase), so every move goes to a
lower-or-equal slot, and the source of a later move ``k > i`` is slot ``prefix_len + 1 + a_k``
with ``a_k >= k > i``: no move ``i`` overwrites a later move's source. Moves are therefore done
one after another in increasing ``i``. In the kernel one program streams a fixed column block of
the row through every ``i`` with the same register layout, so each element is read and
written by the same thread in program order.

Pages come in the verification plan's own layout (FlashInfer's paged-KV ``kv_indptr`` /
``kv_indices``, :class:`~agspec_gpu.tree.TreeMetadata`): the commit moves KV within the pages
the step just wrote, with no page table rebuilt for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_array
from agspec_gpu.kernels._launch import cdiv, next_pow2

MAX_BLOCK_COLS = 1024


# the batch's page count and accepted width change every step: not specialized (the
# strides and the row width, the cache's layout, are)
# the plan's and the step's arrays may be views (of a plan's buffers, of a staging ring):
# their alignment is not specialized
@triton.jit(do_not_specialize=["num_indices", "num_cache_pages", "A"],
            do_not_specialize_on_alignment=["kv_indptr_ptr", "kv_indices_ptr", "prefix_lens_ptr",
                                            "accepted_ptr"])
def _kv_compact_kernel(
    kv_ptr,  # *T [L, num_pages, 2, page_size, ROW]  paged cache of every layer (NHD)
    kv_indptr_ptr,  # *int32 [>= B + 1]  request b's pages: kv_indices[kv_indptr[b]:[b + 1]]
    kv_indices_ptr,  # *int32 [num_indices]  page ids in logical order, requests concatenated
    prefix_lens_ptr,  # *int32 [B]
    accepted_ptr,  # *int32 [B, A]  accepted node indices in path order, -1 padded
    stride_layer,  # elements between layers
    stride_page,  # elements between pages
    num_indices,
    num_cache_pages,
    A,
    page_size,
    ROW,  # num_kv_heads * head_dim
    BLOCK_COLS: tl.constexpr,
):
    """Grid ``(B, L, 2 * column blocks)``: request, layer, keys/values x column block.

    For ``i = 0 .. A - 1`` with ``node = accepted[b, i] >= 0`` and ``node != i``, copies
    columns ``[blk * BLOCK_COLS, ...)`` of the row at logical slot ``prefix + 1 + node`` to
    logical slot ``prefix + 1 + i``. A row of ``ROW`` elements is contiguous (NHD); the row of
    logical slot ``s`` of layer ``l`` starts at ``l * stride_layer + kv_indices[kv_indptr[b] +
    s // page_size] * stride_page + kv * page_size * ROW + (s % page_size) * ROW``. A move
    whose source page is not among request ``b``'s (or not in ``kv_indices``), whose page ids
    are not the cache's, or whose prefix is negative is skipped.
    """
    b = tl.program_id(0).to(tl.int64)  # the batch on axis 0: up to 2**31 - 1 requests
    layer = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(2).to(tl.int64)
    kv = pid % 2
    cols = (pid // 2) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    cmask = cols < ROW
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int64)
    first = tl.load(kv_indptr_ptr + b).to(tl.int64)
    num_pages = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - first
    base = kv_ptr + layer * stride_layer + kv * page_size * ROW
    i = tl.zeros((), tl.int64)
    while i < A:
        node = tl.load(accepted_ptr + b * A + i).to(tl.int64)
        src = prefix + 1 + node
        dst = prefix + 1 + i
        # dst < src: a source page among the request's means the destination's is too
        active = (node >= 0) & (node != i) & (src // page_size < num_pages) & \
            (first + src // page_size < num_indices) & (first >= 0) & (prefix >= 0)
        src_page = tl.load(kv_indices_ptr + first + src // page_size, mask=active,
                           other=0).to(tl.int64)
        dst_page = tl.load(kv_indices_ptr + first + dst // page_size, mask=active,
                           other=0).to(tl.int64)
        active = active & (src_page >= 0) & (src_page < num_cache_pages) & (dst_page >= 0) & \
            (dst_page < num_cache_pages)  # never outside the cache
        row = tl.load(base + src_page * stride_page + (src % page_size) * ROW + cols,
                      mask=cmask & active)
        tl.store(base + dst_page * stride_page + (dst % page_size) * ROW + cols, row,
                 mask=cmask & active)
        i += 1


def kv_compact_torch(kv_data: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, accepted_nodes: torch.Tensor) -> None:
    """Pure-torch implementation of :func:`kv_compact` (same moves, same order, in place)."""
    B, A = accepted_nodes.shape
    P, page_size = kv_data.shape[1], kv_data.shape[3]
    prefix = prefix_lens.long()
    first = kv_indptr[:B].long()
    num_pages = kv_indptr[1:B + 1].long() - first
    for i in range(A):  # sequential in i: see the module docstring
        node = accepted_nodes[:, i].long()
        src, dst = prefix + 1 + node, prefix + 1 + i
        active = (node >= 0) & (node != i) & (src // page_size < num_pages) & \
            (first + src // page_size < kv_indices.numel()) & (first >= 0) & (prefix >= 0)
        b = torch.nonzero(active)[:, 0]
        src_page = kv_indices[first[b] + src[b] // page_size].long()
        dst_page = kv_indices[first[b] + dst[b] // page_size].long()
        ok = (src_page >= 0) & (src_page < P) & (dst_page >= 0) & (dst_page < P)
        b, src_page, dst_page = b[ok], src_page[ok], dst_page[ok]
        kv_data[:, dst_page, :, dst[b] % page_size] = kv_data[:, src_page, :, src[b] % page_size]


def kv_compact(kv_data: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
               prefix_lens: torch.Tensor, accepted_nodes: torch.Tensor, *,
               use_triton: bool | None = None) -> None:
    """Moves the KV of each request's accepted draft nodes to consecutive slots, in place.

    Parameters
    ----------
    kv_data : ``[L, num_pages, 2, page_size, H_kv, D]``
        The paged cache of every layer (``PagedKVCache.data``), modified in place.
    kv_indptr : ``int32 [>= B + 1]``
        Request ``b``'s pages are ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``, in logical
        order: the verification plan's (``TreeMetadata.kv_indptr``; a padded plan's extra
        requests are not read). A move whose source lies past them, whose page ids are not
        in ``[0, num_pages)``, or whose ``prefix_len`` is negative is skipped.
    kv_indices : ``int32 [num_indices]``
        Page ids (``TreeMetadata.kv_indices``).
    prefix_lens : ``int32 [B]``
        Slots before the root (the root's KV is at slot ``prefix_len`` and stays).
    accepted_nodes : ``int32 [B, A]``
        Accepted draft-node indices of each request in path order (increasing), root
        excluded, ``-1`` padded at the end. Request ``b``'s sequence then holds
        ``prefix_len + 1 + num_accepted`` valid slots.
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors.

    Example
    -------
    >>> # prefix 4, accepted [1, 3]: slot 6 -> 5, slot 8 -> 6; slot 4 (root) untouched
    """
    device = kv_data.device
    if kv_data.dim() != 6 or kv_data.shape[2] != 2:
        raise ValueError(f"kv_data: expected [L, num_pages, 2, page_size, H, D], got "
                         f"{tuple(kv_data.shape)}")
    if not kv_data.is_contiguous():
        raise ValueError("kv_data: must be contiguous")
    for name, x, nd in (("kv_indptr", kv_indptr, 1), ("kv_indices", kv_indices, 1),
                        ("prefix_lens", prefix_lens, 1), ("accepted_nodes", accepted_nodes, 2)):
        check_array(name, x, torch.int32, nd, device)
    B, A = accepted_nodes.shape
    if prefix_lens.shape[0] != B:
        raise ValueError(f"prefix_lens: expected {B} entries, got {prefix_lens.shape[0]}")
    if kv_indptr.shape[0] < B + 1:
        raise ValueError(f"kv_indptr: expected at least {B + 1} entries, got "
                         f"{kv_indptr.shape[0]}")
    if B == 0 or A == 0:
        return
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        kv_compact_torch(kv_data, kv_indptr, kv_indices, prefix_lens, accepted_nodes)
        return
    L, _, _, page_size, H, D = kv_data.shape
    row = H * D
    block = min(MAX_BLOCK_COLS, next_pow2(row))
    _kv_compact_kernel[(B, L, 2 * cdiv(row, block))](
        kv_data, kv_indptr, kv_indices, prefix_lens, accepted_nodes, kv_data.stride(0),
        kv_data.stride(1), kv_indices.shape[0], kv_data.shape[1], A, page_size, row,
        BLOCK_COLS=block)
