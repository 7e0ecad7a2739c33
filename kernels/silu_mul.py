"""SwiGLU's gate: ``silu(gate) * up`` from the fused gate/up projection, in one kernel.

Llama's MLP computes ``down(silu(gate) * up)``; with the gate and up projections fused into
one matrix the torch path is a chunk, a SiLU and a product: two kernels and an intermediate
of the full width per layer. The kernel reads ``[gate | up]`` once and writes the product
with torch's roundings (the SiLU rounded to the dtype, then the product rounded again); the
SiLU's exponential may differ from torch's by an ulp in fp32, which the two roundings can
carry to two units in the last place of the output (a helper's fuzz saw 2 in fp32; the
tests allow 2 in fp16 / bf16, where the interpreter also truncates, and 1e-5 relative in
fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._launch import KERNEL_FLOATS, cdiv, next_pow2

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # *T [M, 2 * I]  rows at stride_m, [gate | up]
    out_ptr,  # *T [M, I]  contiguous
    stride_m,
    I,
    BLOCK_I: tl.constexpr,
):
    """Grid ``(M, cdiv(I, BLOCK_I))``: one program, one block of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    g = tl.load(gate_up_ptr + row * stride_m + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_m + I + cols, mask=mask, other=0.0).to(tl.float32)
    T = out_ptr.dtype.element_ty
    act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(T).to(tl.float32)  # rounded as torch's /
    tl.store(out_ptr + row * I + cols, (act * u).to(T), mask=mask)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-torch implementation of :func:`silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).contiguous()


def silu_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]``.

    Parameters
    ----------
    gate_up : ``[M, 2 * I]`` (rows may be strided; the last dimension contiguous)
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors. float64 (the kernel computes in float32) runs torch.

    Returns
    -------
    ``[M, I]`` contiguous, ``gate_up.dtype``.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [M, 2 * I], got shape {tuple(gate_up.shape)}")
    if not gate_up.is_floating_point():
        raise ValueError(f"gate_up: expected a floating dtype, got {gate_up.dtype}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:  # on either path
        raise ValueError("gate_up: the last dimension must be contiguous")
    if use_triton is None:
        use_triton = gate_up.device.type == "cuda"
    if not use_triton or gate_up.dtype not in KERNEL_FLOATS:
        return silu_mul_torch(gate_up)
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)
    if M and I:
        block = min(BLOCK, next_pow2(I))
        _silu_mul_kernel[(M, cdiv(I, block))](gate_up, out, gate_up.stride(0), I,
                                              BLOCK_I=block)
    return out
