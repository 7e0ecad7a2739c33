"""Rotary position embedding of query or key heads, as Llama applies it, in one kernel.

Llama's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` is five
kernels on a GPU (two products, a negation, a concatenation, a sum), ten per decoder layer
for queries and keys, plus a copy to make the query contiguous for attention. The kernel
writes the rotated heads contiguously in one pass with the same roundings as the torch path
(each product and the sum rounded to the dtype of ``x``), so the two agree exactly.

Per row ``q`` and head: ``out[:D/2] = x1 * cos[:D/2] - x2 * sin[:D/2]``,
``out[D/2:] = x2 * cos[D/2:] + x1 * sin[D/2:]`` (``x1, x2``: the head's halves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._launch import KERNEL_FLOATS


@triton.jit
def rotate_halves(x1, x2, cos_row, sin_row, i, HALF: tl.constexpr, T: tl.constexpr):
    """One head's rotated halves ``(lo, hi)`` in ``T``: ``x1, x2`` its halves (fp32),
    ``cos_row, sin_row`` pointers to its row's ``[D]`` tables; each product and the sum
    rounded to ``T``, as torch evaluates them one op at a time (launched with
    ``enable_fp_fusion=False``, or fp32 would contract a product into the sum)."""
    c1 = tl.load(cos_row + i).to(tl.float32)
    c2 = tl.load(cos_row + HALF + i).to(tl.float32)
    s1 = tl.load(sin_row + i).to(tl.float32)
    s2 = tl.load(sin_row + HALF + i).to(tl.float32)
    lo = ((x1 * c1).to(T).to(tl.float32) + (-x2 * s1).to(T).to(tl.float32)).to(T)
    hi = ((x2 * c2).to(T).to(tl.float32) + (x1 * s2).to(T).to(tl.float32)).to(T)
    return lo, hi


@triton.jit
def _rope_kernel(
    x_ptr,  # *T [Q, H, D]  rows at stride_xq, heads at stride_xh, D contiguous
    cos_ptr,  # *T [Q, D]  contiguous
    sin_ptr,  # *T [Q, D]  contiguous
    out_ptr,  # *T [Q, H, D]  contiguous
    stride_xq,
    stride_xh,
    H,
    HALF: tl.constexpr,  # D / 2, a power of two
):
    """Grid ``(Q, H)``: one program rotates one head of one row."""
    q = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    src = x_ptr + q * stride_xq + h * stride_xh
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    lo, hi = rotate_halves(x1, x2, cos_ptr + q * 2 * HALF, sin_ptr + q * 2 * HALF, i, HALF,
                           out_ptr.dtype.element_ty)
    dst = out_ptr + (q * H + h) * 2 * HALF
    tl.store(dst + i, lo)
    tl.store(dst + HALF + i, hi)


def check_tables(cos: torch.Tensor, sin: torch.Tensor, Q: int, D: int,
                 like: torch.Tensor) -> None:
    """Raises ValueError naming ``cos`` / ``sin`` unless each is ``[Q, D]`` in ``like``'s
    dtype, on its device."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (Q, D):
            raise ValueError(f"{name}: expected shape ({Q}, {D}), got {tuple(t.shape)}")
        if t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"{name}: expected {like.dtype} on {like.device}, got {t.dtype} "
                             f"on {t.device}")


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pure-torch implementation of :func:`rope` (Llama's ``x * cos + rotate_half(x) * sin``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]).contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         use_triton: bool | None = None) -> torch.Tensor:
    """Rotates every head of every row of ``x`` by its row's angles.

    Parameters
    ----------
    x : ``[Q, H, D]``, ``D`` even and contiguous (rows and heads may be strided, e.g. a view
        of a fused QKV projection)
    cos, sin : ``[Q, D]``, ``x.dtype``: the row's ``cos``/``sin`` of its position's angles
        (Llama's tables, attention scaling applied)
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors (``D / 2`` a power of two, not float64; otherwise torch).

    Returns
    -------
    ``[Q, H, D]`` contiguous, ``x.dtype``; equal to the torch path.
    """
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [Q, H, D] with D even, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    Q, H, D = x.shape
    check_tables(cos, sin, Q, D, x)
    if D > 1 and x.stride(2) != 1:  # on either path
        raise ValueError("x: the last dimension must be contiguous")
    if use_triton is None:
        use_triton = x.device.type == "cuda"
    half = D // 2
    if not use_triton or half & (half - 1) or half == 0 or x.dtype not in KERNEL_FLOATS:
        return rope_torch(x, cos, sin)
    out = torch.empty(Q, H, D, dtype=x.dtype, device=x.device)
    if Q and H:
        # no fused multiply-adds: in fp32 (where the casts to T are no-ops) the compiler
        # would contract a product and the sum into one rounding, where torch rounds twice
        _rope_kernel[(Q, H)](x, cos.contiguous(), sin.contiguous(), out, x.stride(0),
                             x.stride(1), H, HALF=half, enable_fp_fusion=False)
    return out
