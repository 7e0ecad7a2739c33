"""Tree-attention plan: query rows, KV slots, page lists and FlashInfer's packed custom mask.

For every request ``b`` the verify input is its root token (the last committed token, whose KV
is not in the cache yet) followed by its draft nodes; tree row ``r`` is the root for ``r = 0``
and draft node ``r - 1`` otherwise. The KV of row ``r`` is written at logical slot
``prefix_lens[b] + r`` (node order); its RoPE position is ``prefix_lens[b] + depth(r)``.

The custom mask follows FlashInfer's layout (``BatchPrefillWithPagedKVCacheWrapper.plan(...,
packed_custom_mask=...)``): per request a row-major boolean ``[qo_len, kv_len]`` matrix with
``kv_len = prefix_len + qo_len`` (a row sees every prefix column and its ancestors-or-self in
the tree), flattened, bit-packed little-endian (bit ``i`` of byte ``j`` is element ``8j + i``,
``flashinfer.quantization.segment_packbits(..., bitorder="little")``), each request padded to a
whole byte and the requests concatenated at byte offsets ``mask_indptr``.

Two launches and nothing else: ``_tree_rows_kernel`` (one program per request) sums the
batch's sizes into the indptrs, builds the ancestor bitsets and fills the per-row and per-page
arrays; ``_tree_mask_kernel`` packs the mask bytes in parallel, reading those bitsets. Both
write the padding of their buffers' tails themselves (a step would otherwise launch a dozen
small ops around them: sizes, prefix sums, fills). Inputs beyond a buffer's capacity are
dropped, never written out of bounds: the capacities are a contract with the caller, who sizes
them (no host sync here).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_array, check_ints, check_sink_page
from agspec_gpu.kernels._launch import cdiv, next_pow2

BLOCK_ROWS = 128
BLOCK_PAGES = 128
BLOCK_BYTES = 128
MAX_MASK_PROGRAMS = 4096  # the mask kernel's grid at most (its programs loop over the rest)


class TreeMaskBuffers(NamedTuple):
    """Outputs of :func:`tree_mask` (capacities ``Q``, ``P``, ``M``; tails are padding).

    Attributes:
        qo_indptr: ``int32 [B + 1]`` cumulative ``qo_len = 1 + num_draft_tokens``.
        kv_indptr: ``int32 [B + 1]`` cumulative page counts ``ceil(kv_len / page_size)``,
            ``kv_len = prefix_len + qo_len``.
        mask_indptr: ``int32 [B + 1]`` cumulative mask bytes ``ceil(qo_len * kv_len / 8)``.
        kv_last_page_len: ``int32 [B]`` entries in each request's last page, in
            ``[1, page_size]``.
        input_ids: ``int32 [Q]`` root token, then draft tokens, per request; 0 in padding.
        position_ids: ``int32 [Q]`` ``prefix_len + depth``; 0 in padding.
        kv_slots: ``int32 [Q]`` physical cache slot ``page * page_size + offset``; -1 in padding.
        kv_indices: ``int32 [P]`` the requests' pages, concatenated; 0 in padding.
        packed_mask: ``uint8 [M]`` FlashInfer's packed custom mask; 0 in padding.
        ancestor_bits: ``int32 [B, R, W]`` bit ``t`` of ``[b, r]`` is set iff tree row ``t`` is
            an ancestor-or-self of tree row ``r`` (row 0 is the root); 0 in padding rows.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    mask_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    kv_slots: torch.Tensor
    kv_indices: torch.Tensor
    packed_mask: torch.Tensor
    ancestor_bits: torch.Tensor


