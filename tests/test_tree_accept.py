"""The tree-acceptance walk: the Triton kernel (interpreted on CPU) and the torch path equal a
plain Python walk on random trees, duplicate sibling tokens, depth and width bounds, empty and
one-node drafts, in both modes (greedy targets at the parent; true tokens by depth), and
greedy's output tokens (the path's, then the bonus); the kernel compiles for sm_90."""

import numpy as np
import pytest
import torch

import agspec_gpu.kernels.tree_accept as tree_accept_mod
from agspec_gpu.kernels.tree_accept import (MAX_BLOCK_N, _tree_accept_kernel, greedy_tree_accept,
                                             num_warps, tree_accept, tree_accept_torch)
from kernel_compile import (NoLaunch, compile_all_for_sm90, num_compiles,
                            recorded_specializations)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NO = -2


def walk(tokens, parents, n, expected, by_depth, max_depth):
    """The definitions. Greedy: from the root, the lowest-index child matching the target at
    its parent, level by level. By depth: the set of nodes whose whole path spells the truth,
    level by level; the lowest-index node of each level is reported."""
    cur, path = -1, []
    level = {-1}
    for d in range(max_depth):
        if by_depth:
            want = expected[d] if d < len(expected) else NO
            level = {j for j in range(n) if parents[j] in level and tokens[j] == want}
            if not level:
                break
            path.append(min(level))
            continue
        nxt = next((j for j in range(n) if parents[j] == cur and tokens[j] == expected[cur + 1]),
                   None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    return path


def random_case(rng, B, N, vocab, by_depth, W):
    tok = np.full((B, N), -1, dtype=np.int32)
    par = np.full((B, N), -1, dtype=np.int32)
    num = rng.integers(0, N + 1, B).astype(np.int32)
    for b in range(B):
        for j in range(num[b]):
            par[b, j] = rng.integers(-1, j) if j else -1
            tok[b, j] = rng.integers(0, vocab)
    if by_depth:
        exp = rng.integers(0, vocab, (B, W)).astype(np.int64)
        cut = rng.integers(0, W + 1, B)
        for b in range(B):
            exp[b, cut[b]:] = NO  # past the message end
    else:
        exp = rng.integers(0, vocab, (B, N + 1)).astype(np.int64)
    return tok, par, num, exp


def check(tok, par, num, exp, by_depth, D):
    t = [torch.from_numpy(x).to(DEV) for x in (tok, par, num, exp)]
    got = tree_accept(*t, by_depth=by_depth, max_depth=D, use_triton=True)
    ref = tree_accept_torch(*t, by_depth=by_depth, max_depth=D)
    for b in range(tok.shape[0]):
        want = walk(tok[b].tolist(), par[b].tolist(), int(num[b]), exp[b].tolist(), by_depth, D)
        for name, (n, p) in (("triton", got), ("torch", ref)):
            assert int(n[b]) == len(want), (name, b, want, p[b].tolist())
            assert p[b].tolist() == want + [-1] * (D - len(want)), (name, b)
    if by_depth:
        return
    # the flat layout of a ragged batch: request b's 1 + num[b] rows at row_start[b]
    qo = np.concatenate([[0], np.cumsum(1 + num)])
    flat = np.concatenate([exp[b, :1 + num[b]] for b in range(len(num))] + [
        np.zeros(0, np.int64)])
    flat_t = (torch.from_numpy(flat).to(DEV), torch.from_numpy(qo[:-1].astype(np.int32)).to(DEV))
    for use_triton in (True, False):  # greedy: the walk, its output tokens, the bonus
        for rows in (None, flat_t):
            target, row_start = (t[3], None) if rows is None else rows
            n, p, out, nout, bonus = greedy_tree_accept(*t[:3], target, max_depth=D,
                                                        row_start=row_start,
                                                        use_triton=use_triton)
            assert all(x.dtype == torch.int32 for x in (n, p, out, nout, bonus))
            assert torch.equal(n.long().cpu(), ref[0].cpu()) and torch.equal(p.long(), ref[1])
            # into a caller's buffers (garbage-filled): the same, in them
            bufs = garbage_outputs(tok.shape[0], D)
            got = greedy_tree_accept(*t[:3], target, max_depth=D, row_start=row_start,
                                     use_triton=use_triton, out=bufs)
            assert all(g is o and torch.equal(g, x)
                       for g, o, x in zip(got, bufs, (n, p, out, nout, bonus)))
            assert torch.equal(nout, n + 1)
            for b in range(tok.shape[0]):
                path = ref[1][b, :int(ref[0][b])].tolist()
                want_bonus = int(exp[b, 1 + (path[-1] if path else -1)])
                want = [int(tok[b, j]) for j in path] + [want_bonus]
                assert out[b].tolist() == want + [-1] * (D + 1 - len(want)), \
                    (use_triton, rows is None, b)
                assert int(bonus[b]) == want_bonus


def garbage_outputs(B: int, D: int) -> tuple[torch.Tensor, ...]:
    """``greedy_tree_accept``'s five outputs as a caller keeps them: views of one buffer
    (a serving loop's, used by earlier steps), filled with garbage."""
    sizes = [B, B * D, B * (D + 1), B, B]
    parts = torch.full((sum(sizes) + 3,), 99, dtype=torch.int32, device=DEV)[3:].split(sizes)
    return parts[0], parts[1].view(B, D), parts[2].view(B, D + 1), parts[3], parts[4]


def test_greedy_walk_rejects_bad_output_buffers():
    tok = torch.tensor([[3, 4]], dtype=torch.int32, device=DEV)
    par = torch.tensor([[-1, 0]], dtype=torch.int32, device=DEV)
    num = torch.tensor([2], dtype=torch.int32, device=DEV)
    target = torch.tensor([[3, 4, 5]], dtype=torch.int64, device=DEV)
    good = garbage_outputs(1, 2)
    bad = [("out: expected 5", good[:4]), ("num_accepted", (good[0].long(),) + good[1:]),
           ("path", good[:1] + (good[1].view(2, 1),) + good[2:]),
           ("output_ids", good[:2] + (good[1],) + good[3:]),
           ("bonus", good[:4] + (torch.zeros(2, dtype=torch.int32, device=DEV),))]
    for match, out in bad:
        for u in (True, False):
            with pytest.raises(ValueError, match=match):
                greedy_tree_accept(tok, par, num, target, max_depth=2, use_triton=u, out=out)
    n, _, ids, _, _ = greedy_tree_accept(tok, par, num, target, max_depth=2, out=good)
    assert int(n[0]) == 2 and ids.tolist() == [[3, 4, 5]]


@pytest.mark.parametrize("by_depth", [False, True])
@pytest.mark.parametrize("B,N,vocab", [(1, 1, 2), (3, 5, 2), (8, 16, 3), (4, 64, 2),
                                       (2, 64, 50), (5, 100, 2)])
def test_walk_matches_definition(by_depth, B, N, vocab):
    """Tiny vocabularies: matches and duplicate sibling tokens are common."""
    rng = np.random.default_rng(B * 1000 + N + by_depth)
    for D in (N, 3, 0):
        case = random_case(rng, B, N, vocab, by_depth, W=int(rng.integers(0, N + 2)))
        check(*case, by_depth, D)


@pytest.mark.parametrize("by_depth", [False, True])
def test_chains_and_empty_batches(by_depth):
    # a chain of repeated tokens (periodic text), every node matching: the depth bound cuts it
    N = 12
    tok = np.full((2, N), 7, dtype=np.int32)
    par = np.tile(np.arange(-1, N - 1, dtype=np.int32), (2, 1))
    num = np.array([N, 5], dtype=np.int32)
    exp = np.full((2, N + 1), 7, dtype=np.int64)
    for D in (N, 4):
        check(tok, par, num, exp, by_depth, D)
    empty = [np.zeros((0, 3), np.int32), np.zeros((0, 3), np.int32), np.zeros(0, np.int32),
             np.zeros((0, 4 if not by_depth else 2), np.int64)]
    n, p = tree_accept(*[torch.from_numpy(x).to(DEV) for x in empty], by_depth=by_depth,
                       max_depth=3, use_triton=True)
    assert n.shape == (0,) and p.shape == (0, 3)
    if not by_depth:
        n, p, out, nout, bonus = greedy_tree_accept(
            *[torch.from_numpy(x).to(DEV) for x in empty], max_depth=3, use_triton=True)
        assert n.shape == nout.shape == bonus.shape == (0,) and p.shape == (0, 3)
        assert out.shape == (0, 4)


@pytest.mark.parametrize("by_depth", [False, True])
def test_drafts_narrowed_to_a_width_are_read_in_place(by_depth):
    """A serving step narrows its drafts to the step's width (column views of wider
    buffers, other rows' garbage past the width): the kernel reads them at their row stride,
    without a copy, and equals the torch path and the walk on the same trees."""
    rng = np.random.default_rng(7 + by_depth)
    tok, par, num, exp = random_case(rng, 5, 24, 2, by_depth, W=20)
    tok[:, 20:], par[:, 20:] = 1, 0  # never read: past num (narrowed below)
    num = np.minimum(num, 20)
    wide = [torch.from_numpy(x).to(DEV) for x in (tok, par)]
    narrow = [x[:, :20] for x in wide]
    assert not narrow[0].is_contiguous()
    e = torch.from_numpy(exp if by_depth else exp[:, :21].copy()).to(DEV)
    n = torch.from_numpy(num).to(DEV)
    ref = tree_accept_torch(*[x.contiguous() for x in narrow], n, e, by_depth=by_depth,
                            max_depth=20)
    got = tree_accept(*narrow, n, e, by_depth=by_depth, max_depth=20, use_triton=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    if not by_depth:
        outs = [greedy_tree_accept(*narrow, n, e, max_depth=20, use_triton=u)
                for u in (True, False)]
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        assert torch.equal(outs[0][1].long(), ref[1])


def test_rejects_bad_inputs():
    t = torch.zeros(2, 3, dtype=torch.int32)
    num = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected: expected int64"):
        tree_accept(t, t, num, torch.zeros(2, 4, dtype=torch.int32), by_depth=False,
                    max_depth=3)
    with pytest.raises(ValueError, match="N \\+ 1"):
        tree_accept(t, t, num, torch.zeros(2, 3, dtype=torch.int64), by_depth=False,
                    max_depth=3)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        tree_accept(t, t, num[:1], torch.zeros(2, 4, dtype=torch.int64), by_depth=False,
                    max_depth=3)
    with pytest.raises(ValueError, match="max_depth"):
        tree_accept(t, t, num, torch.zeros(2, 4, dtype=torch.int64), by_depth=False,
                    max_depth=-1)
    for bad in ((t.float(), t, num), (t, t.float(), num), (t, t, num.float())):
        with pytest.raises(ValueError, match="expected int32"):  # float ids: named
            tree_accept(*bad, torch.zeros(2, 4, dtype=torch.int64), by_depth=False,
                        max_depth=3)


def test_int64_drafts_are_read_as_int32_on_both_paths():
    """int64 token ids, parents and sizes are read as int32 by the kernel: the torch path
    reads them so too (it compared a token of 2**32 + 5 as itself, the kernel as 5)."""
    tok = torch.tensor([[2**32 + 5, 7]], dtype=torch.int64)
    par = torch.tensor([[-1, 0]], dtype=torch.int64)
    target = torch.tensor([[5, 7, 9]], dtype=torch.int64)
    for num in (torch.tensor([2]), torch.tensor([2**32 + 2])):
        got = [tree_accept(tok, par, num, target, by_depth=False, max_depth=2,
                           use_triton=u) for u in (True, False)]
        assert all(torch.equal(a, b) for a, b in zip(*got)), num
        walks = [greedy_tree_accept(tok, par, num, target, max_depth=2, use_triton=u)
                 for u in (True, False)]
        assert all(torch.equal(a, b) for a, b in zip(*walks)) and \
            walks[0][0].tolist() == [2], num


def test_rejects_a_tensor_on_another_device():
    t = torch.zeros(2, 3, dtype=torch.int32)
    num = torch.zeros(2, dtype=torch.int32)
    exp = torch.zeros(2, 4, dtype=torch.int64)
    for name, args in (("parents", (t, t.to("meta"), num, exp)),
                       ("num_draft_tokens", (t, t, num.to("meta"), exp)),
                       ("expected", (t, t, num, exp.to("meta")))):
        with pytest.raises(ValueError, match=f"^{name}: on meta"):
            tree_accept(*args, by_depth=False, max_depth=3, use_triton=True)
    with pytest.raises(ValueError, match="^target: on meta"):
        greedy_tree_accept(t, t, num, exp.to("meta"), max_depth=3, use_triton=True)
    rows, start = torch.zeros(5, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^row_start: on meta"):
        greedy_tree_accept(t, t, num, rows, max_depth=3, row_start=start.to("meta"),
                           use_triton=True)
    out = tuple(o.to("meta") if i == 2 else o for i, o in enumerate(garbage_outputs(2, 3)))
    with pytest.raises(ValueError, match="^out: output_ids .* on meta"):
        greedy_tree_accept(t, t, num, exp, max_depth=3, use_triton=True, out=out)


@pytest.mark.parametrize("by_depth", [False, True])
def test_drafts_wider_than_the_kernels_block_run_the_torch_path(by_depth, monkeypatch):
    """N > MAX_BLOCK_N: both launchers run the torch path (the kernel must not launch) and
    equal the walk's definition and ``tree_accept_torch``."""
    monkeypatch.setattr(tree_accept_mod, "_tree_accept_kernel", NoLaunch())
    N = MAX_BLOCK_N + 1
    rng = np.random.default_rng(129 + by_depth)
    for D in (N, 5):
        check(*random_case(rng, 3, N, 2, by_depth, W=N + 1), by_depth, D)


def test_rejects_bad_greedy_targets():
    t = torch.zeros(2, 3, dtype=torch.int32)
    num = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="target: expected int64"):
        greedy_tree_accept(t, t, num, torch.zeros(2, 4, dtype=torch.int32), max_depth=3)
    with pytest.raises(ValueError, match="target: \\[B, N \\+ 1"):
        greedy_tree_accept(t, t, num, torch.zeros(2, 3, dtype=torch.int64), max_depth=3)
    rows, start = torch.zeros(5, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="target: expected int64 \\[T\\]"):
        greedy_tree_accept(t, t, num, rows[None], max_depth=3, row_start=start)
    for bad in (start[:1], start.float(), start[None]):
        with pytest.raises(ValueError, match="row_start"):
            greedy_tree_accept(t, t, num, rows, max_depth=3, row_start=bad)


def test_flat_rows_outside_the_batch_read_no_memory():
    """Row starts past or before the flat targets (an inconsistent qo_indptr) match
    nothing, in the kernel too: no read outside the rows."""
    tok = torch.tensor([[5, 6], [5, 6]], dtype=torch.int32, device=DEV)
    par = torch.tensor([[-1, 0], [-1, 0]], dtype=torch.int32, device=DEV)
    num = torch.tensor([2, 2], dtype=torch.int32, device=DEV)
    rows = torch.tensor([5, 6, 9], dtype=torch.int64, device=DEV)
    for use_triton in (True, False):  # (the torch path once read the last row instead,
        # and row 0 for a start before the rows)
        for far in (1000, -1, -2):
            start = torch.tensor([0, far], dtype=torch.int32, device=DEV)
            n, p, out, nout, bonus = greedy_tree_accept(tok, par, num, rows, max_depth=2,
                                                        row_start=start,
                                                        use_triton=use_triton)
            assert n.tolist() == [2, 0] and out[0].tolist() == [5, 6, 9], far
            assert bonus.tolist() == [9, -2], far  # NO_MATCH: no target there
        none = greedy_tree_accept(tok[:1], par[:1], num[:1], rows[:0], max_depth=2,
                                  row_start=start[:1], use_triton=use_triton)
        assert none[0].tolist() == [0] and none[4].tolist() == [-2]
    for bad in (2.0, True, -1):
        with pytest.raises(ValueError, match="max_depth"):
            greedy_tree_accept(tok, par, num, rows, max_depth=bad, row_start=start)


def test_steps_of_any_batch_share_the_compiled_kernel():
    """Batch size, draft width, logit rows and depth bound change every step and are not
    specialized: acceptance compiles once per mode and power-of-two block of the width."""
    rng = np.random.default_rng(5)
    with recorded_specializations(_tree_accept_kernel) as seen:
        for B, N, D in ((1, 5, 3), (2, 6, 16), (16, 7, 1), (3, 8, 8), (24, 15, 17),
                        (5, 16, 16), (1, 1, 1), (4, 1, 2)):
            tok, par, num, exp = (torch.from_numpy(x).to(DEV)
                                  for x in random_case(rng, B, N, 7, False, 0))
            greedy_tree_accept(tok, par, num, exp, max_depth=D, use_triton=True)
            start = torch.cumsum(num + 1, 0).to(torch.int32) - num - 1  # flat rows
            rows = torch.zeros(int((num + 1).sum()) + (B % 3), dtype=torch.int64, device=DEV)
            greedy_tree_accept(tok, par, num, rows, max_depth=D, row_start=start,
                               use_triton=True)
            for by_depth in (False, True):
                tok, par, num, exp = (torch.from_numpy(x).to(DEV)
                                      for x in random_case(rng, B, N, 7, by_depth, D + 1))
                tree_accept(tok, par, num, exp, by_depth=by_depth, max_depth=D,
                            use_triton=True)
    assert num_compiles(_tree_accept_kernel, seen["_tree_accept_kernel"]) <= 4 * 5


def test_kernel_compiles_for_sm90():
    sig = dict(tok_ptr="*i32", par_ptr="*i32", num_ptr="*i32", exp_ptr="*i64", row_ptr="*i32",
               path_ptr="*i64", nacc_ptr="*i64", out_ptr="*i32", nout_ptr="*i32",
               bonus_ptr="*i32", N="i32", stride_tok="i32", stride_par="i32", E="i32",
               D="i32", NO_MATCH="i64",
               BLOCK_N="constexpr", BY_DEPTH="constexpr", EMIT="constexpr", ROWS="constexpr")
    greedy = dict(sig, path_ptr="*i32", nacc_ptr="*i32")
    compile_all_for_sm90([
        (_tree_accept_kernel, sig, dict(BLOCK_N=64, BY_DEPTH=False, EMIT=False, ROWS=False)),
        (_tree_accept_kernel, sig, dict(BLOCK_N=128, BY_DEPTH=True, EMIT=False, ROWS=False),
         dict(num_warps=num_warps(128, True))),  # 4 warps spill here
        (_tree_accept_kernel, greedy, dict(BLOCK_N=64, BY_DEPTH=False, EMIT=True,
                                           ROWS=False)),
        (_tree_accept_kernel, greedy, dict(BLOCK_N=64, BY_DEPTH=False, EMIT=True, ROWS=True)),
        (_tree_accept_kernel, greedy, dict(BLOCK_N=128, BY_DEPTH=False, EMIT=True, ROWS=True),
         dict(num_warps=num_warps(128, False)))])  # greedy's widest block


@pytest.mark.parametrize("by_depth", [False, True])
def test_no_nodes_in_a_batch_and_negative_tokens(by_depth):
    """Out-of-contract inputs a helper's audit found the paths disagreeing on: a batch whose
    drafts have no node columns (N = 0, B > 0, a depth to walk: the torch path indexed an
    empty row), and a node token equal to the kernel's NO_MATCH (-2) or the truth's
    NO_TOKEN padding: a negative token never matches, in either path."""
    B = 3
    tok = torch.zeros(B, 0, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    exp = torch.tensor([[5, 1], [6, 1], [7, 1]], dtype=torch.int64)
    for D in (0, 1, 3):
        got = [tree_accept(tok, tok, num, exp[:, :1] if not by_depth else exp,
                           by_depth=by_depth, max_depth=D, use_triton=u) for u in (False, True)]
        assert all(torch.equal(x, y) for x, y in zip(*got)), (D, got)
        assert (got[0][0] == 0).all()
        if not by_depth:
            got = [greedy_tree_accept(tok, tok, num, exp[:, :1], max_depth=D, use_triton=u)
                   for u in (False, True)]
            assert all(torch.equal(x, y) for x, y in zip(*got)), (D, got)
            assert got[0][2][:, 0].tolist() == [5, 6, 7]  # the bonus: the root's target
    tok = torch.tensor([[5, -2], [-2, 5]], dtype=torch.int32)
    par = torch.tensor([[-1, 0], [-1, 0]], dtype=torch.int32)
    num = torch.tensor([2, 2], dtype=torch.int32)
    exp = torch.tensor([[5, -2, -2], [-2, -2, -2]], dtype=torch.int64) if by_depth else \
        torch.tensor([[5, -2, -2], [-2, 5, -2]], dtype=torch.int64)
    got = [tree_accept(tok, par, num, exp if not by_depth else exp[:, :1],
                       by_depth=by_depth, max_depth=2, use_triton=u) for u in (False, True)]
    assert all(torch.equal(x, y) for x, y in zip(*got)), got
    assert got[0][0].tolist() == [1, 0]
