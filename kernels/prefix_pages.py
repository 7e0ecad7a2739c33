"""The prefix half of a split tree attention's plan: each request's pages up to its prefix.

A split verification step (:mod:`agspec_gpu.kernels.tree_attention`) attends to each
request's ``prefix_lens[b]`` cached tokens without a mask, through FlashInfer's paged batch
prefill, which takes them as its own ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``:
request ``b``'s first ``ceil(prefix_len / page_size)`` pages of its page table. A request
with no prefix gets its first page with one entry (FlashInfer is then never handed an empty
request; the tree kernel ignores that part, as ``prefix_lens[b] == 0`` says), and a sink
(``sink_page``) one entry on its page, as the full plan gives it. ``prefix_lens_out``
repeats the prefix lengths (the sink's as 1) for the tree kernel.

One program per request: each sums the page counts of the requests before it (the whole
batch's lengths fit one block), so the indptr needs no second launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_array, check_sink_page, is_py_int
from agspec_gpu.kernels._launch import next_pow2

BLOCK_PAGES = 128


class PrefixPages(NamedTuple):
    """The prefix part's paged-KV plan of ``nb`` requests (``B`` and a sink).

    Attributes:
        kv_indptr: ``int32 [nb + 1]`` request ``b``'s pages are
            ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``.
        kv_indices: ``int32 [P]`` page ids; entries past ``kv_indptr[nb]`` are not written.
        kv_last_page_len: ``int32 [nb]`` entries of the last page, in ``[1, page_size]``.
        prefix_lens: ``int32 [nb]`` the prefix lengths (0: none; the sink's 1).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    prefix_lens: torch.Tensor


@triton.jit(do_not_specialize=["B", "max_pages", "P", "sink_page"],
            do_not_specialize_on_alignment=["prefix_lens_ptr", "page_table_ptr"])
def _prefix_pages_kernel(
    prefix_lens_ptr,  # *int32 [B]
    page_table_ptr,  # *int32 [B, max_pages]
    kv_indptr_ptr,  # *int32 [nb + 1]  out
    kv_indices_ptr,  # *int32 [P]  out
    kv_last_page_len_ptr,  # *int32 [nb]  out
    prefix_lens_out_ptr,  # *int32 [nb]  out
    B,
    max_pages,
    P,
    page_size,
    sink_page,
    BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid ``(B,)``, or ``(B + 1,)`` with a sink, which program ``B`` plans."""
    b = tl.program_id(0)
    bb = tl.arange(0, BLOCK_B)
    lens = tl.load(prefix_lens_ptr + bb, mask=bb < B, other=0).to(tl.int64)  # (no wrap)
    counts = tl.where(bb < B, tl.where(lens > 0, (lens + page_size - 1) // page_size, 1), 0)
    first = tl.sum(tl.where(bb < b, counts, 0), axis=0)
    is_req = b < B
    prefix = tl.load(prefix_lens_ptr + b, mask=is_req, other=1).to(tl.int64)
    n = tl.where(is_req, tl.where(prefix > 0, (prefix + page_size - 1) // page_size, 1), 1)
    if b == 0:
        tl.store(kv_indptr_ptr, 0)
    tl.store(kv_indptr_ptr + b + 1, first + n)
    tl.store(kv_last_page_len_ptr + b, tl.where(prefix > 0, prefix - (n - 1) * page_size, 1))
    tl.store(prefix_lens_out_ptr + b, prefix)
    row = page_table_ptr + b.to(tl.int64) * max_pages
    # the pages written: a request's past its table, or any past the capacity P, are not
    # (the loop never runs past them: a prefix outside the contract costs no time)
    span = tl.minimum(tl.where(is_req, tl.minimum(n, max_pages), n), P - first)
    p0 = tl.zeros((), tl.int64)
    while p0 < span:
        p = p0 + tl.arange(0, BLOCK_P)
        keep = (p < n) & (first + p < P)
        pages = tl.load(row + p, mask=keep & is_req & (p < max_pages), other=0)
        pages = tl.where(is_req, pages, sink_page)
        # a prefix past its table (outside the contract): its missing pages are not
        # written, as in torch (once page 0, a real page)
        tl.store(kv_indices_ptr + first + p, pages, mask=keep & ((p < max_pages) | ~is_req))
        p0 += BLOCK_P


def prefix_pages_torch(prefix_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                       out: PrefixPages, sink_page: int | None) -> PrefixPages:
    """Pure-torch implementation of :func:`prefix_pages`."""
    B, max_pages = page_table.shape
    dev = prefix_lens.device
    prefix = prefix_lens.long()
    counts = torch.where(prefix > 0, (prefix + page_size - 1) // page_size, 1)
    last = torch.where(prefix > 0, prefix - (counts - 1) * page_size, 1)
    lens_out = prefix
    if sink_page is not None:
        one = torch.ones(1, dtype=torch.long, device=dev)
        counts, last, lens_out = (torch.cat([x, one]) for x in (counts, last, prefix))
    nb = counts.shape[0]
    indptr = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), counts.cumsum(0)])
    out.kv_indptr[:nb + 1] = indptr.to(torch.int32)
    out.kv_last_page_len[:nb] = last.to(torch.int32)
    out.prefix_lens[:nb] = lens_out.to(torch.int32)
    P = out.kv_indices.shape[0]
    col = torch.arange(max_pages, device=dev)
    take = col[None, :] < counts[:B, None]  # [B, max_pages]
    at = indptr[:B, None] + col[None, :]
    keep = take & (at < P)
    out.kv_indices[at[keep]] = page_table[keep]
    if sink_page is not None and int(indptr[B]) < P:
        out.kv_indices[int(indptr[B])] = sink_page
    return out


def prefix_pages(prefix_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                 out: PrefixPages, *, sink_page: int | None = None,
                 use_triton: bool | None = None) -> PrefixPages:
    """Writes the prefix part's paged-KV plan of a step into ``out``.

    Parameters
    ----------
    prefix_lens : ``int32 [B]``
        Cached tokens of each request before its tree.
    page_table : ``int32 [B, max_pages]``
        Each request's pages in logical order (the full plan's table: it covers the prefix
        and at least one more slot, so a request with no prefix has a first page).
    page_size : int
    out : PrefixPages
        Buffers of at least ``nb + 1``, ``nb``, ``nb`` entries (``nb = B + 1`` with a sink);
        ``kv_indices`` holds ``P`` pages: the full plan's capacity is enough (a request's
        prefix pages are no more than its pages, at least one). Pages past ``P`` are dropped.
    sink_page : int, optional
        Plan a sink as request ``B``: one entry on this page.
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors.

    Example
    -------
    >>> # page_size 4, prefixes [5, 0]: pages [t0, t1] and [u0]; last page lens [1, 1]
    """
    device = prefix_lens.device
    check_array("prefix_lens", prefix_lens, torch.int32, 1, device)
    check_array("page_table", page_table, torch.int32, 2, device)
    B, max_pages = page_table.shape
    if prefix_lens.shape[0] != B:
        raise ValueError(f"prefix_lens: expected {B} entries, got {prefix_lens.shape[0]}")
    if max_pages < 1 and B:
        raise ValueError("page_table: every request needs a page")
    if not is_py_int(page_size) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    check_sink_page(sink_page)
    check_prefix_out(out, B + (sink_page is not None), device)
    return launch_prefix_pages(prefix_lens, page_table, page_size, out, sink_page=sink_page,
                               use_triton=use_triton)


def check_prefix_out(out: PrefixPages, num_requests: int, device: torch.device) -> None:
    """Raises ValueError unless ``out`` holds the plan of ``num_requests`` requests (the
    sink included) on ``device``."""
    for name in PrefixPages._fields:
        check_array(f"out.{name}", getattr(out, name), torch.int32, 1, device)
    nb = num_requests
    if out.kv_indptr.shape[0] < nb + 1 or out.kv_last_page_len.shape[0] < nb or \
            out.prefix_lens.shape[0] < nb:
        raise ValueError(f"out: buffers for fewer than {nb} requests")


def launch_prefix_pages(prefix_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                        out: PrefixPages, *, sink_page: int | None = None,
                        use_triton: bool | None = None) -> PrefixPages:
    """:func:`prefix_pages` without its checks, for a planner that checked its inputs
    (``check_tree_inputs``) and its buffers (:func:`check_prefix_out`) once."""
    device = prefix_lens.device
    B, max_pages = page_table.shape
    nb = B + (sink_page is not None)
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton or nb == 0:
        if nb == 0:
            out.kv_indptr[:1] = 0
            return out
        return prefix_pages_torch(prefix_lens, page_table, page_size, out, sink_page)
    _prefix_pages_kernel[(nb,)](
        prefix_lens, page_table, out.kv_indptr, out.kv_indices, out.kv_last_page_len,
        out.prefix_lens, B, max_pages, out.kv_indices.shape[0], page_size,
        0 if sink_page is None else sink_page,
        BLOCK_B=max(2, next_pow2(B)), BLOCK_P=BLOCK_PAGES)  # one compile for every table width
    return out
