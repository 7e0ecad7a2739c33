"""Each request's draft depth cap and copy mode, read from its controller state, in one kernel.

The controller drafts ``k_t = min(C_role, max(1, floor(S_t * L_match)))`` tokens deep (or a
static ``k``), with ``S_t`` the request's online scale, ``C_role`` its role's cap and
``L_match`` its match length, and at most the request's own bound where the caller gives one
(``max_k``: the tokens it may still emit less the bonus token, near its ``max_new_tokens`` or
the model's context length; 0 drafts nothing). The trie's estimates also read the request's
copy mode (was its previous draft accepted whole). In torch that is nine small ops in the
drafter's propose graph (gathers by slot, the rule); here one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors, is_py_int
from agspec_gpu.kernels._launch import cdiv, slot_or_spare

BLOCK = 128


# B: the batch size, S: the state's slots, not specialized (one compile for every batch)
# slots, max_k: views of the drafter's staging ring without a graph (any alignment)
@triton.jit(do_not_specialize=["B", "S"],
            do_not_specialize_on_alignment=["slots_ptr", "max_k_ptr"])
def _depth_caps_kernel(
    slots_ptr,  # *int64 [B]  each request's state slot
    best_ptr,  # *int32 [B]  match length
    scale_ptr,  # *float32 [S]  the controller's scale per slot
    cap_ptr,  # *int32 [S]  the role's depth cap per slot
    prev_full_ptr,  # *int64 [S]  1 where the slot's previous draft was accepted whole
    max_k_ptr,  # *int64 [B]  each request's own depth bound (read when HAS_MAX_K)
    k_ptr,  # *int32 [B]  out: depth cap
    mode_ptr,  # *int64 [B]  out: copy mode
    B,
    S,
    static_k,
    STATIC: tl.constexpr,
    HAS_MAX_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Grid ``(cdiv(B, BLOCK_B),)``: a block of requests."""
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    slot = tl.load(slots_ptr + b, mask=b < B, other=0)
    m = (b < B) & (slot >= 0) & (slot < S)  # a slot outside the state is read as padding
    if STATIC:
        k = tl.zeros([BLOCK_B], dtype=tl.int32) + static_k
    else:
        s = tl.load(scale_ptr + slot, mask=m, other=0.0)
        best = tl.load(best_ptr + b, mask=m, other=0)
        cap = tl.load(cap_ptr + slot, mask=m, other=1)
        # compared in float, the cap taken as the int: a product past int32 (an unbounded
        # scale) is the cap, not a wrapped int, and a cap float32 rounds (past 2**24) is
        # never exceeded; 0 * inf (NaN) is 1
        p = s * best.to(tl.float32)
        k = tl.where(p >= cap.to(tl.float32), cap,
                     tl.floor(tl.where(p >= 1.0, p, 1.0)).to(tl.int32))
    if HAS_MAX_K:  # (a negative bound drafts nothing, as 0 does)
        bound = tl.load(max_k_ptr + b, mask=b < B, other=0)
        k = tl.minimum(k.to(tl.int64), tl.maximum(bound, 0)).to(tl.int32)
    tl.store(k_ptr + b, k, mask=b < B)
    tl.store(mode_ptr + b, tl.load(prev_full_ptr + slot, mask=m, other=0), mask=b < B)


def depth_rule_torch(scale: torch.Tensor, match_len: torch.Tensor, cap: torch.Tensor,
                     static_k: int | None) -> torch.Tensor:
    """``int32 [B]``: ``min(cap, max(1, floor(scale * match_len)))``, or ``static_k``."""
    if static_k is not None:
        return torch.full_like(cap, static_k)
    # compared in float, the cap taken as the int: a product past int32 (an unbounded scale)
    # is the cap, not a wrapped int, and a cap the float rounds (past 2**24 in float32) is
    # never exceeded; 0 * inf (NaN) is 1. The clamp keeps the cast defined where the cap
    # wins: 2**31 - 128 is float32's largest value below 2**31, so every product under
    # the cap floors exactly, as in the kernel
    p = scale * match_len.to(scale.dtype)
    k = torch.floor(torch.where(p >= 1, p, 1.0).clamp(max=2 ** 31 - 128)).to(torch.int32)
    return torch.where(p >= cap.to(scale.dtype), cap.to(torch.int32), k)


