"""The candidate-rows kernel (``kernels/candidate_rows.py``) against its torch path (the
drafter's code before the kernel) and against hand-checked cases; and its sm_90 compile."""

import random

import pytest
import torch

from agspec_gpu.kernels.candidate_rows import (PAD_ID, _candidate_rows_kernel, candidate_rows,
                                               candidate_rows_torch)
from agspec_gpu.tokenizer import load_tokenizer
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90

BONUS = torch.tensor([2, 2, 1, 0], dtype=torch.int32)
HITS = torch.tensor([3.0, 1.0, 0.5, 2.0], dtype=torch.float64)
DRAFTS = torch.tensor([4.0, 3.0, 2.0, 7.0], dtype=torch.float64)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def both(tier, length, win, src, **kw):
    """Runs the torch path and the kernel; asserts they agree exactly; returns the result."""
    args = tuple(t.to(DEV) for t in (
        torch.tensor(tier, dtype=torch.int64), torch.tensor(length, dtype=torch.int32),
        torch.tensor(win, dtype=torch.int32), torch.tensor(src, dtype=torch.int8),
        BONUS, HITS, DRAFTS))
    a = candidate_rows(*args, **kw, use_triton=False)
    b = candidate_rows(*args, **kw, use_triton=True)
    for x, y, name in zip(a, b, ("W", "S", "Wt", "best", "longest")):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    return tuple(x.cpu() for x in a)


def test_hand_checked_request():
    """Rows: session (tier 0) match 3, workspace (1) match 4, global (3) match 5: scores 5,
    6, 5; with two slots the workspace row comes first, then the session row (the earlier
    of the tied scores); separators cut windows; the global row gets no slot."""
    win = [[[[10, 11, -1, 12]], [[20, 21, 22, 23]], [[30, 31, 32, 33]]]]  # [1, 3, 1, 4]
    src = [[[[0, 0, 0, 0]], [[1, 1, 1, 1]], [[3, 3, 3, 3]]]]
    W, S, Wt, best, longest = both([[0, 1, 3]], [[3, 4, 5]], win, src, num_slots=2,
                                   min_match=1, slack=1)
    assert W.tolist() == [[[20, 21, 22, 23], [10, 11, PAD_ID, PAD_ID]]]
    assert S.tolist() == [[[1, 1, 1, 1], [0, 0, 0, 0]]]  # sources are not cut
    assert Wt.tolist() == [[pytest.approx(1 / 3), pytest.approx(3 / 4)]]
    assert best.tolist() == [5] and longest.tolist() == [5]  # best: any row within the slack
    # no slack: only the workspace row; the second slot is empty
    W, S, Wt, best, _ = both([[0, 1, 3]], [[3, 4, 5]], win, src, num_slots=2, min_match=1,
                             slack=0)
    assert W[0, 1].tolist() == [PAD_ID] * 4 and S[0, 1].tolist() == [-1] * 4
    assert Wt[0, 1].item() == 0 and best.tolist() == [4]


def test_a_slack_or_min_match_past_int32_does_not_wrap():
    """The config bounds neither: past int32 the torch path once wrapped them (one row
    for all three; one row for none), the kernel did not."""
    win = [[[[10, 11, 12, 13]], [[20, 21, 22, 23]], [[30, 31, 32, 33]]]]
    src = [[[[0] * 4], [[1] * 4], [[3] * 4]]]
    for slack in (2 ** 31, 2 ** 40):
        W, _, _, best, _ = both([[0, 1, 3]], [[3, 4, 5]], win, src, num_slots=3, min_match=1,
                                slack=slack)
        assert (W[0] >= 0).any(dim=1).tolist() == [True] * 3 and best.tolist() == [5]
    for min_match in (2 ** 31, 2 ** 40):
        W, _, _, best, _ = both([[0, 1, 3]], [[3, 4, 5]], win, src, num_slots=3,
                                min_match=min_match, slack=0)
        assert (W < 0).all() and best.tolist() == [0]


