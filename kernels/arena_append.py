"""Rows of tokens appended to their corpora in the arena, every row in one launch.

A decode step's commit appends each request's accepted tokens (row ``b``'s first
``counts[b]`` of ``rows [B, M]``) to its session corpus, which ends at arena position
``starts[b]``, and tags them with the tier's source code. In torch that is an index list per
token built on the host (``B * M`` ints a step), a gather, a scatter and a fill; here the
host sends ``starts`` and ``counts`` (``2 B`` ints) and a program per row (and 64 columns)
copies its run. A caller that mirrors the corpora's lengths on the device passes them as
``totals``: the same launch adds each row's count there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_array, check_devices, check_tensors, is_py_int
from agspec_gpu.kernels._launch import cdiv

BLOCK = 64  # columns per program (fixed: one compile for every width)


# B, M: the batch and the rows' width, not specialized (one compile for every step)
# starts, counts: views of a staging ring, totals of the kept descriptors (any alignment)
@triton.jit(do_not_specialize=["M", "code", "totals_stride"],
            do_not_specialize_on_alignment=["starts_ptr", "counts_ptr", "totals_ptr"])
def _arena_append_kernel(
    rows_ptr,  # *int32 [B, M]  the tokens, row-major
    starts_ptr,  # *int64 [B]  arena position of each row's first token
    counts_ptr,  # *int64 [B]  tokens of each row appended (the first ones)
    arena_ptr,  # *int32 [T]  out: the arena's tokens
    src_ptr,  # *int8 [T]  out: the arena's source codes
    totals_ptr,  # *int32 [B] (stride totals_stride)  in/out: += counts (HAS_TOTALS)
    M,
    code,
    totals_stride,
    HAS_TOTALS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Grid ``(B, cdiv(M, BLOCK_M))``: row ``b``'s block of columns, those below
    ``counts[b]`` copied; the row's first block also adds its count to ``totals[b]``."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.load(starts_ptr + b)
    count = tl.load(counts_ptr + b)
    if HAS_TOTALS:
        if tl.program_id(1) == 0:
            at = totals_ptr + b * totals_stride
            tl.store(at, (tl.load(at) + count).to(tl.int32))
    keep = cols < count
    tok = tl.load(rows_ptr + b * M + cols, mask=keep, other=0)
    tl.store(arena_ptr + start + cols, tok, mask=keep)
    tl.store(src_ptr + start + cols, (tl.zeros([BLOCK_M], dtype=tl.int32) + code).to(tl.int8),
             mask=keep)


def arena_append_torch(arena: torch.Tensor, src: torch.Tensor, rows: torch.Tensor,
                       starts: torch.Tensor, counts: torch.Tensor, code: int,
                       totals: torch.Tensor | None = None) -> None:
    """Pure-torch implementation of :func:`arena_append`."""
    B, M = rows.shape
    if totals is not None:
        totals.add_(counts)
    if B == 0 or M == 0:
        return
    cols = torch.arange(M, device=rows.device)
    keep = cols[None, :] < counts[:, None]
    at = (starts[:, None] + cols[None, :])[keep]
    arena[at] = rows[keep]
    src[at] = code


def arena_append(arena: torch.Tensor, src: torch.Tensor, rows: torch.Tensor,
                 starts: torch.Tensor, counts: torch.Tensor, *, code: int,
                 totals: torch.Tensor | None = None, use_triton: bool | None = None) -> None:
    """Writes ``rows[b, :counts[b]]`` to ``arena[starts[b]:starts[b] + counts[b]]`` and
    ``code`` to the same positions of ``src``, for every row ``b``; with ``totals``, also
    ``totals[b] += counts[b]``.

    Parameters
    ----------
    arena : ``int32 [T]`` the arena's tokens; ``src`` : ``int8 [T]`` their source codes.
    rows : ``int32 [B, M]`` contiguous, the tokens to append.
    starts : ``int64 [B]`` where each row's run starts; ``counts`` : ``int64 [B]`` its length,
        in ``[0, M]``. The runs lie inside the arena and do not overlap (the caller's
        contract, as the arena's bookkeeping on the host guarantees it: checking the values
        would read them back from the device).
    code : the source code written (an int8 value).
    totals : ``int32 [B]``, any stride, or None: lengths the caller keeps on the device
        (the drafter's kept match descriptors), grown by ``counts`` in the same launch.
    use_triton : Triton when True (also under ``TRITON_INTERPRET=1``), torch when False;
        default: Triton for CUDA tensors.
    """
    dev = arena.device
    check_array("arena", arena, torch.int32, 1, dev)
    check_array("rows", rows, torch.int32, 2, dev)
    check_array("starts", starts, torch.int64, 1, dev)
    check_array("counts", counts, torch.int64, 1, dev)
    check_array("src", src, torch.int8, 1, dev)
    B, M = rows.shape
    check_tensors(("src", src, torch.int8, arena.shape), ("starts", starts, torch.int64, (B,)),
                  ("counts", counts, torch.int64, (B,)))
    if totals is not None:
        check_devices(("arena", arena), ("totals", totals))
        check_tensors(("totals", totals, torch.int32, (B,)))
        if B > 1 and totals.stride(0) == 0:  # rows would race on one element
            raise ValueError("totals: expected one element per row, got a stride-0 view")
    if not is_py_int(code) or not -128 <= code <= 127:
        raise ValueError(f"code: expected an int8 value, got {code!r}")
    if use_triton is None:
        use_triton = dev.type == "cuda"
    if not use_triton:
        arena_append_torch(arena, src, rows, starts, counts, code, totals)
    elif B and (M or totals is not None):
        has_totals = totals is not None
        _arena_append_kernel[(B, max(cdiv(M, BLOCK), 1))](
            rows, starts, counts, arena, src, totals if has_totals else counts, M, code,
            totals.stride(0) if has_totals else 0, HAS_TOTALS=has_totals, BLOCK_M=BLOCK)