@triton.jit
def _popcount32(x):
    """Set bits per int32 lane (SWAR), as int32."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _request_sizes(b, num_draft_ptr, prefix_lens_ptr, B, N, page_size, BLOCK_B: tl.constexpr):
    """Request ``b``'s ``(qo_start, qo_len, kv_start, num_pages, m_start, num_bytes, kv_len)``
    and the batch's ``(total_q, total_pages, total_bytes)``: sums over one block of the
    batch's sizes (``qo_len = 1 + clamp(num_draft, 0, N)``, ``kv_len = max(prefix, 0) +
    qo_len``), as int64."""
    i = tl.arange(0, BLOCK_B)
    inb = i < B
    qo = tl.where(inb, 1 + tl.minimum(tl.maximum(
        tl.load(num_draft_ptr + i, mask=inb, other=0).to(tl.int64), 0), N), 0)
    kv = tl.maximum(tl.load(prefix_lens_ptr + i, mask=inb, other=0).to(tl.int64), 0) + qo
    pages = tl.where(inb, (kv + page_size - 1) // page_size, 0)
    nbytes = tl.where(inb, (qo * kv + 7) // 8, 0)
    before = i < b
    own = i == b
    return (tl.sum(tl.where(before, qo, 0), axis=0), tl.sum(tl.where(own, qo, 0), axis=0),
            tl.sum(tl.where(before, pages, 0), axis=0), tl.sum(tl.where(own, pages, 0), axis=0),
            tl.sum(tl.where(before, nbytes, 0), axis=0),
            tl.sum(tl.where(own, nbytes, 0), axis=0), tl.sum(tl.where(own, kv, 0), axis=0),
            tl.sum(qo, axis=0), tl.sum(pages, axis=0), tl.sum(nbytes, axis=0))


# every int below but page_size follows the step (batch, widths, totals): not specialized,
# so a plan compiles once per block config however the sizes fall
# the step's inputs may be views of a staging ring (an e2e replay step's drafts, roots and
# prefix lengths start anywhere in it): their alignment is not specialized either
@triton.jit(do_not_specialize=["B", "N", "max_pages", "R", "W", "Q", "P", "sink_page"],
            do_not_specialize_on_alignment=[
                "token_ids_ptr", "parents_ptr", "num_draft_ptr", "root_ids_ptr", "prefix_lens_ptr",
                "page_table_ptr"])
def _tree_rows_kernel(
    token_ids_ptr,  # *int32 [B, N]  draft tokens
    parents_ptr,  # *int32 [B, N]  parent node, -1 for root children
    num_draft_ptr,  # *int32 [B]  draft nodes per request
    root_ids_ptr,  # *int32 [B]
    prefix_lens_ptr,  # *int32 [B]  tokens already in the KV cache
    page_table_ptr,  # *int32 [B, max_pages]
    qo_indptr_ptr,  # *int32 [B + 1]  out
    kv_indptr_ptr,  # *int32 [B + 1]  out
    mask_indptr_ptr,  # *int32 [B + 1]  out
    last_page_len_ptr,  # *int32 [B]  out
    input_ids_ptr,  # *int32 [Q]  out
    position_ids_ptr,  # *int32 [Q]  out
    kv_slots_ptr,  # *int32 [Q]  out
    kv_indices_ptr,  # *int32 [P]  out
    ancestors_ptr,  # *int32 [B, R, W]  out
    B,
    N,
    max_pages,
    R,
    W,
    Q,
    P,
    page_size,
    sink_page,  # HAS_SINK: the page of the sink's one KV entry
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """One program per request.

    Sizes: each program sums the batch's sizes before its own (``_request_sizes``) and
    writes its indptr entries; program 0 writes the leading zeros. Ancestor bitsets: rows are
    in topological order (a parent's row is smaller), so ``anc[r] = anc[parent_row(r)] |
    {r}`` is filled by one sequential pass over the rows; the depth of row ``r`` is
    ``popcount(anc[r]) - 1``. Row ``r`` stores the words that row ``parent_row(r)`` stored
    in an earlier iteration; a barrier per iteration makes those stores visible to every
    thread of the program. Rows, slots and pages are then written in vectorised blocks, and
    the tails past the batch's rows and pages (padding) in blocks strided over the programs.
    ``HAS_SINK``: the last program also plans the sink, request ``B``.
    Memory layout: ``anc`` is ``[B, R, W]`` row-major int32 words (bit ``t % 32`` of word
    ``t // 32``).
    """
    b = tl.program_id(0).to(tl.int64)
    qo_start, qo_len, kv_start, num_pages, m_start, num_bytes, kv_len, total_q, total_pages, \
        total_bytes = _request_sizes(b, num_draft_ptr, prefix_lens_ptr, B, N, page_size,
                                     BLOCK_B)
    tl.store(qo_indptr_ptr + b + 1, (qo_start + qo_len).to(tl.int32))
    tl.store(kv_indptr_ptr + b + 1, (kv_start + num_pages).to(tl.int32))
    tl.store(mask_indptr_ptr + b + 1, (m_start + num_bytes).to(tl.int32))
    tl.store(last_page_len_ptr + b, (kv_len - (num_pages - 1) * page_size).to(tl.int32))
    first = b == 0
    tl.store(qo_indptr_ptr, 0, mask=first)
    tl.store(kv_indptr_ptr, 0, mask=first)
    tl.store(mask_indptr_ptr, 0, mask=first)
    if HAS_SINK:  # request B: the rows past the batch's over one KV entry (the last program)
        last = b == B - 1
        tl.store(qo_indptr_ptr + B + 1, (total_q * 0 + Q).to(tl.int32), mask=last)
        tl.store(kv_indptr_ptr + B + 1, (total_pages + 1).to(tl.int32), mask=last)
        tl.store(kv_indices_ptr + total_pages, (total_pages * 0 + sink_page).to(tl.int32),
                 mask=last & (total_pages < P))
        tl.store(last_page_len_ptr + B, 1, mask=last)
        sink_bytes = (tl.maximum(Q - total_q, 0) + 7) // 8
        tl.store(mask_indptr_ptr + B + 1, (total_bytes + sink_bytes).to(tl.int32), mask=last)
    prefix = tl.maximum(tl.load(prefix_lens_ptr + b).to(tl.int64), 0)
    anc_base = ancestors_ptr + b * R * W
    words = tl.arange(0, BLOCK_W)
    wmask = words < W

    # root row: itself only, depth 0 (qo_len >= 1). A row whose slot is past the page
    # table is padding (position 0), as in the row pass below.
    tl.store(anc_base + words, (words == 0).to(tl.int32), mask=wmask)
    tl.store(position_ids_ptr + qo_start,
             tl.where(prefix // page_size < max_pages, prefix, 0).to(tl.int32),
             mask=qo_start < Q)
    tl.debug_barrier()
    # while loops, not range(runtime bound): the interpreter cannot index with a loaded value
    r = tl.zeros((), tl.int64) + 1
    while r < qo_len:  # qo_len <= N + 1 <= R: the clamp keeps every row in bounds
        parent_row = tl.load(parents_ptr + b * N + (r - 1)) + 1
        parent_row = tl.minimum(tl.maximum(parent_row.to(tl.int64), 0), r - 1)
        row = tl.load(anc_base + parent_row * W + words, mask=wmask, other=0)
        own_bit = (tl.full([BLOCK_W], 1, tl.int64) << (r % 32)).to(tl.int32)
        row = row | tl.where(words == r // 32, own_bit, 0)
        tl.store(anc_base + r * W + words, row, mask=wmask)
        depth = tl.sum(_popcount32(row), axis=0) - 1
        tl.store(position_ids_ptr + qo_start + r,
                 tl.where((prefix + r) // page_size < max_pages, prefix + depth, 0).to(tl.int32),
                 mask=qo_start + r < Q)
        tl.debug_barrier()
        r += 1
    while r < R:  # rows past the request's: no ancestors
        tl.store(anc_base + r * W + words, tl.zeros([BLOCK_W], tl.int32), mask=wmask)
        r += 1

    root_id = tl.load(root_ids_ptr + b)
    r0 = tl.zeros((), tl.int64)
    while r0 < qo_len:
        rows = r0 + tl.arange(0, BLOCK_R)
        logical = prefix + rows
        page_col = logical // page_size
        mine = (rows < qo_len) & (qo_start + rows < Q)
        valid = mine & (page_col < max_pages)  # a page table too short: padding rows
        tok = tl.load(token_ids_ptr + b * N + rows - 1, mask=valid & (rows > 0), other=0)
        tok = tl.where(rows == 0, root_id, tok)
        page = tl.load(page_table_ptr + b * max_pages + page_col, mask=valid, other=0)
        slot = page.to(tl.int64) * page_size + logical % page_size
        tl.store(input_ids_ptr + qo_start + rows, tl.where(valid, tok, 0), mask=mine)
        tl.store(kv_slots_ptr + qo_start + rows, tl.where(valid, slot, -1).to(tl.int32),
                 mask=mine)
        r0 += BLOCK_R

    p0 = tl.zeros((), tl.int64)
    while p0 < num_pages:
        cols = p0 + tl.arange(0, BLOCK_P)
        mine = (cols < num_pages) & (kv_start + cols < P)
        page = tl.load(page_table_ptr + b * max_pages + cols, mask=mine & (cols < max_pages),
                       other=0)
        tl.store(kv_indices_ptr + kv_start + cols, page, mask=mine)
        p0 += BLOCK_P

    # the tails past the batch's rows and pages, block k by program k % B
    t = total_q + b * BLOCK_R
    while t < Q:
        rows = t + tl.arange(0, BLOCK_R)
        tail = rows < Q
        tl.store(input_ids_ptr + rows, tl.zeros([BLOCK_R], tl.int32), mask=tail)
        tl.store(position_ids_ptr + rows, tl.zeros([BLOCK_R], tl.int32), mask=tail)
        tl.store(kv_slots_ptr + rows, tl.full([BLOCK_R], -1, tl.int32), mask=tail)
        t += B * BLOCK_R
    t = total_pages + b * BLOCK_P
    if HAS_SINK:  # the sink's page
        t += 1
    while t < P:
        cols = t + tl.arange(0, BLOCK_P)
        tl.store(kv_indices_ptr + cols, tl.zeros([BLOCK_P], tl.int32), mask=cols < P)
        t += B * BLOCK_P


@triton.jit
def _mask_bytes(j, total, prefix_lens_ptr, qo_indptr_ptr, mask_indptr_ptr, ancestors_ptr, B, R,
                W, BLOCK_BYTES: tl.constexpr):
    """``int32 [BLOCK_BYTES]``: flat mask bytes ``j`` (those ``< total``; 0 elsewhere)."""
    live = j < total
    lo = tl.zeros([BLOCK_BYTES], tl.int64)  # mask_indptr[lo] <= j < mask_indptr[hi]
    hi = tl.zeros([BLOCK_BYTES], tl.int64) + B
    span = B  # the largest hi - lo
    while span > 1:
        mid = (lo + hi) // 2
        go = tl.load(mask_indptr_ptr + mid, mask=live, other=0).to(tl.int64) <= j
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
        span = (span + 1) // 2
    b = lo
    qo_start = tl.load(qo_indptr_ptr + b, mask=live, other=0).to(tl.int64)
    qo_len = tl.load(qo_indptr_ptr + b + 1, mask=live, other=0).to(tl.int64) - qo_start
    prefix = tl.maximum(tl.load(prefix_lens_ptr + b, mask=live, other=0).to(tl.int64), 0)
    kv_len = tl.maximum(prefix + qo_len, 1)[:, None]
    bit = tl.arange(0, 8)
    e = (j - tl.load(mask_indptr_ptr + b, mask=live, other=0).to(tl.int64))[:, None] * 8 \
        + bit[None, :]  # [BLOCK_BYTES, 8]
    inside = live[:, None] & (e < qo_len[:, None] * kv_len)
    row = e // kv_len
    col = e % kv_len - prefix[:, None]  # tree column; < 0 inside the prefix
    in_tree = inside & (col >= 0) & (row < R)
    col_in = tl.where(in_tree, col, 0)  # a shift by a negative amount is undefined
    word = tl.load(ancestors_ptr + (b[:, None] * R + row) * W + col_in // 32, mask=in_tree,
                   other=0)
    visible = inside & ((col < 0) | (in_tree & (((word >> (col_in % 32)) & 1) != 0)))
    return tl.sum(visible.to(tl.int32) << bit[None, :], axis=1)


@triton.jit(do_not_specialize=["B", "R", "W", "M"],  # as _tree_rows_kernel's
            do_not_specialize_on_alignment=["prefix_lens_ptr"])
def _tree_mask_kernel(
    prefix_lens_ptr,  # *int32 [B]
    qo_indptr_ptr,  # *int32 [B + 1]  from _tree_rows_kernel
    mask_indptr_ptr,  # *int32 [B + 1] (B + 2 with HAS_SINK)  bytes, from _tree_rows_kernel
    ancestors_ptr,  # *int32 [B, R, W]  from _tree_rows_kernel
    packed_mask_ptr,  # *uint8 [M]  out
    B,
    R,
    W,
    M,
    BLOCK_BYTES: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """Grid ``(programs,)``, any count: program ``k`` packs the buffer's blocks ``k, k +
    programs, ...`` of ``BLOCK_BYTES`` bytes, all requests' bytes as one flat range.

    Byte ``j < mask_indptr[B]`` belongs to the request ``b`` with ``mask_indptr[b] <= j <
    mask_indptr[b + 1]`` (:func:`_mask_bytes`: a binary search over the indptr, ``ceil(log2
    B)`` steps; every request has a byte, so the indptr strictly increases). Its element ``e
    = 8 * (j - mask_indptr[b]) + i`` (bit ``i``) is row ``e // kv_len``, column ``c = e %
    kv_len``; it is set iff ``c < prefix_len`` or tree row ``c - prefix_len`` is an
    ancestor-or-self of the row. Bits past ``qo_len * kv_len`` are 0 (byte padding). Bytes
    past the batch's are 0 but for the sink's (``HAS_SINK``: up to ``mask_indptr[B + 1]``),
    all ones; a block wholly past the batch's only stores. The work is the buffer's bytes,
    whatever the page table's width or the step's batch.
    """
    total = tl.load(mask_indptr_ptr + B).to(tl.int64)
    ones_end = total
    if HAS_SINK:
        ones_end = tl.load(mask_indptr_ptr + B + 1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_BYTES
    while t < M:
        j = t + tl.arange(0, BLOCK_BYTES)
        if t < total:  # a block with the batch's bytes (a scalar branch: the tail only stores)
            byte = _mask_bytes(j, total, prefix_lens_ptr, qo_indptr_ptr, mask_indptr_ptr,
                               ancestors_ptr, B, R, W, BLOCK_BYTES)
            byte = tl.where(j < total, byte, tl.where(j < ones_end, 255, 0))
        else:
            byte = tl.where(j < ones_end, 255, 0)
        tl.store(packed_mask_ptr + j, byte.to(tl.uint8), mask=j < M)
        t += tl.num_programs(0) * BLOCK_BYTES


def tree_mask_torch(token_ids: torch.Tensor, parents: torch.Tensor,
                    num_draft_tokens: torch.Tensor, root_ids: torch.Tensor,
                    prefix_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                    out: TreeMaskBuffers, sink_page: int | None = None) -> TreeMaskBuffers:
    """Pure-torch implementation of :func:`tree_mask` (same inputs, same bits in ``out``)."""
    B, N = token_ids.shape
    _, R, W = out.ancestor_bits.shape
    Q, P, M = out.input_ids.numel(), out.kv_indices.numel(), out.packed_mask.numel()
    max_pages = page_table.shape[1]
    dev = token_ids.device
    for x in (out.input_ids, out.position_ids, out.kv_indices, out.packed_mask):
        x.zero_()
    out.kv_slots.fill_(-1)
    qo_indptr, kv_indptr, mask_indptr = (x[:B + 1] for x in (out.qo_indptr, out.kv_indptr,
                                                               out.mask_indptr))
    qo_lens = 1 + num_draft_tokens.clamp(0, N)
    kv_lens = prefix_lens.clamp(min=0) + qo_lens
    num_pages = (kv_lens + page_size - 1) // page_size
    for indptr, counts in ((qo_indptr, qo_lens), (kv_indptr, num_pages),
                           (mask_indptr, (qo_lens.long() * kv_lens + 7) // 8)):
        indptr[:1].zero_()
        torch.cumsum(counts, 0, dtype=torch.int32, out=indptr[1:])
    out.kv_last_page_len[:B].copy_(kv_lens - (num_pages - 1) * page_size)
    if sink_page is not None:  # request B: the rows past the batch's over one KV entry
        out.qo_indptr[B + 1:].fill_(Q)
        torch.add(kv_indptr[B:], 1, out=out.kv_indptr[B + 1:])
        page_at = kv_indptr[B:].long()
        out.kv_indices[page_at[page_at < P]] = sink_page
        out.kv_last_page_len[B:].fill_(1)
        sink_bytes = ((Q - qo_indptr[B:]).clamp(min=0) + 7) // 8
        torch.add(mask_indptr[B:], sink_bytes, out=out.mask_indptr[B + 1:])
        at = mask_indptr[B].long() + torch.arange(-(-Q // 8), device=dev)  # a sink's most
        out.packed_mask[at[(at < out.mask_indptr[B + 1]) & (at < M)]] = 255
    if B == 0:
        return out
    qo_start = qo_indptr[:-1].long()
    qo_len = qo_indptr[1:].long() - qo_start
    prefix = prefix_lens.long().clamp(min=0)

    # ancestor bitsets, one pass over rows in topological order (vectorised over requests)
    anc = torch.zeros(B, R, W, dtype=torch.int32, device=dev)
    anc[:, 0, 0] = torch.where(qo_len > 0, 1, 0).to(torch.int32)
    words = torch.arange(W, device=dev)
    for r in range(1, min(R, N + 1)):
        parent_row = (parents[:, r - 1].long() + 1).clamp(0, r - 1)
        own = torch.where(words == r // 32, 1 << (r % 32), 0).to(torch.int32)  # wraps at bit 31
        row = anc[torch.arange(B, device=dev), parent_row] | own
        anc[:, r] = torch.where((r < qo_len)[:, None], row, 0)
    out.ancestor_bits.copy_(anc)

    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    depth = ((anc[..., None] >> shifts) & 1).sum(dim=(-1, -2)) - 1  # [B, R]
    rows = torch.arange(R, device=dev)
    logical = prefix[:, None] + rows[None, :]
    page_col = logical // page_size
    dst = qo_start[:, None] + rows[None, :]
    valid = (rows[None, :] < qo_len[:, None]) & (dst < Q) & (page_col < max_pages)
    tok = torch.zeros(B, R, dtype=torch.int32, device=dev)
    tok[:, :N + 1] = torch.cat([root_ids[:, None], token_ids], dim=1)  # R >= N + 1
    page = page_table.gather(1, page_col.clamp(0, max_pages - 1))
    slot = page.long() * page_size + logical % page_size
    out.input_ids[dst[valid]] = tok[valid]
    out.position_ids[dst[valid]] = (prefix[:, None] + depth)[valid].to(torch.int32)
    out.kv_slots[dst[valid]] = slot[valid].to(torch.int32)

    kv_start = kv_indptr[:-1].long()
    num_pages = kv_indptr[1:].long() - kv_start
    cols = torch.arange(max_pages, device=dev)
    pdst = kv_start[:, None] + cols[None, :]
    pvalid = (cols[None, :] < num_pages[:, None]) & (pdst < P)
    out.kv_indices[pdst[pvalid]] = page_table[pvalid]

    # packed mask: element e of request b is (row e // kv_len, column e % kv_len). A row's
    # context columns are all visible, so the batch's bytes start as 255 and only those that
    # hold a row's tree columns (at most ceil(R / 8) + 1 a row) are computed: O(M + B R^2),
    # not O(B R max_kv_len) as a pass over every byte of every request would be
    kv_len = prefix + qo_len
    m_start = mask_indptr[:-1].long()
    num_bytes = mask_indptr[1:].long() - m_start
    at = torch.arange(M, device=dev, dtype=torch.int32)
    out.packed_mask.masked_fill_(at < mask_indptr[B], 255)
    K = (R + 7) // 8 + 1
    row0 = rows[None, :] * kv_len[:, None]  # [B, R] each row's first element
    kb = (row0 + prefix[:, None])[..., None] // 8 + torch.arange(K, device=dev)  # [B, R, K]
    last = (row0 + kv_len[:, None] - 1)[..., None] // 8
    e = kb[..., None] * 8 + torch.arange(8, device=dev)  # [B, R, K, 8]
    kvl = kv_len.clamp(min=1)[:, None, None, None]
    inside = e < (qo_len * kv_len)[:, None, None, None]
    row = e // kvl
    t = e % kvl - prefix[:, None, None, None]
    in_tree = inside & (t >= 0) & (row < R)
    row = row.clamp(max=R - 1)
    tc = t.clamp(min=0)
    bidx = torch.arange(B, device=dev)[:, None, None, None]
    word = anc[bidx, row, (tc // 32).clamp(max=W - 1)]
    tree_bit = ((word >> (tc % 32).to(torch.int32)) & 1) != 0
    visible = inside & ((t < 0) | (in_tree & tree_bit))
    byte = (visible.to(torch.int32) << torch.arange(8, device=dev, dtype=torch.int32)).sum(-1)
    mdst = m_start[:, None, None] + kb
    mvalid = (rows[None, :, None] < qo_len[:, None, None]) & (kb <= last) & \
        (kb < num_bytes[:, None, None]) & (mdst < M)
    out.packed_mask[mdst[mvalid]] = byte[mvalid].to(torch.uint8)  # shared bytes: same value
    return out


def tree_mask(token_ids: torch.Tensor, parents: torch.Tensor, num_draft_tokens: torch.Tensor,
              root_ids: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
              page_size: int, *, out: TreeMaskBuffers | None = None,
              sink_page: int | None = None, use_triton: bool | None = None) -> TreeMaskBuffers:
    """Plans a tree-attention step: indptrs, per-row and per-page arrays, the packed mask.

    Parameters
    ----------
    token_ids, parents : ``int32 [B, N]``
        The draft trees (topological order, ``-1`` parent for root children).
    num_draft_tokens : ``int32 [B]``
        Nodes per request (clamped to ``[0, N]``): ``qo_len = 1 + num_draft_tokens``.
    root_ids, prefix_lens : ``int32 [B]``
        Root token per request and the number of its tokens already in the KV cache (a
        negative one counts as 0: never read on the host, never a read before the page
        table).
    page_table : ``int32 [B, max_pages]``
        Each request's pages in logical order; must cover ``prefix_len + qo_len`` slots
        (rows whose slot is past it are planned as padding).
    page_size : int
    out : TreeMaskBuffers, optional
        Buffers to fill (indptrs of ``B + 1`` entries, ``kv_last_page_len`` of ``B``;
        capacities ``Q``, ``P``, ``M``; ``ancestor_bits`` of shape ``[B, R, ceil(R / 32)]``
        with ``R >= N + 1``). Allocated with the static bounds ``Q = B * (N + 1)``, ``P = B *
        max_pages``, ``M = B * ceil((N + 1) * max_pages * page_size / 8)`` and ``R = N + 1``
        when omitted (with ``sink_page``: the sink's entries too, its page and ``ceil(Q /
        8)`` mask bytes).
    sink_page : int, optional
        Plan one more request ``B`` (a *sink*): the rows past the batch's, up to the
        capacity ``Q``, over one KV entry (slot 0 of page ``sink_page``) that each of them
        sees (its mask bytes all ones; its rows stay padding). A CUDA graph replays a fixed
        row count: the sink takes what a step leaves over. ``out``'s indptrs then hold ``B +
        2`` entries and ``kv_last_page_len`` ``B + 1``; the caller keeps ``Q`` above the
        batch's rows (a sink of no rows is planned as such).
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors. Triton: two kernel launches, nothing else.

    Returns
    -------
    TreeMaskBuffers
        ``out``, with every entry past the valid data set to its padding value.

    Example
    -------
    One request, prefix 2, a root and one child: ``kv_len = 4``, mask rows ``1110`` and
    ``1111``, elements ``1,1,1,0,1,1,1,1`` -> one byte ``0b11110111 = 0xF7``.
    """
    check_tree_inputs(token_ids, parents, num_draft_tokens, root_ids, prefix_lens, page_table,
                      page_size)
    device = token_ids.device
    B, N = token_ids.shape
    max_pages = page_table.shape[1]
    if out is None:
        R, k = N + 1, int(sink_page is not None)  # k: the sink's entries
        i32 = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
        out = TreeMaskBuffers(
            qo_indptr=i32(B + 1 + k), kv_indptr=i32(B + 1 + k), mask_indptr=i32(B + 1 + k),
            kv_last_page_len=i32(B + k), input_ids=i32(B * R), position_ids=i32(B * R),
            kv_slots=i32(B * R), kv_indices=i32(B * max_pages + k),
            packed_mask=torch.empty(B * (-(-R * max_pages * page_size // 8)) + k * -(-B * R // 8),
                                    dtype=torch.uint8, device=device),
            ancestor_bits=torch.empty(B, R, -(-R // 32), dtype=torch.int32, device=device))
    check_tree_out(out, B, N, device, sink_page)
    return launch_tree_mask(token_ids, parents, num_draft_tokens, root_ids, prefix_lens,
                            page_table, page_size, out, sink_page=sink_page,
                            use_triton=use_triton)


def check_tree_inputs(token_ids: torch.Tensor, parents: torch.Tensor,
                      num_draft_tokens: torch.Tensor, root_ids: torch.Tensor,
                      prefix_lens: torch.Tensor, page_table: torch.Tensor,
                      page_size: int) -> None:
    """Raises ValueError naming the first of :func:`tree_mask`'s inputs with a wrong dtype
    (int32), layout (contiguous), device, or shape."""
    device = token_ids.device
    B, N = token_ids.shape if token_ids.dim() == 2 else (0, 0)
    for name, x, nd in (("token_ids", token_ids, 2), ("parents", parents, 2),
                        ("num_draft_tokens", num_draft_tokens, 1), ("root_ids", root_ids, 1),
                        ("prefix_lens", prefix_lens, 1), ("page_table", page_table, 2)):
        check_array(name, x, torch.int32, nd, device)
    if parents.shape != (B, N):
        raise ValueError(f"parents: expected shape {(B, N)}, got {tuple(parents.shape)}")
    for name, x in (("num_draft_tokens", num_draft_tokens), ("root_ids", root_ids),
                    ("prefix_lens", prefix_lens)):
        if x.shape[0] != B:
            raise ValueError(f"{name}: expected {B} entries, got {x.shape[0]}")
    if page_table.shape[0] != B or page_table.shape[1] < 1:
        raise ValueError(f"page_table: expected shape ({B}, >=1), got {tuple(page_table.shape)}")
    check_ints(("page_size", page_size, 1, 2 ** 31))


def check_tree_out(out: TreeMaskBuffers, B: int, N: int, device: torch.device,
                   sink_page: int | None = None) -> None:
    """Raises ValueError naming the first of ``out``'s buffers that cannot take a plan of
    ``B`` requests of ``N`` nodes (and a sink): dtype, layout, device, capacity."""
    check_sink_page(sink_page)
    for name in ("qo_indptr", "kv_indptr", "mask_indptr", "kv_last_page_len", "input_ids",
                 "position_ids", "kv_slots", "kv_indices"):
        check_array(f"out.{name}", getattr(out, name), torch.int32, 1, device)
    k = int(sink_page is not None)  # the sink's entries
    for name, n in (("qo_indptr", B + 1 + k), ("kv_indptr", B + 1 + k),
                    ("mask_indptr", B + 1 + k), ("kv_last_page_len", B + k)):
        if getattr(out, name).shape[0] != n:
            raise ValueError(f"out.{name}: expected {n} entries, got "
                             f"{getattr(out, name).shape[0]}")
    check_array("out.packed_mask", out.packed_mask, torch.uint8, 1, device)
    check_array("out.ancestor_bits", out.ancestor_bits, torch.int32, 3, device)
    _, R, W = out.ancestor_bits.shape
    if out.ancestor_bits.shape[0] != B or R < 1 or W * 32 < R:
        raise ValueError(f"out.ancestor_bits: expected shape ({B}, R, ceil(R / 32)), "
                         f"got {tuple(out.ancestor_bits.shape)}")
    if R < N + 1:
        raise ValueError(f"out.ancestor_bits: R = {R} rows cannot hold a root plus {N} nodes")
    if not (out.input_ids.numel() == out.position_ids.numel() == out.kv_slots.numel()):
        raise ValueError("out.input_ids, out.position_ids, out.kv_slots: capacities differ")


def launch_tree_mask(token_ids: torch.Tensor, parents: torch.Tensor,
                     num_draft_tokens: torch.Tensor, root_ids: torch.Tensor,
                     prefix_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                     out: TreeMaskBuffers, *, sink_page: int | None = None,
                     use_triton: bool | None = None) -> TreeMaskBuffers:
    """:func:`tree_mask` without its checks, for a caller that ran
    :func:`check_tree_inputs` on these inputs and :func:`check_tree_out` on ``out`` (a
    planner reusing its buffers step after step checks them once)."""
    device = token_ids.device
    B, N = token_ids.shape
    max_pages = page_table.shape[1]
    k = int(sink_page is not None)
    _, R, W = out.ancestor_bits.shape
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton or B == 0:
        return tree_mask_torch(token_ids, parents, num_draft_tokens, root_ids, prefix_lens,
                               page_table, page_size, out, sink_page)

    Q, P, M = out.input_ids.numel(), out.kv_indices.numel(), out.packed_mask.numel()
    _tree_rows_kernel[(B,)](
        token_ids, parents, num_draft_tokens, root_ids, prefix_lens, page_table, out.qo_indptr,
        out.kv_indptr, out.mask_indptr, out.kv_last_page_len, out.input_ids, out.position_ids,
        out.kv_slots, out.kv_indices, out.ancestor_bits, B, N, max_pages, R, W, Q, P, page_size,
        0 if sink_page is None else sink_page, BLOCK_B=next_pow2(B),
        BLOCK_W=next_pow2(W), BLOCK_R=min(BLOCK_ROWS, next_pow2(R)),
        BLOCK_P=min(BLOCK_PAGES, next_pow2(max_pages)), HAS_SINK=bool(k))
    # a grid sized by the buffer, not by the table's width times the batch: a table as wide
    # as the KV pool would launch millions of programs, nearly all with nothing to do
    _tree_mask_kernel[(max(1, min(cdiv(M, BLOCK_BYTES), MAX_MASK_PROGRAMS)),)](
        prefix_lens, out.qo_indptr, out.mask_indptr, out.ancestor_bits, out.packed_mask, B, R,
        W, M, BLOCK_BYTES=BLOCK_BYTES, HAS_SINK=bool(k))
    return out