def test_no_match_short_match_and_separator_first():
    win = [[[[-1, 5], [6, 7]], [[8, 9], [-5, -5]]]]  # [1, 2, 2, 2]
    src = [[[[2, 2], [2, 2]], [[0, 0], [0, 0]]]]
    W, _, Wt, best, longest = both([[2, -1]], [[0, 0]], win, src, num_slots=2, min_match=1,
                                   slack=0)
    assert (W == PAD_ID).all() and (Wt == 0).all() and best.tolist() == [0]
    assert longest.tolist() == [0]
    W, _, Wt, best, _ = both([[2, 0]], [[2, 1]], win, src, num_slots=1, min_match=2, slack=9)
    assert W.tolist() == [[[PAD_ID, PAD_ID], [6, 7]]]  # a window that starts at a separator
    assert Wt[0, 0].item() == 0 and Wt[0, 1].item() == pytest.approx(0.25)
    assert best.tolist() == [2]


def test_real_windows_and_length_one_shapes():
    tok = load_tokenizer("cl100k")
    text = tok.encode("def f(x):\n    return x + 1\n" * 4)
    K = 8
    win = [[[text[i:i + K] for i in (0, 3)], [text[5:5 + K], text[9:9 + K]]]]
    both([[0, 3]], [[4, 6]], win, [[[[0] * K] * 2, [[3] * K] * 2]], num_slots=2,
         min_match=1, slack=2)
    both([[1]], [[1]], [[[[7]]]], [[[[1]]]], num_slots=1, min_match=1, slack=0)  # 1x1x1x1
    args = (torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int32),
            torch.zeros(0, 2, 3, 4, dtype=torch.int32), torch.zeros(0, 2, 3, 4, dtype=torch.int8),
            BONUS, HITS, DRAFTS)
    for use_triton in (False, True):  # no requests
        W, S, Wt, best, longest = candidate_rows(*args, num_slots=2, min_match=1, slack=0,
                                                 use_triton=use_triton)
        assert W.shape == (0, 6, 4) and Wt.shape == (0, 6) and best.shape == (0,)


def test_random_batches_agree():
    """Adversarial rows: equal scores, repeated and periodic windows, separators anywhere,
    more rows than slots and fewer."""
    rng = random.Random(0)
    for _ in range(30):
        B, R, P, K = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 8), rng.randint(1, 9)
        tier = [[rng.choice([-1, 0, 1, 2, 3]) for _ in range(R)] for _ in range(B)]
        length = [[0 if t < 0 else rng.choice([0, 1, 2, 3, 3, 7]) for t in row] for row in tier]
        period = rng.randint(1, 3)
        win = [[[[rng.choice([-1, -3]) if rng.random() < 0.15 else
                  (j % period if rng.random() < 0.5 else 5) for j in range(K)]
                 for _ in range(P)] for _ in range(R)] for _ in range(B)]
        src = [[[[rng.randint(-1, 3) for _ in range(K)] for _ in range(P)] for _ in range(R)]
               for _ in range(B)]
        both(tier, length, win, src, num_slots=rng.randint(1, R + 1),
             min_match=rng.randint(1, 3), slack=rng.randint(0, 3))


def test_torch_path_is_the_drafters_former_code():
    """The kernel's torch path is what the drafter computed inline before the kernel:
    spot-checked against a direct reading of the rule on one request."""
    W, S, Wt, best, longest = candidate_rows_torch(
        torch.tensor([[3, 0]]), torch.tensor([[2, 2]], dtype=torch.int32),
        torch.tensor([[[[1, 2]]], [[[3, 4]]]], dtype=torch.int32).view(1, 2, 1, 2),
        torch.tensor([[[[5, 5]]], [[[6, 6]]]], dtype=torch.int8).view(1, 2, 1, 2),
        BONUS, HITS, DRAFTS, num_slots=2, min_match=1, slack=5)
    # scores 2 (global) and 4 (session): the session row first
    assert W.tolist() == [[[3, 4], [1, 2]]] and S.tolist() == [[[6, 6], [5, 5]]]
    assert best.tolist() == [2] and longest.tolist() == [2]


