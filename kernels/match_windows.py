"""The draft candidates of a match: the ``K`` tokens after each continuation position.

After :func:`~agspec_gpu.kernels.suffix_match.suffix_match` finds, per row, up to ``P``
positions where the query's longest suffix continues, the drafter reads the ``K`` tokens
that follow each (and their source codes): a window that stops at its corpus's end. The
torch path is a dozen small ops (offsets, bounds, two gathers, two selects); on a GPU, where
this runs eagerly between the match and the drafter's CUDA graph (the arena's buffers move
as it grows, so a graph cannot hold their address), one kernel does it.

Windows read past a separator as they are: the drafter cuts candidates at separators.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, check_tensors

PAD_ID = -1  # window entries past a corpus's end, or of a missing position


@triton.jit
def _match_windows_kernel(
    tokens_ptr,  # *int32 [T]  the arena's token buffer
    src_ptr,  # *int8 [T]  each token's source code
    tok_base_ptr,  # *int64 [R]  each row's corpus offset in the buffer
    num_tokens_ptr,  # *int32 [R]  each row's corpus length
    pos_ptr,  # *int64 [R, P]  continuation positions (corpus-relative), -1 padded
    win_ptr,  # *int32 [R, P, K]  out: tokens, PAD_ID past the corpus / position
    win_src_ptr,  # *int8 [R, P, K]  out: sources, -1 where win is PAD_ID
    P,
    K,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(R,)``: one program, one row's ``[P, K]`` windows."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, BLOCK_K)
    pos = tl.load(pos_ptr + row * P + p, mask=p < P, other=-1)
    base = tl.load(tok_base_ptr + row)
    n = tl.load(num_tokens_ptr + row).to(tl.int64)
    at = pos[:, None] + k[None, :]  # [BLOCK_P, BLOCK_K]
    live = (p[:, None] < P) & (k[None, :] < K)
    inside = live & (pos[:, None] >= 0) & (at < n)
    tok = tl.load(tokens_ptr + base + at, mask=inside, other=-1)  # PAD_ID
    src = tl.load(src_ptr + base + at, mask=inside, other=-1)
    out = row * P * K + p[:, None] * K + k[None, :]
    tl.store(win_ptr + out, tok, mask=live)
    tl.store(win_src_ptr + out, src, mask=live)


def match_windows_torch(tokens: torch.Tensor, src: torch.Tensor, tok_base: torch.Tensor,
                        num_tokens: torch.Tensor, positions: torch.Tensor, K: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch implementation of :func:`match_windows`."""
    at = positions[:, :, None] + torch.arange(K, device=positions.device)[None, None, :]
    inside = (positions[:, :, None] >= 0) & (at < num_tokens.to(torch.int64)[:, None, None])
    flat = torch.where(inside, tok_base[:, None, None] + at, 0)
    win = torch.where(inside, torch.take(tokens, flat), PAD_ID).to(torch.int32)
    win_src = torch.where(inside, torch.take(src, flat), -1).to(torch.int8)
    return win, win_src


def match_windows(tokens: torch.Tensor, src: torch.Tensor, tok_base: torch.Tensor,
                  num_tokens: torch.Tensor, positions: torch.Tensor, K: int, *,
                  use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``K`` tokens (and sources) after each continuation position of ``R`` rows.

    Parameters
    ----------
    tokens : ``int32 [T]`` the arena's tokens; ``src`` : ``int8 [T]`` their source codes.
    tok_base : ``int64 [R]`` each row's corpus offset in ``tokens``;
        ``num_tokens`` : ``int32 [R]`` its length.
    positions : ``int64 [R, P]`` corpus-relative positions, -1 for none (``MatchResult``).
    K : window width (``>= 0``).
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors.

    Returns
    -------
    ``(win int32 [R, P, K], win_src int8 [R, P, K])``: ``win[r, i, j] =
    tokens[tok_base[r] + positions[r, i] + j]`` while that index is inside row ``r``'s
    corpus (``positions[r, i] + j < num_tokens[r]``), else ``PAD_ID``; ``win_src`` alike,
    -1 outside.
    """
    if positions.dim() != 2:
        raise ValueError(f"positions: expected int64 [R, P], got shape "
                         f"{tuple(positions.shape)}")
    R, P = positions.shape
    check_tensors(("tokens", tokens, torch.int32, (tokens.numel(),)),
                  ("src", src, torch.int8, (tokens.numel(),)), contiguous=True)
    check_tensors(("tok_base", tok_base, torch.int64, (R,)),
                  ("num_tokens", num_tokens, torch.int32, (R,)),
                  ("positions", positions, torch.int64, (R, P)))
    if not isinstance(K, int) or K < 0:
        raise ValueError(f"K: expected an int >= 0, got {K!r}")
    check_devices(("tokens", tokens), ("src", src), ("tok_base", tok_base),
                  ("num_tokens", num_tokens), ("positions", positions))
    if use_triton is None:
        use_triton = tokens.device.type == "cuda"
    if not use_triton:
        return match_windows_torch(tokens, src, tok_base, num_tokens, positions, K)
    win = torch.empty(R, P, K, dtype=torch.int32, device=tokens.device)
    win_src = torch.empty(R, P, K, dtype=torch.int8, device=tokens.device)
    if R and P and K:
        _match_windows_kernel[(R,)](tokens, src, tok_base.contiguous(), num_tokens.contiguous(),
                                    positions.contiguous(), win, win_src, P, K,
                                    BLOCK_P=triton.next_power_of_2(P),
                                    BLOCK_K=triton.next_power_of_2(K))
    return win, win_src
