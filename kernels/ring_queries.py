"""The match's queries from the drafter's recent-token ring: one row per (request, corpus).

Each request's last ``D`` tokens sit in its slot of a ring (``recent [S, D]``, the newest
last; ``recent_len`` of them valid); a request matches against each of its ``R`` corpora,
so the match takes the request's ring row once per corpus, with a query length capped by
``match_cap`` (a match cannot have grown by more than the tokens appended since), and 0 for
a row without a corpus (``tier < 0``). In torch that is seven small ops between the host's
batch assembly and the match kernel; one kernel here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors


# R follows the batch's corpora: not specialized, one compile for every batch
@triton.jit(do_not_specialize=["R"])
def _ring_queries_kernel(
    slots_ptr,  # *int64 [B]  each request's state slot
    tier_ptr,  # *int64 [B, R]  each row's tier, -1: no corpus
    recent_ptr,  # *int32 [S, D]  the ring (newest token last)
    recent_len_ptr,  # *int32 [S]  valid tokens per slot
    match_cap_ptr,  # *int32 [S]  longest possible match per slot
    queries_ptr,  # *int32 [B * R, D]  out: row (b, r) is recent[slots[b]]
    qlen_ptr,  # *int32 [B * R]  out: min(recent_len, match_cap) of the slot, 0 if tier < 0
    R,
    D,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(B * R,)``: one (request, corpus) row."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row // R)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(recent_ptr + slot * D + d, mask=d < D, other=0)
    tl.store(queries_ptr + row * D + d, q, mask=d < D)
    qlen = tl.minimum(tl.load(recent_len_ptr + slot), tl.load(match_cap_ptr + slot))
    tl.store(qlen_ptr + row, tl.where(tl.load(tier_ptr + row) >= 0, qlen, 0))


def ring_queries_torch(slots, tier, recent, recent_len, match_cap
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch implementation of :func:`ring_queries`."""
    (B, R), D = tier.shape, recent.shape[1]
    qlen = torch.minimum(recent_len[slots], match_cap[slots])
    queries = recent[slots][:, None, :].expand(B, R, D).reshape(B * R, D).contiguous()
    return queries, torch.where(tier >= 0, qlen[:, None], 0).view(-1).to(torch.int32)


def ring_queries(slots: torch.Tensor, tier: torch.Tensor, recent: torch.Tensor,
                 recent_len: torch.Tensor, match_cap: torch.Tensor, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and query lengths of ``B`` requests' ``R`` match rows each.

    Parameters
    ----------
    slots : ``int64 [B]`` the requests' slots; ``tier`` : ``int64 [B, R]`` their rows'
        tiers (``< 0``: no corpus).
    recent : ``int32 [S, D]`` the ring; ``recent_len``, ``match_cap`` : ``int32 [S]``.
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors.

    Returns
    -------
    ``(queries int32 [B * R, D], qlen int32 [B * R])``: row ``b * R + r`` holds
    ``recent[slots[b]]`` and ``min(recent_len, match_cap)[slots[b]]`` (0 if ``tier[b, r] <
    0``).
    """
    if tier.dim() != 2 or recent.dim() != 2:
        raise ValueError(f"tier, recent: expected 2-D, got shapes {tuple(tier.shape)}, "
                         f"{tuple(recent.shape)}")
    (B, R), (S, D) = tier.shape, recent.shape
    check_tensors(("slots", slots, torch.int64, (B,)), ("tier", tier, torch.int64, (B, R)),
                  ("recent", recent, torch.int32, (S, D)),
                  ("recent_len", recent_len, torch.int32, (S,)),
                  ("match_cap", match_cap, torch.int32, (S,)))
    check_devices(("recent", recent), ("slots", slots), ("tier", tier),
                  ("recent_len", recent_len), ("match_cap", match_cap))
    if use_triton is None:
        use_triton = recent.device.type == "cuda"
    if not use_triton:
        return ring_queries_torch(slots, tier, recent, recent_len, match_cap)
    queries = torch.empty(B * R, D, dtype=torch.int32, device=recent.device)
    qlen = torch.empty(B * R, dtype=torch.int32, device=recent.device)
    if B * R:
        _ring_queries_kernel[(B * R,)](slots.contiguous(), tier.contiguous(),
                                       recent.contiguous(), recent_len.contiguous(),
                                       match_cap.contiguous(), queries, qlen, R, D,
                                       BLOCK_D=triton.next_power_of_2(max(D, 1)))
    return queries, qlen