def test_rejects_bad_inputs():
    tier = torch.zeros(1, 2, dtype=torch.int64)
    length = torch.ones(1, 2, dtype=torch.int32)
    win = torch.zeros(1, 2, 3, 4, dtype=torch.int32)
    src = torch.zeros(1, 2, 3, 4, dtype=torch.int8)
    good = dict(tier=tier, length=length, win=win, src=src, tier_bonus=BONUS, tier_hits=HITS,
                tier_drafts=DRAFTS, num_slots=2, min_match=1, slack=0)
    for name, bad in (("tier", tier.int()), ("length", length[:, :1]), ("win", win[:, :0]),
                      ("win", win[0]), ("src", src.int()), ("tier_bonus", BONUS.long()),
                      ("tier_hits", HITS.float()), ("tier_drafts", DRAFTS[:2]),
                      ("num_slots", 0), ("min_match", 0), ("slack", -1), ("num_slots", 1.5),
                      ("slack", True), ("min_match", True)):
        with pytest.raises(ValueError, match=name):
            candidate_rows(**{**good, name: bad}, use_triton=True)


def test_rejects_a_tensor_on_another_device():
    good = dict(tier=torch.zeros(1, 2, dtype=torch.int64),
                length=torch.ones(1, 2, dtype=torch.int32), win=torch.zeros(1, 2, 3, 4, dtype=torch.int32),
                src=torch.zeros(1, 2, 3, 4, dtype=torch.int8), tier_bonus=BONUS,
                tier_hits=HITS, tier_drafts=DRAFTS)
    for name in ("tier", "length", "src", "tier_bonus", "tier_hits", "tier_drafts"):
        with pytest.raises(ValueError, match=f"^{name}: on meta"):
            candidate_rows(**{**good, name: good[name].to("meta")}, num_slots=2, min_match=1,
                           slack=0, use_triton=True)


def test_one_compile_per_corpus_count_block():
    """Batch size and corpus count are not specialized past their power-of-two blocks."""
    def launch(B, R, P=8, K=4):
        return lambda: candidate_rows(
            torch.zeros(B, R, dtype=torch.int64, device=DEV),
            torch.ones(B, R, dtype=torch.int32, device=DEV),
            torch.zeros(B, R, P, K, dtype=torch.int32, device=DEV),
            torch.zeros(B, R, P, K, dtype=torch.int8, device=DEV), BONUS.to(DEV),
            HITS.to(DEV), DRAFTS.to(DEV), num_slots=2, min_match=1, slack=0, use_triton=True)

    assert assert_one_compile_per_config(
        _candidate_rows_kernel,
        [launch(B, R) for B, R in ((1, 3), (2, 4), (16, 3), (64, 4), (5, 4))]) == 1


def test_kernel_compiles_for_sm90():
    sig = dict(tier_ptr="*i64", length_ptr="*i32", win_ptr="*i32", src_ptr="*i8",
               bonus_ptr="*i32", hits_ptr="*fp64", drafts_ptr="*fp64", w_out_ptr="*i32",
               s_out_ptr="*i32", wt_out_ptr="*fp32", best_ptr="*i32", longest_ptr="*i32",
               R="i32", P="i32", K="i32", MIN_MATCH="i32", SLACK="i32", NSLOT="constexpr",
               BLOCK_R="constexpr", BLOCK_P="constexpr", BLOCK_K="constexpr")
    compile_all_for_sm90([(_candidate_rows_kernel, sig, dict(NSLOT=2, BLOCK_R=4, BLOCK_P=8,
                                                         BLOCK_K=32)),
                          (_candidate_rows_kernel, sig, dict(NSLOT=1, BLOCK_R=1, BLOCK_P=1,
                                                         BLOCK_K=1))])
