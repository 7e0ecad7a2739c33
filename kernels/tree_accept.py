"""Accept the longest matching root-to-node path of each draft tree, one program per request.

Verification ends with a walk down each tree: from the root, take the lowest-index child
whose token equals the target's, until none does. Expressed with batched torch ops the walk
is a loop over depths of about ten small kernels each, hundreds per step on a GPU where the
GPU work is microseconds. The kernel walks every request's tree in one program: the tree's
nodes in registers, one level per iteration (a vector compare and a min), no global memory
but the inputs and the path.

Two ways to say what a node must match (``by_depth``):

* greedy verification: ``expected[b, 0]`` is the target's token at the root and
  ``expected[b, 1 + j]`` at node ``j``; node ``j`` matches iff its token equals the target at
  its parent (``expected[b, 1 + parents[b, j]]``);
* teacher forcing (a replayed trajectory): ``expected[b, d]`` is the true token at depth
  ``d + 1``; a node at depth ``d + 1`` matches iff its token equals it. Depths past
  ``expected``'s width never match.

Sibling nodes with the same token (a drafter should merge them): greedy verification walks
into the lower-index one (what a serving engine's sequential walk does); teacher forcing
accepts the deepest path that spells the truth and reports the lowest-index matched node of
each depth (the replay's measurement: a duplicate never costs acceptance).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from agspec_gpu.kernels._checks import check_devices, is_py_int
from agspec_gpu.kernels._launch import cast, next_pow2

MAX_BLOCK_N = 128  # by depth keeps a [BLOCK_N, BLOCK_N] compare in registers; wider: torch
_NO_MATCH = -2  # what a target row past the batch's reads as: a token no draft node carries


def num_warps(N: int, by_depth: bool) -> int:
    """Warps of the walk's program: 8 where the by-depth walk's ``[BLOCK_N, BLOCK_N]``
    compare of 128 nodes would spill registers with 4 (``ptxas -v`` for sm_90: 255
    registers and a spill at 4 warps, none at 8; ``tests/test_tree_accept.py``)."""
    return 8 if by_depth and next_pow2(max(N, 1)) >= 128 else 4


# the draft width, row strides, logit rows and depth bound change every step: not
# specialized, one compile per mode and BLOCK_N
@triton.jit(do_not_specialize=["N", "stride_tok", "stride_par", "E", "D"],
            # drafts, sizes, targets and row offsets may be views of a staging ring or of a
            # plan (an e2e replay step's): their alignment is not specialized
            do_not_specialize_on_alignment=["tok_ptr", "par_ptr", "num_ptr", "exp_ptr",
                                            "row_ptr"])
def _tree_accept_kernel(
    tok_ptr,  # *int32 [B, N] (row stride stride_tok)  draft tokens, topological order
    par_ptr,  # *int32 [B, N] (row stride stride_par)  parents (< j), -1: a child of the root
    num_ptr,  # *int32 [B]  valid nodes per request
    exp_ptr,  # *int64 [B, E]  expected tokens (see the module docstring); ROWS: [E] rows
    row_ptr,  # *int32 [B]  ROWS: request b's expected tokens start at exp_ptr + row_ptr[b]
    path_ptr,  # *int64 or *int32 [B, D]  accepted nodes in path order, -1 padded
    nacc_ptr,  # *int64 or *int32 [B]  accepted nodes
    out_ptr,  # *int32 [B, D + 1]  EMIT: accepted tokens, then the bonus, -1 padded
    nout_ptr,  # *int32 [B]  EMIT: accepted nodes + 1
    bonus_ptr,  # *int32 [B]  EMIT: the bonus token
    N,
    stride_tok,
    stride_par,
    E,
    D,
    NO_MATCH,  # a token no draft node carries
    BLOCK_N: tl.constexpr,
    BY_DEPTH: tl.constexpr,
    EMIT: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Grid ``(B,)``: the walk of one request, ``D`` levels at most; with ``EMIT`` (greedy)
    also the tokens it outputs: the accepted nodes' tokens, then the bonus token (the target
    at the last accepted node, or at the root). ``ROWS``: the expected tokens are the flat
    rows of a ragged batch (its ``qo_indptr[:-1]`` in ``row_ptr``), not ``[B, E]``; reads
    outside the ``E`` rows (an inconsistent ``row_ptr``) load ``NO_MATCH``, never fault."""
    b = tl.program_id(0).to(tl.int64)
    if ROWS:  # the valid offsets from the request's first row: inside the E rows
        base = tl.load(row_ptr + b).to(tl.int64)
        lo, hi = -base, E - base
    else:  # inside the request's row of E
        base = b * E
        lo, hi = base * 0, base * 0 + E
    exp_ptr += base
    j = tl.arange(0, BLOCK_N)
    inb = j < N
    valid = inb & (j < tl.load(num_ptr + b))
    tok = tl.load(tok_ptr + b * stride_tok + j, mask=inb, other=0).to(tl.int64)
    par = tl.load(par_ptr + b * stride_par + j, mask=inb, other=-1)
    if not BY_DEPTH:  # the target at the node's parent: expected column parents + 1
        want = tl.load(exp_ptr + par + 1, mask=valid & (par + 1 >= lo) & (par + 1 < hi),
                       other=NO_MATCH)
        match = valid & (tok == want) & (tok >= 0)  # (a negative token matches nothing)
    cur = tl.zeros((), tl.int32) - 1  # greedy: the walk's current node
    level = par == -1  # by depth: the nodes whose ancestors all matched, one level at a time
    alive = tl.zeros((), tl.int32) + 1
    num = tl.zeros((), tl.int64)
    d = tl.zeros((), tl.int32)
    while d < D:  # no break: compiled loops cannot; `alive` stops the walk instead
        if BY_DEPTH:
            want_d = tl.load(exp_ptr + d, mask=d < hi, other=NO_MATCH)
            hit = level & valid & (tok == want_d) & (tok >= 0)
            # the next level: children of this level's matched nodes
            level = tl.max(((par[:, None] == j[None, :]) & hit[None, :]).to(tl.int32),
                           axis=1) > 0
        else:
            hit = match & (par == cur)
        child = tl.min(tl.where(hit & (alive != 0), j, BLOCK_N), axis=0)
        has = (child < BLOCK_N).to(tl.int32)
        tl.store(path_ptr + b * D + d, tl.where(has != 0, child, -1).to(tl.int64))
        if EMIT:  # the child's token; at the first miss the bonus; then padding
            bonus = tl.load(exp_ptr + cur + 1, mask=(cur + 1 >= lo) & (cur + 1 < hi),
                            other=NO_MATCH)
            out = tl.where(alive != 0, bonus, -1)
            out = tl.where(has != 0, tl.sum(tl.where(j == child, tok, 0), axis=0), out)
            tl.store(out_ptr + b * (D + 1) + d, out.to(tl.int32))
        cur = tl.where(has != 0, child, cur)
        num += has
        alive = alive * has
        d += 1
    tl.store(nacc_ptr + b, num)
    if EMIT:  # every level accepted: the bonus is the last column
        bonus = tl.load(exp_ptr + cur + 1, mask=(cur + 1 >= lo) & (cur + 1 < hi),
                        other=NO_MATCH)
        tl.store(out_ptr + b * (D + 1) + D, tl.where(alive != 0, bonus, -1).to(tl.int32))
        tl.store(nout_ptr + b, (num + 1).to(tl.int32))
        tl.store(bonus_ptr + b, bonus.to(tl.int32))


