"""The tree half of a split tree attention: each verification row over its own tree's KV,
merged with its attention over the prefix.

A verification row of request ``b`` (:mod:`agspec_gpu.tree`) sees every one of the
``prefix_lens[b]`` cached tokens before its tree and, among the step's own rows, its
ancestors-or-self. One FlashInfer batch prefill with a packed custom mask computes both, but
the mask is its slow path (the bits are read per score: flashinfer-ai/flashinfer#724): an
H100 spent 0.81 ms per layer there at B = 64 over 4,096-token prefixes, 1.3 TB/s of 3.35.
Only the tree's own columns need a mask. So attention is split:

- the prefix: an unmasked batch prefill over each request's first ``prefix_lens[b]`` KV
  entries (FlashInfer's fast path) that returns each row's output ``o_prefix`` and its
  base-2 log-sum-exp ``lse_prefix`` (FlashInfer's convention);
- the tree, here: row ``r`` of request ``b`` over the KV its request's rows ``t`` wrote this
  step (at ``kv_slots``, appended before attention), where bit ``t`` of
  ``ancestor_bits[b, r]`` is set; then both merged by their log-sum-exps::

      out = (o_prefix * 2^lse_prefix + sum_t 2^(s_t) v_t) / (2^lse_prefix + sum_t 2^(s_t))

  with ``s_t = q . k_t * sm_scale * log2(e)``, computed with a running maximum (no power
  overflows). A request with ``prefix_lens[b] == 0`` takes the tree part alone, a request
  ``b >= num_tree`` (a CUDA-graph bucket's sink, which has no tree) the prefix part alone,
  and padding rows past ``qo_indptr[-1]`` get zeros.

The tree is small (``1 + num_draft_tokens`` columns), so one program per (row, KV head)
streams its columns in blocks of ``BLOCK_T`` with an online softmax over the ``G`` query heads
that share the KV head, without tensor cores.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_array, check_devices, check_tensors, is_py_int
from agspec_gpu.kernels._launch import next_pow2

LOG2E = 1.0 / math.log(2.0)
_NEG = -1.0e30  # a running maximum's start (the kernel's literal): finite, no inf - inf


# the step's row count and request counts change every step: not specialized; the views of
# one buffer a graph bucket plans into start anywhere: their alignment is not either
@triton.jit(do_not_specialize=["num_requests", "num_tree", "R", "W"],
            do_not_specialize_on_alignment=["kv_slots_ptr", "qo_indptr_ptr", "ancestor_bits_ptr",
                                            "prefix_lens_ptr"])
def _tree_attention_kernel(
    q_ptr,  # *T [Q, H, D]
    kv_ptr,  # *T [num_pages, 2, page_size, H_kv, D]  one layer's paged cache (NHD)
    kv_slots_ptr,  # *int32 [Q]  each row's KV slot page * page_size + offset; -1: none
    qo_indptr_ptr,  # *int32 [num_requests + 1]
    ancestor_bits_ptr,  # *int32 [num_tree, R, W]
    prefix_lens_ptr,  # *int32 [num_requests]
    o_prefix_ptr,  # *T [Q, H, D]  attention over the prefix
    lse_prefix_ptr,  # *fp32 [Q, H]  its log-sum-exp, base 2
    out_ptr,  # *T [Q, H, D]
    num_requests,
    num_tree,
    R,
    W,
    page_size,
    sm_scale_log2,  # fp32: sm_scale * log2(e)
    H: tl.constexpr,
    G: tl.constexpr,  # query heads per KV head
    GP: tl.constexpr,  # G rounded up to a power of two
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid ``(Q, H_kv)``: row ``i`` and KV head ``h``, for query heads ``h * G + g``."""
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    # the row's request b: the first whose rows end past it (a binary search over the
    # indptr: no block as wide as the batch, so one compile serves every batch size)
    lo = tl.zeros((), tl.int32)
    hi = tl.zeros((), tl.int32) + num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        past = tl.load(qo_indptr_ptr + mid + 1).to(tl.int64) <= row
        lo = tl.where(past, mid + 1, lo)
        hi = tl.where(past, hi, mid)
    b = lo
    total = tl.load(qo_indptr_ptr + num_requests).to(tl.int64)
    valid = row < total
    start = tl.load(qo_indptr_ptr + b, mask=valid, other=0).to(tl.int64)
    qo_len = tl.load(qo_indptr_ptr + b + 1, mask=valid, other=0).to(tl.int64) - start
    r = row - start
    prefix = tl.load(prefix_lens_ptr + b, mask=valid, other=0)

    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    gmask = g < G
    dmask = d < D
    hd = heads[:, None] * D + d[None, :]  # [GP, BLOCK_D]
    hdmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + row * (H * D) + hd, mask=hdmask & valid, other=0.0).to(tl.float32)

    m = tl.full((GP,), -1.0e30, tl.float32)  # running max of s (base-2 scaled): finite
    lsum = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, BLOCK_D), tl.float32)
    HKV: tl.constexpr = H // G
    n_cols = tl.where(valid & (b < num_tree), qo_len, 0)
    bits_row = ancestor_bits_ptr + (b.to(tl.int64) * R + r) * W
    t0 = tl.zeros((), tl.int64)
    while t0 < n_cols:
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < n_cols
        word = tl.load(bits_row + t // 32, mask=tmask, other=0)
        seen = tmask & (((word >> (t % 32)) & 1) != 0)
        slot = tl.load(kv_slots_ptr + start + t, mask=seen, other=0).to(tl.int64)
        seen = seen & (slot >= 0)
        page = slot // page_size
        k_row = kv_ptr + ((page * 2 * page_size + slot % page_size) * HKV + kvh) * D  # [BLOCK_T]
        kvmask = seen[:, None] & dmask[None, :]
        k = tl.load(k_row[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        v = tl.load(k_row[:, None] + page_size * HKV * D + d[None, :], mask=kvmask,
                    other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale_log2  # [GP, BLOCK_T]
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
        t0 += BLOCK_T

    use_prefix = valid & (prefix > 0)
    lse_p = tl.load(lse_prefix_ptr + row * H + heads, mask=gmask & use_prefix,
                    other=float("-inf"))
    o_p = tl.load(o_prefix_ptr + row * (H * D) + hd, mask=hdmask & use_prefix,
                  other=0.0).to(tl.float32)
    top = tl.maximum(lse_p, m)
    w_p = tl.exp2(lse_p - top)  # 0 without a prefix
    w_t = tl.exp2(m - top)  # the tree's sum is lsum * 2^m
    denom = w_p + lsum * w_t
    denom = tl.where(denom > 0, denom, 1.0)  # a padding row: zeros
    o = (o_p * w_p[:, None] + acc * w_t[:, None]) / denom[:, None]
    tl.store(out_ptr + row * (H * D) + hd, o.to(out_ptr.dtype.element_ty), mask=hdmask)


def tree_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor,
                         qo_indptr: torch.Tensor, ancestor_bits: torch.Tensor,
                         prefix_lens: torch.Tensor, o_prefix: torch.Tensor,
                         lse_prefix: torch.Tensor, out: torch.Tensor, num_tree: int,
                         sm_scale: float) -> torch.Tensor:
    """Pure-torch implementation of :func:`tree_attention` (fp32 inside, the same merge)."""
    Q, H, D = q.shape
    page_size, Hkv = kv_cache.shape[2], kv_cache.shape[3]
    G = H // Hkv
    nb = qo_indptr.shape[0] - 1
    R = ancestor_bits.shape[1]
    dev = q.device
    rows = torch.arange(Q, device=dev)
    ends = qo_indptr[1:].long()
    b = torch.searchsorted(ends, rows, right=True)  # [Q]; nb past the last request
    valid = rows < qo_indptr[nb].long()
    bc = b.clamp(max=max(nb - 1, 0))
    start = qo_indptr[bc].long() if nb else torch.zeros_like(rows)
    qo_len = torch.where(valid, ends[bc] - start, 0) if nb else torch.zeros_like(rows)
    r = (rows - start).clamp(min=0, max=R - 1)
    has_tree = valid & (b < num_tree)
    t = torch.arange(R, device=dev)
    tb = bc.clamp(max=max(num_tree - 1, 0))
    if num_tree:
        words = ancestor_bits[tb[:, None], r[:, None], (t // 32)[None, :]]  # [Q, R]
        bit = ((words >> (t % 32)[None, :]) & 1) != 0
    else:
        bit = torch.zeros(Q, R, dtype=torch.bool, device=dev)
    seen = has_tree[:, None] & (t[None, :] < qo_len[:, None]) & bit
    src = (start[:, None] + t[None, :]).clamp(max=Q - 1)
    slot = kv_slots[src].long()
    seen &= slot >= 0
    slot = torch.where(seen, slot, 0)
    page, off = slot // page_size, slot % page_size
    k = kv_cache[page, 0, off].float().repeat_interleave(G, dim=2)  # [Q, R, H, D]
    v = kv_cache[page, 1, off].float().repeat_interleave(G, dim=2)
    s = torch.einsum("qhd,qthd->qht", q.float(), k) * (sm_scale * LOG2E)
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    m = s.amax(dim=-1).clamp(min=_NEG)  # [Q, H]
    p = torch.exp2(s - m[..., None])
    lsum = p.sum(-1)
    acc = torch.einsum("qht,qthd->qhd", p, v)
    use_prefix = valid & (prefix_lens[bc].long() > 0 if nb else torch.zeros_like(valid))
    lse_p = torch.where(use_prefix[:, None], lse_prefix.float(), float("-inf"))
    o_p = torch.where(use_prefix[:, None, None], o_prefix.float(), 0.0)
    top = torch.maximum(lse_p, m)
    w_p, w_t = torch.exp2(lse_p - top), torch.exp2(m - top)
    denom = w_p + lsum * w_t
    denom = torch.where(denom > 0, denom, 1.0)
    out.copy_((o_p * w_p[..., None] + acc * w_t[..., None]) / denom[..., None])
    return out


def tree_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor,
                   qo_indptr: torch.Tensor, ancestor_bits: torch.Tensor,
                   prefix_lens: torch.Tensor, o_prefix: torch.Tensor, lse_prefix: torch.Tensor,
                   *, num_tree: int, sm_scale: float, out: torch.Tensor | None = None,
                   use_triton: bool | None = None) -> torch.Tensor:
    """Each row's attention over its tree, merged with its attention over the prefix.

    Parameters
    ----------
    q : ``[Q, H, D]`` fp16 / bf16 / fp32
        Query rows of the step; ``Q`` may exceed ``qo_indptr[-1]`` (padding rows: zeros).
    kv_cache : ``[num_pages, 2, page_size, H_kv, D]``, ``q``'s dtype
        One layer's paged cache (NHD), the step's own KV already appended.
    kv_slots : ``int32 [Q]``
        Where each row's KV is (``page * page_size + offset``, ``TreeMetadata.kv_slots``); a
        negative slot is not attended.
    qo_indptr : ``int32 [nb + 1]``
        Rows of request ``b``: ``qo_indptr[b] : qo_indptr[b + 1]``.
    ancestor_bits : ``int32 [>= num_tree, R, W]``
        Bit ``t`` of ``[b, r]``: tree row ``t`` is an ancestor-or-self of row ``r``
        (``TreeMetadata.ancestor_bits``); ``R >= `` every tree request's rows (not
        checked: it would read the device's sizes; the plan that built both keeps it).
    prefix_lens : ``int32 [nb]``
        Tokens before each tree; 0: the prefix part is not read.
    o_prefix : ``[Q, H, D]``, ``q``'s dtype; lse_prefix : ``fp32 [Q, H]``
        The unmasked attention of every row over its request's prefix and its base-2
        log-sum-exp (``BatchPrefillWithPagedKVCacheWrapper.run(..., return_lse=True)``).
    num_tree : int
        Requests ``b < num_tree`` have a tree; the rest (a sink) take the prefix part alone.
    sm_scale : float
        The softmax scale of ``q . k`` (``1 / sqrt(D)`` usually).
    out : ``[Q, H, D]``, ``q``'s dtype, optional
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors.

    Returns
    -------
    ``out``: ``[Q, H, D]``.
    """
    device = q.device
    if q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q: expected fp16/bf16/fp32 [Q, H, D], got {q.dtype} "
                         f"{tuple(q.shape)}")
    Q, H, D = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != D or \
            kv_cache.dtype != q.dtype or min(kv_cache.shape[2:4]) < 1 or H % kv_cache.shape[3]:
        raise ValueError(f"kv_cache: expected {q.dtype} [num_pages, 2, page_size, H_kv, {D}] "
                         f"with page_size >= 1 and H_kv >= 1 dividing {H}, got {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}")
    for name, x in (("q", q), ("kv_cache", kv_cache)):
        if not x.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    for name, x, nd in (("kv_slots", kv_slots, 1), ("qo_indptr", qo_indptr, 1),
                        ("ancestor_bits", ancestor_bits, 3), ("prefix_lens", prefix_lens, 1)):
        check_array(name, x, torch.int32, nd, device)
    nb = qo_indptr.shape[0] - 1
    if nb < 0 or prefix_lens.shape[0] != nb:
        raise ValueError(f"qo_indptr, prefix_lens: expected nb + 1 and nb entries, got "
                         f"{qo_indptr.shape[0]} and {prefix_lens.shape[0]}")
    if not is_py_int(num_tree) or not 0 <= num_tree <= nb or \
            ancestor_bits.shape[0] < num_tree:
        raise ValueError(f"num_tree: expected 0 <= num_tree <= {nb} and <= ancestor_bits' "
                         f"{ancestor_bits.shape[0]} requests, got {num_tree}")
    R, W = ancestor_bits.shape[1:]
    if W * 32 < R:
        raise ValueError(f"ancestor_bits: {W} words cannot hold {R} rows")
    check_tensors(("kv_slots", kv_slots, torch.int32, (Q,)),
                  ("o_prefix", o_prefix, q.dtype, (Q, H, D)),
                  ("lse_prefix", lse_prefix, torch.float32, (Q, H)), contiguous=True)
    check_devices(("q", q), ("kv_cache", kv_cache), ("o_prefix", o_prefix),
                  ("lse_prefix", lse_prefix))
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensors(("out", out, q.dtype, (Q, H, D)), contiguous=True)
        check_devices(("q", q), ("out", out))
    return launch_tree_attention(q, kv_cache, kv_slots, qo_indptr, ancestor_bits, prefix_lens,
                                 o_prefix, lse_prefix, out, num_tree=num_tree,
                                 sm_scale=sm_scale, use_triton=use_triton)


def launch_tree_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor,
                          qo_indptr: torch.Tensor, ancestor_bits: torch.Tensor,
                          prefix_lens: torch.Tensor, o_prefix: torch.Tensor,
                          lse_prefix: torch.Tensor, out: torch.Tensor, *, num_tree: int,
                          sm_scale: float, use_triton: bool | None = None) -> torch.Tensor:
    """:func:`tree_attention` without its checks, for a backend that runs it every layer
    over a plan checked when it was made (``plan_tree``) and a query it checked itself."""
    device, (Q, H, D) = q.device, q.shape
    nb = qo_indptr.shape[0] - 1
    R, W = ancestor_bits.shape[1:]
    if Q == 0:
        return out
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        return tree_attention_torch(q, kv_cache, kv_slots, qo_indptr, ancestor_bits,
                                    prefix_lens, o_prefix, lse_prefix, out, num_tree, sm_scale)
    Hkv = kv_cache.shape[3]
    G = H // Hkv
    GP, BLOCK_D = next_pow2(G), next_pow2(D)
    # the [GP, BLOCK_T, BLOCK_D] products in registers: 8K fp32 per program
    block_t = max(1, min(32, 8192 // (GP * BLOCK_D)))
    _tree_attention_kernel[(Q, Hkv)](
        q, kv_cache, kv_slots, qo_indptr, ancestor_bits, prefix_lens, o_prefix, lse_prefix,
        out, nb, num_tree, R, W, kv_cache.shape[2], sm_scale * LOG2E, H=H, G=G, GP=GP, D=D,
        BLOCK_D=BLOCK_D, BLOCK_T=next_pow2(block_t))
    return out
