"""Depth-bounded suffix arrays built on the device (prefix doubling): torch sorts, and a
Triton kernel that builds a small one in a single launch.

A suffix array over positions ``[lo, hi)`` of a token tensor orders those positions by the
first ``depth`` tokens of the suffix starting there. Tokens beyond the end of the tensor
compare as ``END``, below every value; separators (negative values) compare below every
token, so among suffixes that share a pattern those followed by a separator or the end come
first, and the ones followed by a real token come out sorted by that token.

Prefix doubling, by up to four: ranks of single tokens come from one sort; each round packs
the ranks of ``k`` consecutive covered-length blocks into one int64 key (``k = 4`` while
four ranks fit, 3 or 2 for longer texts) and ranks the keys with one sort, so the covered
length grows ``k``-fold (the last round's blocks overlap to cover exactly ``depth``):
``depth`` tokens take ``ceil(log_k(depth))`` rounds, 3 for 64 where pairs took 6. The index
sorts by ``max_depth + 1`` tokens so that a match's continuation token is ordered too.
Ties (identical first ``depth`` tokens) keep ascending position order: every sort is stable.
On a CPU the rounds stop once every rank is distinct; on a GPU every round runs (knowing
the rank count is a wait for the device), so a build reads the device at most once, for the
size of its selection of positions, and not at all when the caller knows that size
(``num_selected``: the index counts it from the separators it records). A session corpus
builds a level every ``tail_tokens`` appended tokens, inside a decode step's commit.

In torch a build is ~70 launches (four sorts, each with its ranking, and the selection):
on a GPU ~0.7 ms of host time for a level of a few hundred positions, paid at every
``tail_tokens`` appended tokens of every session and at every message boundary.
:func:`context_array` builds a level of up to :data:`MAX_BLOCK` window positions in one
launch of ``_context_array_kernel`` instead (one program: its sorts are Triton's bitonic
``tl.sort`` over the whole window, the element index packed into the key's low bits so the
order is total and ties keep position order), and larger ones with the torch path.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_array, is_py_int
from agspec_gpu.kernels._launch import next_pow2


def _dense_rank(key: torch.Tensor, count: bool) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Stable sort of ``key`` -> (rank per element, 1-based; sort order; number of ranks, read
    from the device only with ``count``, else None)."""
    sorted_key, order = torch.sort(key, stable=True)
    # 1 + the number of key changes up to each element (four ops; a build runs ~7 of these)
    changes = torch.cumsum(sorted_key[1:] != sorted_key[:-1], 0)
    rank_sorted = torch.nn.functional.pad(changes, (1, 0)) + 1 if sorted_key.numel() else changes
    # scatter_, not `rank[order] = ...`: advanced-index assignment is ~100x slower on CPU
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    num = (int(rank_sorted[-1]) if rank_sorted.numel() else 0) if count else None
    return rank, order, num


def _compress(values: torch.Tensor, keep: torch.Tensor, num: int) -> torch.Tensor:
    """``values[keep]`` for a mask of ``num`` set elements that the caller knows: one scatter
    (each kept element to its rank among the kept, the rest to a spare slot past the end)
    instead of a boolean index, which waits for the device to learn its size. On a CPU, where
    that costs nothing, a wrong ``num`` raises."""
    if values.device.type == "cpu" and int(keep.sum()) != num:
        raise ValueError(f"num_selected: {num} positions given, the selection holds "
                         f"{int(keep.sum())}")
    dst = torch.cumsum(keep, 0).sub_(1).clamp_(max=num)
    dst = torch.where(keep, dst, num)
    out = torch.empty(num + 1, dtype=values.dtype, device=values.device)
    return out.scatter_(0, dst, values)[:num]


def _ranks_per_key(m: int) -> int:
    """How many ranks (each in ``[0, m]``) one int64 key holds: the most ``k <= 4`` with
    ``(m + 1)^k < 2^63`` (4 up to m = 55,107, 3 up to 2,097,150, else 2)."""
    k = 4
    while k > 2 and (m + 1) ** k >= 1 << 63:
        k -= 1
    return k


def _check_range(fn: str, tokens: torch.Tensor, lo: int, hi: int, depth: int) -> int:
    """``n`` of ``tokens``; ValueError naming ``fn`` unless ``tokens`` is 1-D, ``lo``,
    ``hi`` and ``depth`` are ints, ``0 <= lo <= hi <= n`` and ``depth >= 1``."""
    if tokens.dim() != 1:
        raise ValueError(f"{fn}: tokens must be 1-D, got shape {tuple(tokens.shape)}")
    for name, v in (("lo", lo), ("hi", hi), ("depth", depth)):
        if not is_py_int(v):
            raise ValueError(f"{fn}: {name} must be an int, got {v!r}")
    n = tokens.numel()
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"{fn}: bad range [{lo}, {hi}) for n={n}")
    if depth < 1:
        raise ValueError(f"{fn}: depth must be >= 1, got {depth}")
    return n