def depth_caps_torch(slots, best, scale, cap, prev_full, *, static_k: int | None,
                     max_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch implementation of :func:`depth_caps`."""
    # a slot outside the state (a caller's error) reads as the kernel reads it, from a
    # spare entry past the state: scale 0 and match 0 under cap 1 (depth 1), mode 0
    S = scale.shape[0]
    at = slot_or_spare(slots, S)
    scale, cap, prev_full = (torch.cat([t, t.new_full((1,), v)])[at]
                             for t, v in ((scale, 0), (cap, 1), (prev_full, 0)))
    k = depth_rule_torch(scale, torch.where(at < S, best, 0), cap, static_k)
    if max_k is not None:
        k = torch.minimum(k.to(torch.int64), max_k.clamp(min=0)).to(torch.int32)
    return k, prev_full


def depth_caps(slots: torch.Tensor, best: torch.Tensor, scale: torch.Tensor, cap: torch.Tensor,
               prev_full: torch.Tensor, *, static_k: int | None = None,
               max_k: torch.Tensor | None = None, use_triton: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft depth caps and copy modes of ``B`` requests.

    Parameters
    ----------
    slots : ``int64 [B]`` the requests' state slots, in ``[0, S)`` (both paths read a slot
        outside it as padding, depth 1 (``static_k`` if given) and mode 0, never memory past
        the state); ``best`` : ``int32 [B]`` their match lengths.
    scale : ``float32 [S]``; ``cap`` : ``int32 [S]``; ``prev_full`` : ``int64 [S]`` the
        controller's state per slot.
    static_k : a fixed depth for every request (the static-k ablation), or None.
    max_k : ``int64 [B]`` each request's own bound on the depth (negative reads as 0: no
        draft), or None: none.
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors.

    Returns
    -------
    ``(k int32 [B], mode int64 [B])``: ``k = min(cap, max(1, floor(scale * best)))`` at each
    request's slot (``static_k`` if given), then at most ``max(max_k, 0)``; ``mode =
    prev_full`` at its slot.
    """
    B = slots.shape[0] if slots.dim() == 1 else -1
    S = scale.shape[0] if scale.dim() == 1 else -1
    check_tensors(("slots", slots, torch.int64, (B,)), ("best", best, torch.int32, (B,)),
                  ("scale", scale, torch.float32, (S,)), ("cap", cap, torch.int32, (S,)),
                  ("prev_full", prev_full, torch.int64, (S,)),
                  *(() if max_k is None else (("max_k", max_k, torch.int64, (B,)),)))
    check_devices(("slots", slots), ("best", best), ("scale", scale), ("cap", cap),
                  ("prev_full", prev_full), *(() if max_k is None else (("max_k", max_k),)))
    if static_k is not None and not (is_py_int(static_k) and 1 <= static_k < 2 ** 31):
        raise ValueError(f"static_k: expected an int in [1, 2**31) or None, got {static_k!r}")
    if use_triton is None:
        use_triton = slots.device.type == "cuda"
    if not use_triton:
        return depth_caps_torch(slots, best, scale, cap, prev_full, static_k=static_k,
                                max_k=max_k)
    k = torch.empty(B, dtype=torch.int32, device=slots.device)
    mode = torch.empty(B, dtype=torch.int64, device=slots.device)
    if B:
        _depth_caps_kernel[(cdiv(B, BLOCK),)](
            slots.contiguous(), best.contiguous(), scale.contiguous(), cap.contiguous(),
            prev_full.contiguous(), k if max_k is None else max_k.contiguous(), k, mode, B, S,
            0 if static_k is None else static_k, STATIC=static_k is not None,
            HAS_MAX_K=max_k is not None, BLOCK_B=BLOCK)
    return k, mode
