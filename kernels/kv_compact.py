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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_COLS = 1024


@triton.jit
def _kv_compact_kernel(
    kv_ptr,  # *T [L, num_pages, 2, page_size, ROW]  paged cache of every layer (NHD)
    page_table_ptr,  # *int32 [B, max_pages]
    prefix_lens_ptr,  # *int32 [B]
    accepted_ptr,  # *int32 [B, A]  accepted node indices in path order, -1 padded
    stride_layer,  # elements between layers
    stride_page,  # elements between pages
    max_pages,
    A,
    page_size,
    ROW,  # num_kv_heads * head_dim
    BLOCK_COLS: tl.constexpr,
):
    """Grid ``(2 * column blocks, L, B)``: keys/values x column block, layer, request.

    For ``i = 0 .. A - 1`` with ``node = accepted[b, i] >= 0`` and ``node != i``, copies
    columns ``[blk * BLOCK_COLS, ...)`` of the row at logical slot ``prefix + 1 + node`` to
    logical slot ``prefix + 1 + i``. A row of ``ROW`` elements is contiguous (NHD); the row of
    logical slot ``s`` of layer ``l`` starts at ``l * stride_layer + page_table[b, s //
    page_size] * stride_page + kv * page_size * ROW + (s % page_size) * ROW``.
    """
    pid = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    kv = pid % 2
    cols = (pid // 2) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    cmask = cols < ROW
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int64)
    base = kv_ptr + layer * stride_layer + kv * page_size * ROW
    i = tl.zeros((), tl.int64)
    while i < A:
        node = tl.load(accepted_ptr + b * A + i).to(tl.int64)
        src = prefix + 1 + node
        dst = prefix + 1 + i
        active = (node >= 0) & (node != i) & (src // page_size < max_pages)
        src_page = tl.load(page_table_ptr + b * max_pages + src // page_size, mask=active,
                           other=0).to(tl.int64)
        dst_page = tl.load(page_table_ptr + b * max_pages + dst // page_size, mask=active,
                           other=0).to(tl.int64)
        row = tl.load(base + src_page * stride_page + (src % page_size) * ROW + cols,
                      mask=cmask & active)
        tl.store(base + dst_page * stride_page + (dst % page_size) * ROW + cols, row,
                 mask=cmask & active)
        i += 1


def kv_compact_torch(kv_data: torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor,
                     accepted_nodes: torch.Tensor) -> None:
    """Pure-torch implementation of :func:`kv_compact` (same moves, same order, in place)."""
    B, A = accepted_nodes.shape
    page_size, max_pages = kv_data.shape[3], page_table.shape[1]
    prefix = prefix_lens.long()
    for i in range(A):  # sequential in i: see the module docstring
        node = accepted_nodes[:, i].long()
        src, dst = prefix + 1 + node, prefix + 1 + i
        active = (node >= 0) & (node != i) & (src // page_size < max_pages)
        b = torch.nonzero(active)[:, 0]
        src_page = page_table[b, src[b] // page_size].long()
        dst_page = page_table[b, dst[b] // page_size].long()
        kv_data[:, dst_page, :, dst[b] % page_size] = kv_data[:, src_page, :, src[b] % page_size]


def kv_compact(kv_data: torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor,
               accepted_nodes: torch.Tensor, *, use_triton: bool | None = None) -> None:
    """Moves the KV of each request's accepted draft nodes to consecutive slots, in place.

    Parameters
    ----------
    kv_data : ``[L, num_pages, 2, page_size, H_kv, D]``
        The paged cache of every layer (``PagedKVCache.data``), modified in place.
    page_table : ``int32 [B, max_pages]``
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
    for name, x, nd in (("page_table", page_table, 2), ("prefix_lens", prefix_lens, 1),
                        ("accepted_nodes", accepted_nodes, 2)):
        if x.dtype != torch.int32:
            raise ValueError(f"{name}: expected dtype torch.int32, got {x.dtype}")
        if x.dim() != nd:
            raise ValueError(f"{name}: expected {nd} dims, got shape {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}: on {x.device}, kv_data on {device}")
        if not x.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    B, A = accepted_nodes.shape
    if page_table.shape[0] != B or prefix_lens.shape[0] != B:
        raise ValueError(f"page_table, prefix_lens: expected {B} rows, got "
                         f"{page_table.shape[0]}, {prefix_lens.shape[0]}")
    if B == 0 or A == 0:
        return
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        kv_compact_torch(kv_data, page_table, prefix_lens, accepted_nodes)
        return
    L, _, _, page_size, H, D = kv_data.shape
    row = H * D
    block = min(MAX_BLOCK_COLS, triton.next_power_of_2(row))
    _kv_compact_kernel[(2 * triton.cdiv(row, block), L, B)](
        kv_data, page_table, prefix_lens, accepted_nodes, kv_data.stride(0), kv_data.stride(1),
        page_table.shape[1], A, page_size, row, BLOCK_COLS=block)