def build_suffix_array(tokens: torch.Tensor, lo: int, hi: int, depth: int, *,
                       early_stop: bool | None = None, after_token: bool = False,
                       num_selected: int | None = None) -> torch.Tensor:
    """Sorts the non-separator positions in ``[lo, hi)`` by their first ``depth`` tokens.

    Args:
        tokens: ``int32 [n]`` corpus (negative values are separators).
        lo, hi: position range to index, ``0 <= lo <= hi <= n``.
        depth: number of leading tokens that define the order (>= 1).
        early_stop: stop the doubling rounds once every rank is distinct (a read of the
            rank count per round: a wait for the device on a GPU); None: on a CPU only.
            The result is the same either way (distinct ranks keep their order).
        after_token: keep only positions ``p`` whose predecessor ``tokens[p - 1]`` is a
            token too (``lo >= 1``), in the same selection.
        num_selected: the number of positions selected (``m`` below) when the caller knows
            it (a CPU checks it): then nothing is read from the device without
            ``early_stop``.

    Returns:
        ``int32 [m]``: the positions ``p`` in ``[lo, hi)`` with ``tokens[p] >= 0``, sorted by
        ``tokens[p : p + depth]`` (shorter-by-END and separator-terminated suffixes first),
        ties in ascending position. Without ``early_stop`` the one read from the device is
        the selection's size, unless ``num_selected`` gives it.
    """
    n = _check_range("build_suffix_array", tokens, lo, hi, depth)
    if after_token and lo < 1:
        raise ValueError("build_suffix_array: after_token needs lo >= 1")
    if early_stop is None:
        early_stop = tokens.device.type == "cpu"
    end = min(n, hi + depth)
    win = tokens[lo:end].to(torch.int64)
    m = win.numel()
    if hi == lo:
        if num_selected:
            raise ValueError(f"num_selected: {num_selected} positions given, the range is "
                             f"empty")
        return torch.empty(0, dtype=torch.int32, device=tokens.device)
    # rank 0 is END (beyond the window); token values get dense ranks >= 1 in value order
    rank, order, num = _dense_rank(win, early_stop)
    covered, k = 1, _ranks_per_key(m)
    while covered < depth and (num is None or num < m):
        # the ranks of the blocks at i, i + c, i + 2c, ... (c = covered) and, last, at
        # i + L - c, which overlaps the one before unless L is k * c, so that exactly
        # `depth` tokens define the order (ties then stay in position order, as
        # documented). Ranks are at most m: the key (rank, next, ...) is the number
        # rank * (m + 1)^(k - 1) + ... in base m + 1, built without a read
        L = min(k * covered, depth)
        ext = torch.nn.functional.pad(rank, (0, L - covered))  # rank 0 (END) past the end
        key = rank
        for at in [j * covered for j in range(1, k - 1) if j * covered < L - covered] + \
                [L - covered]:
            key = torch.add(ext[at:at + m], key, alpha=m + 1)
        rank, order, num = _dense_rank(key, early_stop)
        covered = L
    keep = (order < (hi - lo)) & (win[order] >= 0)
    if after_token:
        keep &= tokens[(order + (lo - 1)).clamp(max=n - 1)] >= 0
    picked = order[keep] if num_selected is None else _compress(order, keep, num_selected)
    return (picked + lo).to(torch.int32)