def tree_accept_torch(token_ids: torch.Tensor, parents: torch.Tensor,
                      num_draft_tokens: torch.Tensor, expected: torch.Tensor, *,
                      by_depth: bool, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch implementation of :func:`tree_accept`, the same path without a loop over
    levels (no host reads, ``O(log N)`` batched ops): depths by pointer jumping; a node is
    accepted iff it and each of its ancestors matches (greedy: and has no matching sibling of
    lower index), pointer jumping again; the path lists the lowest accepted node by depth."""
    B, N = token_ids.shape
    dev = token_ids.device
    path = torch.full((B, max_depth), -1, dtype=torch.long, device=dev)
    if N == 0 or max_depth == 0:
        return torch.zeros(B, dtype=torch.long, device=dev), path
    cols = torch.arange(N, device=dev)
    valid = cols[None, :] < num_draft_tokens.to(dev)[:, None]
    par = torch.where(valid, parents.long(), -1)
    tok = token_ids.long()

    def up(x: torch.Tensor, combine) -> torch.Tensor:
        """Folds each node's ancestors into ``x`` by pointer jumping (``ceil(log2 N)``
        rounds): ``x[j]`` becomes ``combine`` over ``j`` and every ancestor of ``j``."""
        anc = par
        for _ in range(max(N - 1, 1).bit_length()):
            has = anc >= 0
            a = anc.clamp(min=0)
            x = torch.where(has, combine(x, x.gather(1, a)), x)
            anc = torch.where(has, anc.gather(1, a), -1)
        return x

    depth = up(valid.long(), torch.add)  # nodes from j up to the root's child
    E = expected.shape[1]
    # a node's token matches only as a token: a negative value (a sentinel, the truth's
    # NO_TOKEN padding, the kernel's NO_MATCH) never does
    if by_depth and E == 0:
        ok = torch.zeros_like(valid)
    elif by_depth:
        ok = valid & (tok >= 0) & (depth <= E) & \
            (tok == expected.gather(1, (depth - 1).clamp(0, E - 1)))
    else:
        ok = valid & (tok >= 0) & (tok == expected.gather(1, par + 1))
    if by_depth:  # every node whose ancestors all matched (the deepest path wins)
        on = up(ok, torch.logical_and)
    else:  # the walk takes the lowest-index matching child of each node it reaches
        blocked = ((par[:, :, None] == par[:, None, :]) & ok[:, None, :]
                   & (cols[None, None, :] < cols[None, :, None])).any(2)
        on = up(ok & ~blocked, torch.logical_and)
    on &= depth <= max_depth
    num = torch.where(on, depth, 0).amax(1)
    table = torch.full((B, N + 1), N, dtype=torch.long, device=dev)  # column 0: off the path
    table.scatter_reduce_(1, torch.where(on, depth, 0), cols.expand(B, N).contiguous(),
                          reduce="amin")
    w = min(N, max_depth)
    path[:, :w] = torch.where(table[:, 1:w + 1] < N, table[:, 1:w + 1], -1)
    return num, path


def _check_walk(token_ids, parents, num_draft_tokens, expected, by_depth: bool,
                max_depth: int, name: str = "expected", flat: bool = False) -> None:
    """The launchers' argument checks (ValueError naming the argument); ``flat``: the
    expected tokens are a ragged batch's rows, ``int64 [T]``."""
    if token_ids.dim() != 2 or parents.shape != token_ids.shape:
        raise ValueError(f"token_ids, parents: expected the same [B, N], got "
                         f"{tuple(token_ids.shape)}, {tuple(parents.shape)}")
    B, N = token_ids.shape
    for nm, t in (("token_ids", token_ids), ("parents", parents),
                  ("num_draft_tokens", num_draft_tokens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{nm}: expected int32 (or int64), got {t.dtype}")
    if num_draft_tokens.shape != (B,):
        raise ValueError(f"num_draft_tokens: expected shape ({B},), got "
                         f"{tuple(num_draft_tokens.shape)}")
    if flat and (expected.dim() != 1 or expected.dtype != torch.int64):
        raise ValueError(f"{name}: expected int64 [T] (flat rows), got {expected.dtype} "
                         f"{tuple(expected.shape)}")
    if not flat and (expected.dim() != 2 or expected.shape[0] != B
                     or expected.dtype != torch.int64):
        raise ValueError(f"{name}: expected int64 [{B}, E], got {expected.dtype} "
                         f"{tuple(expected.shape)}")
    if not flat and not by_depth and expected.shape[1] != N + 1:
        raise ValueError(f"{name}: [B, N + 1 = {N + 1}] targets (root, then each node), got "
                         f"{tuple(expected.shape)}")
    if not is_py_int(max_depth) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    check_devices(("token_ids", token_ids), ("parents", parents),
                  ("num_draft_tokens", num_draft_tokens), (name, expected))


def tree_accept(token_ids: torch.Tensor, parents: torch.Tensor, num_draft_tokens: torch.Tensor,
                expected: torch.Tensor, *, by_depth: bool, max_depth: int,
                use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path of every request's draft tree.

    Parameters
    ----------
    token_ids, parents : ``int32 [B, N]`` (``parents[b, j] < j``; -1 for the root's children)
    num_draft_tokens : ``int32 [B]`` valid nodes per request (columns past it are padding)
        (the three may be int64: both paths read them as int32, so their values must fit
        it, as a vocabulary's ids and node counts do)
    expected : ``int64 [B, E]``: ``E = N + 1`` targets at the root and each node
        (``by_depth=False``), or the true tokens at depths ``1 .. E`` (``by_depth=True``)
    max_depth : levels to walk (``D``, the path's width)
    use_triton : bool, optional
        Triton when True (also under ``TRITON_INTERPRET=1``), torch when False; default:
        Triton for CUDA tensors.

    Returns
    -------
    ``(num_accepted int64 [B], path int64 [B, D])``: ``path[b, :num_accepted[b]]`` are the
    accepted nodes from the root down, ``-1`` after them.
    """
    _check_walk(token_ids, parents, num_draft_tokens, expected, by_depth, max_depth)
    B, N = token_ids.shape
    dev = token_ids.device
    if use_triton is None:
        use_triton = dev.type == "cuda"
    if not use_triton or N > MAX_BLOCK_N:  # (int32, as the kernel reads them)
        return tree_accept_torch(*(cast(t, torch.int32) for t in
                                   (token_ids, parents, num_draft_tokens)), expected,
                                 by_depth=by_depth, max_depth=max_depth)
    num = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.empty(B, max_depth, dtype=torch.long, device=dev)
    if B and max_depth:
        num_draft_tokens = cast(num_draft_tokens, torch.int32).contiguous()
        tok, par = _rows(token_ids), _rows(parents)
        _tree_accept_kernel[(B,)](
            tok, par, num_draft_tokens, expected.contiguous(), num_draft_tokens, path, num, num,
            num, num, N, tok.stride(0), par.stride(0), expected.shape[1], max_depth, _NO_MATCH,
            BLOCK_N=max(next_pow2(N), 1), BY_DEPTH=by_depth, EMIT=False,
            ROWS=False, num_warps=num_warps(N, by_depth))
    return num, path


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel reads it: int32 with unit column stride, rows at any stride (a
    draft narrowed to a step's width is read in place, not copied)."""
    x = cast(x, torch.int32)
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def path_outputs_torch(token_ids: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                       bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output_ids int32 [B, D + 1], num_output int32 [B])`` of accepted paths ``path
    [B, D]`` (-1 padded, ``num_accepted [B]`` long) and bonus tokens ``[B]``: the path's
    tokens, then the bonus, then -1."""
    B = path.shape[0]
    path = path.long()
    # (no nodes: every path entry is -1, and there is nothing to gather from)
    tok = token_ids.long().gather(1, path.clamp(min=0)) if token_ids.shape[1] else \
        torch.full_like(path, -1)
    out = torch.cat([torch.where(path >= 0, tok, -1),
                     torch.full((B, 1), -1, dtype=torch.long, device=path.device)], 1)
    out.scatter_(1, num_accepted.long()[:, None], bonus.long()[:, None])
    return out.to(torch.int32), (num_accepted + 1).to(torch.int32)


def greedy_tree_accept(token_ids: torch.Tensor, parents: torch.Tensor,
                       num_draft_tokens: torch.Tensor, target: torch.Tensor, *, max_depth: int,
                       row_start: torch.Tensor | None = None, use_triton: bool | None = None,
                       out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Greedy verification's walk and what it outputs, in one kernel on a GPU.

    ``target``: the target's token (its argmax) at the root and at each node, ``int64 [B,
    N + 1]``; or, with ``row_start`` (``int32 [B]``, a ragged batch's ``qo_indptr[:-1]``),
    the flat ``int64 [T]`` over the batch's rows, request ``b``'s root at ``row_start[b]``
    and node ``j`` at ``row_start[b] + 1 + j``. Returns ``(num_accepted [B], path [B, D],
    output_ids [B, D + 1], num_output [B], bonus [B])``, all int32: :func:`tree_accept`'s
    path (``by_depth=False``), the accepted tokens followed by the bonus token (the target
    at the last accepted node; -1 after it), ``num_accepted + 1`` and the bonus token.
    ``out``: those five tensors (int32, contiguous, of those shapes) to write and return,
    a serving loop's preallocated buffers; None: new ones. The draft's tensors are read as
    int32, as :func:`tree_accept` reads them.
    """
    flat = row_start is not None
    _check_walk(token_ids, parents, num_draft_tokens, target, False, max_depth, "target",
                flat=flat)
    B, N = token_ids.shape
    if out is not None:
        _check_outputs(out, B, max_depth, token_ids.device)
    if flat:
        if row_start.shape != (B,) or row_start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"row_start: expected int32 [{B}], got {row_start.dtype} "
                             f"{tuple(row_start.shape)}")
        check_devices(("target", target), ("row_start", row_start))
    dev = token_ids.device
    if use_triton is None:
        use_triton = dev.type == "cuda"
    if not use_triton or N > MAX_BLOCK_N or B == 0 or max_depth == 0:
        token_ids, parents, num_draft_tokens = (cast(t, torch.int32) for t in
                                                (token_ids, parents, num_draft_tokens))
        if flat:  # the padded [B, N + 1] targets (columns past a request: any row; past
            # the T rows or before them, an inconsistent row_start: NO_MATCH, as the
            # kernel loads them)
            cols = row_start.long()[:, None] + torch.arange(N + 1, device=dev)
            T = target.shape[0]
            target = torch.where((cols >= 0) & (cols < T), target[cols.clamp(0, max(T - 1, 0))],
                                 _NO_MATCH) \
                if T else torch.full((B, N + 1), _NO_MATCH, dtype=torch.int64, device=dev)
        num, path = tree_accept_torch(token_ids, parents, num_draft_tokens, target,
                                      by_depth=False, max_depth=max_depth)
        last = path.gather(1, (num - 1).clamp(min=0)[:, None])[:, 0] if max_depth else num
        cur = torch.where(num > 0, last, -1)
        bonus = target.gather(1, (cur + 1)[:, None])[:, 0]
        ids, nout = path_outputs_torch(token_ids, path, num, bonus)
        result = (num.to(torch.int32), path.to(torch.int32), ids, nout, bonus.to(torch.int32))
        if out is None:
            return result
        for o, r in zip(out, result):
            o.copy_(r)
        return tuple(out)
    if out is None:
        i32 = lambda *shape: torch.empty(*shape, dtype=torch.int32, device=dev)  # noqa: E731
        out = (i32(B), i32(B, max_depth), i32(B, max_depth + 1), i32(B), i32(B))
    num, path, ids, nout, bonus = out
    num_draft_tokens = cast(num_draft_tokens, torch.int32).contiguous()
    tok, par = _rows(token_ids), _rows(parents)
    _tree_accept_kernel[(B,)](
        tok, par, num_draft_tokens, target.contiguous(),
        num_draft_tokens if row_start is None else row_start.contiguous(), path, num, ids,
        nout, bonus, N, tok.stride(0), par.stride(0), target.shape[0] if flat else N + 1,
        max_depth, _NO_MATCH,
        BLOCK_N=max(next_pow2(N), 1), BY_DEPTH=False, EMIT=True, ROWS=flat,
        num_warps=num_warps(N, False))
    return num, path, ids, nout, bonus


def _check_outputs(out: Sequence[torch.Tensor], B: int, D: int, device: torch.device) -> None:
    """Raises ValueError naming the first of :func:`greedy_tree_accept`'s ``out`` tensors
    that is not int32, contiguous, on ``device`` and of its shape."""
    names = ("num_accepted", "path", "output_ids", "num_output", "bonus")
    if len(out) != len(names):
        raise ValueError(f"out: expected {len(names)} tensors ({', '.join(names)}), got "
                         f"{len(out)}")
    for name, t, shape in zip(names, out, ((B,), (B, D), (B, D + 1), (B,), (B,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous() or \
                t.device != device:
            raise ValueError(f"out: {name} must be a contiguous int32 {list(shape)} on "
                             f"{device}, got {t.dtype} {list(t.shape)} on {t.device}")
