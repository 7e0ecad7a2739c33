"""The controller's per-request update after verification, in one kernel.

Each request's draft scale ``S_t`` grows by ``alpha`` when its draft was accepted to its
deepest node (unless the role's cap, or the request's own bound, cut that draft: then it
stays; a request near its ``max_new_tokens`` or its context's limit drafts no deeper than
it may emit, which says nothing of its scale), shrinks by ``beta`` when
verification rejected a node, and stays when nothing was drafted; it is clamped to
``[s_min, s_max]``. ``prev_full`` records the full acceptance (copy mode persists into the
next draft's calibration). The torch path is ~25 small ops inside the drafter's commit graph
(gathers by slot, the drafted depth, the update, scatters back); the kernel does it in one
launch, one program per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors
from agspec_gpu.kernels._launch import next_pow2, slot_or_spare


# N: the draft width, S: the state's slots, not specialized (one compile per BLOCK_N)
# slots: a view of the drafter's staging ring without a graph (any alignment)
@triton.jit(do_not_specialize=["N", "S"],
            do_not_specialize_on_alignment=["slots_ptr", "bound_ptr"])
def _controller_commit_kernel(
    slots_ptr,  # *int64 [B]  each request's state slot
    nd_ptr,  # *int64 [B, N]  depth - 1 of each drafted node
    num_ptr,  # *int32 [B]  drafted nodes (the first num[b] of nd's row)
    nacc_ptr,  # *int32 [B]  draft tokens accepted
    scale_ptr,  # *float32 [S]  in/out: the controller's scale per slot
    cap_ptr,  # *int32 [S]  the role's depth cap per slot
    prev_full_ptr,  # *int64 [S]  out: 1 where the draft was accepted to its depth
    bound_ptr,  # *int64 [B]  each request's own depth bound (read when HAS_BOUND)
    N,
    S,
    alpha,
    beta,
    s_min,
    s_max,
    HAS_BOUND: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(B,)``: one request."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    ok = (slot >= 0) & (slot < S)  # a slot outside the state: nothing read or written
    j = tl.arange(0, BLOCK_N)
    num = tl.load(num_ptr + b)
    d = tl.load(nd_ptr + b * N + j, mask=(j < N) & (j < num), other=-1)
    depth = tl.max(d + 1, axis=0)
    acc = tl.load(nacc_ptr + b).to(tl.int64)
    full = (acc >= depth) & (depth > 0)
    rejected = (acc < depth) & (depth > 0)
    cut_by_cap = full & (depth >= tl.load(cap_ptr + slot, mask=ok, other=0))
    if HAS_BOUND:
        cut_by_cap = cut_by_cap | (full & (depth >= tl.load(bound_ptr + b)))
    s = tl.load(scale_ptr + slot, mask=ok, other=1.0)
    new = tl.where(full & ~cut_by_cap, s * alpha, s)
    new = tl.where(rejected, s * beta, new)
    tl.store(scale_ptr + slot, tl.minimum(tl.maximum(new, s_min), s_max), mask=ok)
    tl.store(prev_full_ptr + slot, full.to(tl.int64), mask=ok)


# s_max = inf ("no bound") clamps at float32's largest: an inf scale would contract no more
_F32_MAX = torch.finfo(torch.float32).max


def scale_update_torch(scale: torch.Tensor, drafted_depth: torch.Tensor, accepted: torch.Tensor,
                       cap: torch.Tensor, *, alpha: float, beta: float, s_min: float,
                       s_max: float, bound: torch.Tensor | None = None) -> torch.Tensor:
    """New scales ``float [B]`` from the old ones, the verified drafts' depths, the tokens
    accepted, the role caps and the requests' own depth bounds (None: none) (``int [B]``
    each); a request with no draft keeps its scale."""
    full = (accepted >= drafted_depth) & (drafted_depth > 0)
    rejected = (accepted < drafted_depth) & (drafted_depth > 0)
    cut_by_cap = full & (drafted_depth >= cap)
    if bound is not None:
        cut_by_cap |= full & (drafted_depth >= bound)
    new = torch.where(full & ~cut_by_cap, scale * alpha, scale)
    new = torch.where(rejected, scale * beta, new)
    return new.clamp(s_min, min(s_max, _F32_MAX))  # (as the launcher bounds the kernel's)


def controller_commit_torch(slots, nd, num_draft_tokens, nacc, scale, cap, prev_full, *,
                            alpha: float, beta: float, s_min: float, s_max: float,
                            bound: torch.Tensor | None = None) -> None:
    """Pure-torch implementation of :func:`controller_commit`."""
    B, N = nd.shape
    drafted = torch.arange(N, device=nd.device)[None, :] < num_draft_tokens[:, None]
    depth = torch.where(drafted, nd + 1, 0).amax(dim=1) if N else \
        torch.zeros(B, dtype=torch.int64, device=nd.device)
    # a slot outside the state (a caller's error) is skipped, as the kernel skips it: its
    # row goes to a spare entry past the state, then dropped
    S = scale.shape[0]
    at = slot_or_spare(slots, S)
    sc, cp, pf = (torch.cat([t, t.new_ones(1)]) for t in (scale, cap, prev_full))
    pf[at] = ((nacc >= depth) & (depth > 0)).long()
    sc[at] = scale_update_torch(sc[at], depth, nacc, cp[at], alpha=alpha, beta=beta,
                                s_min=s_min, s_max=s_max, bound=bound)
    scale.copy_(sc[:S])
    prev_full.copy_(pf[:S])


def controller_commit(slots: torch.Tensor, nd: torch.Tensor, num_draft_tokens: torch.Tensor,
                      nacc: torch.Tensor, scale: torch.Tensor, cap: torch.Tensor,
                      prev_full: torch.Tensor, *, alpha: float, beta: float, s_min: float,
                      s_max: float, bound: torch.Tensor | None = None,
                      use_triton: bool | None = None) -> None:
    """Updates ``scale`` and ``prev_full`` of the ``B`` verified requests' slots, in place.

    Parameters
    ----------
    slots : ``int64 [B]`` state slots in ``[0, S)`` (distinct, except padding rows that share
        a spare; both paths skip a row whose slot is outside).
    nd : ``int64 [B, N]`` each drafted node's depth - 1 (entries past
        ``num_draft_tokens[b]`` are ignored); ``num_draft_tokens``, ``nacc`` : ``int32 [B]``.
    scale : ``float32 [S]``; ``cap`` : ``int32 [S]``; ``prev_full`` : ``int64 [S]``.
    alpha, beta, s_min, s_max : the controller's expansion and contraction factors and the
        scale's bounds.
    bound : ``int64 [B]`` each request's own depth bound when it drafted (what it could
        still emit, less one), or None: none.
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors.

    With ``depth`` the deepest drafted node's depth (0: no draft): ``prev_full[slot] =
    nacc >= depth > 0``; ``scale[slot]`` times ``alpha`` on full acceptance unless ``depth
    >= cap[slot]`` or ``depth >= bound[b]`` (the cap or the bound cut the draft), times
    ``beta`` on a rejection, else unchanged;
    then clamped to ``[s_min, s_max]``.
    """
    if nd.dim() != 2:
        raise ValueError(f"nd: expected int64 [B, N], got shape {tuple(nd.shape)}")
    B, N = nd.shape
    S = scale.shape[0] if scale.dim() == 1 else -1
    check_tensors(("slots", slots, torch.int64, (B,)), ("nd", nd, torch.int64, (B, N)),
                  ("num_draft_tokens", num_draft_tokens, torch.int32, (B,)),
                  ("nacc", nacc, torch.int32, (B,)), ("scale", scale, torch.float32, (S,)),
                  ("cap", cap, torch.int32, (S,)), ("prev_full", prev_full, torch.int64, (S,)),
                  *(() if bound is None else (("bound", bound, torch.int64, (B,)),)))
    check_devices(("nd", nd), ("slots", slots), ("num_draft_tokens", num_draft_tokens),
                  ("nacc", nacc), ("scale", scale), ("cap", cap), ("prev_full", prev_full),
                  *(() if bound is None else (("bound", bound),)))
    if use_triton is None:
        use_triton = nd.device.type == "cuda"
    kw = dict(alpha=float(alpha), beta=float(beta), s_min=float(s_min),
              s_max=min(float(s_max), _F32_MAX))
    if not use_triton:
        controller_commit_torch(slots, nd, num_draft_tokens, nacc, scale, cap, prev_full,
                                bound=bound, **kw)
        return
    if not (scale.is_contiguous() and cap.is_contiguous() and prev_full.is_contiguous()):
        raise ValueError("scale, cap, prev_full: the state must be contiguous")
    if B:
        _controller_commit_kernel[(B,)](slots.contiguous(), nd.contiguous(),
                                        num_draft_tokens.contiguous(), nacc.contiguous(),
                                        scale, cap, prev_full,
                                        slots if bound is None else bound.contiguous(), N, S,
                                        **kw, HAS_BOUND=bound is not None,
                                        BLOCK_N=next_pow2(max(N, 1)))