def build_context_array(tokens: torch.Tensor, lo: int, hi: int, depth: int, *,
                        early_stop: bool | None = None, num_selected: int | None = None
                        ) -> torch.Tensor:
    """The suffix array of the reversed text over continuation positions ``[lo, hi)``.

    Args:
        tokens: ``int32 [n]`` corpus (negative values are separators).
        lo, hi: position range to index, ``0 <= lo <= hi <= n``.
        depth: number of context tokens that define the order (>= 1).

    Returns:
        ``int32 [m]``: the positions ``c`` in ``[lo, hi)`` with ``c >= 1`` and ``tokens[c - 1]``,
        ``tokens[c]`` both ``>= 0``, sorted by their context read backwards,
        ``tokens[c - 1], tokens[c - 2], ..., tokens[c - depth]`` (``END`` before position 0,
        so shorter contexts first; separators below tokens), equal contexts in descending
        position. Every key is final once ``c < n``: appends never change it. ``early_stop``
        and ``num_selected`` (the number of such ``c``, :func:`num_context_positions`) as
        :func:`build_suffix_array`'s: without either, one read of the device per build.
    """
    _check_range("build_context_array", tokens, lo, hi, depth)
    lo = max(lo, 1)  # position 0 has an empty context
    if hi <= lo:
        if num_selected:
            raise ValueError(f"num_selected: {num_selected} positions given, the selection "
                             f"is empty")
        return torch.empty(0, dtype=torch.int32, device=tokens.device)
    # rev[j] = tokens[hi - 1 - j] over the tokens any key reads; key(c) is the suffix of rev
    # at j = hi - c, and the end of rev is position 0's start only when a = 0 (else it lies
    # beyond depth tokens of every key)
    a = max(0, lo - depth)
    rev = tokens[a:hi].flip(0)
    # rev[j] = tokens[c - 1] >= 0 and, after_token, rev[j - 1] = tokens[c] >= 0: one selection
    j = build_suffix_array(rev, 1, hi - lo + 1, depth, early_stop=early_stop,
                           after_token=True, num_selected=num_selected)
    return (hi - j).to(torch.int32)


def num_context_positions(separators: Sequence[int], lo: int, hi: int) -> int:
    """How many positions :func:`build_context_array` selects in ``[lo, hi)`` of a text whose
    negative values sit exactly at ``separators`` (ascending): the ``c >= 1`` with neither
    ``c`` nor ``c - 1`` among them. Host arithmetic over the separators near the range."""
    lo = max(lo, 1)
    if hi <= lo:
        return 0
    near = separators[bisect_left(separators, lo - 1):bisect_left(separators, hi)]
    out = {c for s in near for c in (s, s + 1) if lo <= c < hi}
    return hi - lo - len(out)


# ----------------------------------------------------------------------------- one launch
MAX_BLOCK = 4096  # window positions one program sorts (no register spills at 8 warps)
_MIN_BLOCK = 1024  # one compile covers every smaller window (two configs in all)
_KEY_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # a padding element's key: after every real one


# lo, hi, W, num_selected: a level's range (not specialized: one compile per BLOCK); tokens
# and out: views of the arena's buffers at any offset (any alignment)
@triton.jit(do_not_specialize=["lo", "hi", "W", "num_selected"],
            do_not_specialize_on_alignment=["tokens_ptr", "out_ptr"])
def _context_array_kernel(
    tokens_ptr,  # *int32 [n]  the corpus (negative = separator)
    out_ptr,  # *int32 [num_selected]  out: the selected positions in key order
    work_ptr,  # *int64 [2 * BLOCK]  scratch: a sort's keys, then the ranks by element
    lo,
    hi,
    W,
    num_selected,
    DEPTH: tl.constexpr,
    BLOCK: tl.constexpr,
    IB: tl.constexpr,  # log2(BLOCK): the bits of an element index
):
    """One program. Element ``e < W`` is position ``c = hi - 1 - e`` read backwards: its
    value is ``tokens[hi - 2 - e]`` (``tokens[c - 1]``), so the key of ``c`` is the run of
    ``DEPTH`` values from element ``e`` on, and elements past ``W`` are ``END`` (rank 0).
    Rounds as the torch path's (three blocks a round: an element index and three ranks of
    ``IB + 1`` bits fit one int64 key); ties keep ascending ``e``, i.e. descending ``c``."""
    e = tl.arange(0, BLOCK)
    valid = e < W
    RB: tl.constexpr = IB + 1  # a rank is in [0, W], W <= BLOCK
    s = tl.zeros([BLOCK], dtype=tl.int64)
    covered = 0
    while covered < DEPTH:
        if covered == 0:  # the values themselves, separators below tokens
            k = tl.load(tokens_ptr + (hi - 2 - e), mask=valid, other=0).to(tl.int64) \
                + 0x80000000
            L = 1
        else:
            # dense ranks (from 1) of the last sort's keys, scattered to their elements
            tl.store(work_ptr + e, s >> IB)
            tl.debug_barrier()
            prev = tl.load(work_ptr + e - 1, mask=e > 0, other=-1, cache_modifier=".cg")
            rank = tl.cumsum(((s >> IB) != prev).to(tl.int64), 0)
            tl.store(work_ptr + BLOCK + (s & (BLOCK - 1)), rank, mask=valid)
            tl.debug_barrier()
            # the blocks at e, e + covered (while it is short of the last) and e + L - covered
            L = tl.minimum(3 * covered, DEPTH)
            k = tl.load(work_ptr + BLOCK + e, mask=valid, other=0, cache_modifier=".cg")
            if covered < L - covered:
                at = e + covered
                k = (k << RB) | tl.load(work_ptr + BLOCK + at, mask=at < W, other=0,
                                        cache_modifier=".cg")
            at = e + L - covered
            k = (k << RB) | tl.load(work_ptr + BLOCK + at, mask=at < W, other=0,
                                    cache_modifier=".cg")
            # (the next round writes ranks only after its first barrier: past these reads)
        s = tl.sort(tl.where(valid, (k << IB) | e, _KEY_MAX))
        covered = L
    # the selection, in key order: c in [lo, hi) with tokens[c - 1] and tokens[c] tokens
    el = s & (BLOCK - 1)
    before = tl.load(tokens_ptr + (hi - 2 - el), mask=valid, other=-1)
    at_c = tl.load(tokens_ptr + (hi - 1 - el), mask=valid, other=-1)
    keep = valid & (el < hi - lo) & (before >= 0) & (at_c >= 0)
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(out_ptr + slot, (hi - 1 - el).to(tl.int32), mask=keep & (slot < num_selected))


