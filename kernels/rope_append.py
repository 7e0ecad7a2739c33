"""RoPE of a step's queries and keys, and the append of its keys and values to the paged KV
cache, in one kernel.

Per decoder layer the fused QKV projection's output ``[Q, (H + 2 H_kv) D]`` needs its query
heads rotated (into a contiguous tensor for attention), its key heads rotated and written to
each row's slot of the paged cache, and its value heads written there as they are: with
:func:`~agspec_gpu.kernels.rope.rope` and two indexed writes that is four kernels, 128 per
step of a 32-layer model; this is one. The rotation rounds as :mod:`rope` does (each product
and the sum in the dtype of the input), so the queries and the cache hold exactly what the
unfused path writes.

Cache layout (one layer of :class:`~agspec_gpu.kv_cache.PagedKVCache`):
``[num_pages, 2, page_size, H_kv, D]``, keys at ``[:, 0]``, values at ``[:, 1]``; row ``i``
of the step goes to ``[page[i], :, offset[i]]``. Rows that share a slot (padding rows, all on
the null page) leave one of theirs, unspecified which.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors, is_py_int
from agspec_gpu.kernels._launch import KERNEL_FLOATS
from agspec_gpu.kernels.rope import check_tables, rope_torch, rotate_halves


@triton.jit
def _rope_append_kernel(
    qkv_ptr,  # *T [Q, (H + 2 Hkv) D]  rows at stride_qkv; q heads, then k, then v, D each
    cos_ptr,  # *T [Q, D]  contiguous
    sin_ptr,  # *T [Q, D]  contiguous
    page_ptr,  # *int64 [Q]  the page of each row's slot
    offset_ptr,  # *int64 [Q]  the slot within the page
    q_out_ptr,  # *T [Q, H, D]  contiguous
    cache_ptr,  # *T [P, 2, page_size, Hkv, D]  strides below, heads and D contiguous
    stride_qkv,
    stride_page,
    stride_kv,
    stride_slot,
    H,
    Hkv,
    num_pages,
    page_size,
    HALF: tl.constexpr,  # D / 2, a power of two
):
    """Grid ``(Q, H + 2 Hkv)``: one program per (row, head): a query head is rotated into
    ``q_out``, a key head rotated into the cache, a value head copied into the cache."""
    q = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    src = qkv_ptr + q * stride_qkv + h * 2 * HALF
    x1 = tl.load(src + i)
    x2 = tl.load(src + HALF + i)
    T = q_out_ptr.dtype.element_ty
    if h < H + Hkv:  # query or key head: rotate, rounding as the torch path does
        lo, hi = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), cos_ptr + q * 2 * HALF,
                               sin_ptr + q * 2 * HALF, i, HALF, T)
    else:  # value head: as it is
        lo, hi = x1.to(T), x2.to(T)
    ok = True
    if h < H:
        dst = q_out_ptr + (q * H + h) * 2 * HALF
    else:
        is_v = (h >= H + Hkv).to(tl.int64)
        head = h - H - is_v * Hkv
        page = tl.load(page_ptr + q)
        slot = tl.load(offset_ptr + q)
        dst = cache_ptr + page * stride_page + is_v * stride_kv + slot * stride_slot + \
            head * 2 * HALF
        # a slot outside the cache (a caller's error) is not written
        ok = (page >= 0) & (page < num_pages) & (slot >= 0) & (slot < page_size)
    tl.store(dst + i, lo, mask=ok)
    tl.store(dst + HALF + i, hi, mask=ok)


def rope_append_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      page: torch.Tensor, offset: torch.Tensor, cache: torch.Tensor,
                      num_qo_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Pure-torch implementation of :func:`rope_append` (rope of q and k, two indexed writes)."""
    Q, H, Hkv = qkv.shape[0], num_qo_heads, num_kv_heads
    D = qkv.shape[1] // (H + 2 * Hkv)
    q = rope_torch(qkv[:, :H * D].view(Q, H, D), cos, sin)
    k = rope_torch(qkv[:, H * D:(H + Hkv) * D].view(Q, Hkv, D), cos, sin)
    v = qkv[:, (H + Hkv) * D:].view(Q, Hkv, D)
    P, page_size = cache.shape[0], cache.shape[2]
    if Q == 0 or P == 0 or page_size == 0:  # nothing to write, or nowhere
        return q
    # a row whose slot is outside the cache (a caller's error) is not written, as in the
    # kernel: it writes what the first kept row writes, to that row's slot (the same write
    # twice: no race, and no copy of the cache), or, with no row kept, rewrites a clamped
    # slot with what it holds
    ok = (page >= 0) & (page < P) & (offset >= 0) & (offset < page_size)
    src = torch.where(ok, torch.arange(Q, device=ok.device), ok.int().argmax())
    page, offset = page.clamp(0, P - 1)[src], offset.clamp(0, page_size - 1)[src]
    ok = ok[src, None, None]
    cache[page, 0, offset] = torch.where(ok, k[src].to(cache.dtype), cache[page, 0, offset])
    cache[page, 1, offset] = torch.where(ok, v[src].to(cache.dtype), cache[page, 1, offset])
    return q


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, page: torch.Tensor,
                offset: torch.Tensor, cache: torch.Tensor, num_qo_heads: int,
                num_kv_heads: int, *, use_triton: bool | None = None) -> torch.Tensor:
    """Rotates a step's query and key heads and writes its keys and values to the cache.

    Parameters
    ----------
    qkv : ``[Q, (H + 2 H_kv) D]``, the fused projection's output (rows may be strided, each
        row contiguous): query heads, then key heads, then value heads
    cos, sin : ``[Q, D]``, ``qkv.dtype``: each row's RoPE tables
    page, offset : ``int64 [Q]``: each row's cache slot
        (:meth:`~agspec_gpu.kv_cache.PagedKVCache.slots_of`); neither path writes a row
        whose slot is outside the cache
    cache : ``[P, 2, page_size, H_kv, D]``, ``qkv.dtype``: one layer's paged KV (written)
    num_qo_heads, num_kv_heads : ``H``, ``H_kv``
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors (``D / 2`` a power of two, not float64; otherwise torch).

    Returns
    -------
    ``[Q, H, D]`` contiguous: the rotated queries; equal to :func:`rope_append_torch`'s.
    """
    H, Hkv = num_qo_heads, num_kv_heads
    if not (is_py_int(H) and is_py_int(Hkv)) or H < 1 or Hkv < 1:
        raise ValueError(f"num_qo_heads, num_kv_heads: expected ints >= 1, got {H!r}, {Hkv!r}")
    if qkv.dim() != 2 or qkv.shape[1] % (H + 2 * Hkv) or qkv.shape[1] // (H + 2 * Hkv) % 2:
        raise ValueError(f"qkv: expected [Q, (H + 2 H_kv) D] with D even for H={H}, "
                         f"H_kv={Hkv}, got shape {tuple(qkv.shape)}")
    if not qkv.is_floating_point():
        raise ValueError(f"qkv: expected a floating dtype, got {qkv.dtype}")
    Q, D = qkv.shape[0], qkv.shape[1] // (H + 2 * Hkv)
    check_tables(cos, sin, Q, D, qkv)
    check_tensors(("page", page, torch.int64, (Q,)), ("offset", offset, torch.int64, (Q,)))
    check_devices(("qkv", qkv), ("page", page), ("offset", offset))
    if cache.dim() != 5 or cache.shape[1] != 2 or tuple(cache.shape[3:]) != (Hkv, D) or \
            cache.dtype != qkv.dtype or cache.device != qkv.device:
        raise ValueError(f"cache: expected {qkv.dtype} [P, 2, page_size, {Hkv}, {D}] on "
                         f"{qkv.device}, got {cache.dtype} {tuple(cache.shape)} on "
                         f"{cache.device}")
    if qkv.stride(1) != 1 or cache.stride(4) != 1 or cache.stride(3) != D:  # either path
        raise ValueError("qkv, cache: each row of qkv and each cache slot must be contiguous")
    if use_triton is None:
        use_triton = qkv.device.type == "cuda"
    half = D // 2
    if not use_triton or half & (half - 1) or half == 0 or qkv.dtype not in KERNEL_FLOATS:
        return rope_append_torch(qkv, cos, sin, page, offset, cache, H, Hkv)
    q_out = torch.empty(Q, H, D, dtype=qkv.dtype, device=qkv.device)
    if Q:
        _rope_append_kernel[(Q, H + 2 * Hkv)](
            qkv, cos.contiguous(), sin.contiguous(), page.contiguous(), offset.contiguous(),
            q_out, cache,
            qkv.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), H, Hkv,
            cache.shape[0], cache.shape[2], HALF=half,
            enable_fp_fusion=False)  # torch's roundings: see rotate_halves
    return q_out
