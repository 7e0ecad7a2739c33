"""RMSNorm of each row, as Llama computes it, in one kernel.

``LlamaRMSNorm`` (and the torch path here) is ``weight * (x32 * rsqrt(mean(x32^2) + eps))
.to(x.dtype)`` with ``x32 = x.float()``: eight elementwise and reduction kernels on a GPU,
sixteen per decoder layer. In a decode step each is a few microseconds of launch and ramp
for a few kilobytes of data, so at batch 1 they cost more than the layer's weights take to
stream. The kernel reads a row once and writes it once with the same roundings: fp32 sum of
squares, the normalized row rounded to the input dtype, then the product with the weight
rounded again. It can also take the residual add before the norm (``residual=``), the
layer's other small kernel. Results equal the torch path up to the order of the fp32 sum
(the tests bound the difference by one unit in the last place of the output dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._launch import KERNEL_FLOATS, next_pow2

MAX_BLOCK_N = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # *T [M, N]  rows at stride_x
    res_ptr,  # *T [M, N]  contiguous; read only with HAS_RESIDUAL
    w_ptr,  # *T [N]
    out_ptr,  # *T [M, N]  contiguous
    sum_ptr,  # *T [M, N]  contiguous: x + residual, written only with HAS_RESIDUAL
    stride_x,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Grid ``(M,)``: one program normalizes one row of ``N <= BLOCK_N`` elements (with
    ``HAS_RESIDUAL``: of ``x + residual``, rounded to ``T`` as torch's add, also stored)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # the cast LlamaRMSNorm makes
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """Pure-torch implementation of :func:`rms_norm` (``LlamaRMSNorm``'s arithmetic)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * xf.to(x.dtype)).contiguous()
    return out if residual is None else (out, x.contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None, use_triton: bool | None = None):
    """``weight * x / rms(x)`` over the last dimension, computed in fp32 like ``LlamaRMSNorm``.

    With ``residual`` it normalizes ``s = x + residual`` (a decoder layer's residual stream
    after a sublayer) and returns ``(norm(s), s)``: the add and the norm in one kernel.

    Parameters
    ----------
    x : ``[M, N]`` (rows may be strided; the last dimension must be contiguous)
    weight : ``[N]``, same dtype and device as ``x``
    eps : float
    residual : ``[M, N]``, optional, same dtype and device as ``x``
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors. float64 (the kernel computes in float32) runs torch.

    Returns
    -------
    ``[M, N]`` contiguous, ``x.dtype`` (and ``s`` with ``residual``). ``M = 0`` gives an
    empty result.

    Example
    -------
    >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), 0.0)   # rms = sqrt(12.5)
    tensor([[0.8485, 1.1314]])
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, N], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    M, N = x.shape
    if weight.shape != (N,):
        raise ValueError(f"weight: expected shape ({N},), got {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name}: expected {x.dtype} on {x.device}, got {t.dtype} on "
                             f"{t.device}")
    if residual is not None and residual.shape != (M, N):
        raise ValueError(f"residual: expected shape ({M}, {N}), got {tuple(residual.shape)}")
    if (N > 1 and x.stride(1) != 1) or not weight.is_contiguous():  # on either path
        raise ValueError("x: the last dimension must be contiguous; weight: contiguous")
    if use_triton is None:
        use_triton = x.device.type == "cuda"
    if not use_triton or N > MAX_BLOCK_N or N == 0 or x.dtype not in KERNEL_FLOATS:
        return rms_norm_torch(x, weight, eps, residual)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    res = residual.contiguous() if residual is not None else out
    if M:
        _rms_norm_kernel[(M,)](x, res, weight, out, total, x.stride(0), N, float(eps),
                               BLOCK_N=next_pow2(N),
                               HAS_RESIDUAL=residual is not None)
    return out if residual is None else (out, total)