def context_array(tokens: torch.Tensor, lo: int, hi: int, depth: int, *, num_selected: int,
                  out: torch.Tensor | None = None, work: torch.Tensor | None = None,
                  use_triton: bool | None = None, block: int | None = None) -> torch.Tensor:
    """:func:`build_context_array` of ``tokens`` (``int32 [n]``) over ``[lo, hi)``, written
    to ``out`` (``int32 [num_selected]``, e.g. a view of the arena's suffix-array buffer;
    allocated when None) and returned.

    ``num_selected``: the size of the selection (:func:`num_context_positions`), which the
    caller knows (the kernel writes at most that many; the torch path on a CPU checks it).
    ``work``: ``int64 [2 * MAX_BLOCK]`` scratch for the kernel, kept by a caller that
    builds often (allocated when None). ``use_triton``: the kernel when True (also under
    ``TRITON_INTERPRET=1``), torch when False; default: the kernel for CUDA tensors. Either
    way a window (``hi - max(lo - depth, 0) - 1`` positions) over :data:`MAX_BLOCK` takes the
    torch path. ``block``: the window one program sorts, a power of two at least the window
    and at most :data:`MAX_BLOCK` (default: 1024 or 4096, two compiles in all; a test under
    the interpreter passes a small one). Nothing is read back from the device.

    Raises:
        ValueError: naming the argument: ``tokens`` not ``int32 [n]`` and contiguous, a bad
            range or depth, ``num_selected``, ``out``, ``block`` or ``work``.
    """
    dev = tokens.device
    check_array("tokens", tokens, torch.int32, 1, dev)
    _check_range("context_array", tokens, lo, hi, depth)
    if not is_py_int(num_selected) or \
            not 0 <= num_selected <= max(hi - max(lo, 1), 0):
        raise ValueError(f"num_selected: expected an int in [0, {max(hi - max(lo, 1), 0)}] "
                         f"(positions in the range), got {num_selected!r}")
    if out is None:
        out = torch.empty(num_selected, dtype=torch.int32, device=dev)
    check_array("out", out, torch.int32, 1, dev)
    if out.numel() != num_selected:
        raise ValueError(f"out: expected {num_selected} elements (num_selected), got "
                         f"{out.numel()}")
    if num_selected == 0:  # (an empty range included: lo = 1 would pass hi = 0)
        return out
    lo = max(lo, 1)  # position 0 has an empty context
    W = hi - 1 - max(0, lo - depth)  # the window: every value a key reads
    if use_triton is None:
        use_triton = dev.type == "cuda"
    if not use_triton or W > MAX_BLOCK:
        out.copy_(build_context_array(tokens, lo, hi, depth, num_selected=num_selected))
        return out
    if block is None:
        block = max(next_pow2(W), _MIN_BLOCK)
    elif not is_py_int(block) or block < max(W, 2) or \
            block > MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block: expected a power of two in [{max(next_pow2(W), 2)}, "
                         f"{MAX_BLOCK}] (the window holds {W}), got {block!r}")
    if work is None:
        work = torch.empty(2 * MAX_BLOCK, dtype=torch.int64, device=dev)
    check_array("work", work, torch.int64, 1, dev)
    if work.numel() < 2 * block:
        raise ValueError(f"work: expected at least {2 * block} elements, got {work.numel()}")
    _context_array_kernel[(1,)](tokens, out, work, lo, hi, W, num_selected, DEPTH=depth,
                                BLOCK=block, IB=block.bit_length() - 1,
                                num_warps=4 if block <= 1024 else 8)
    return out
