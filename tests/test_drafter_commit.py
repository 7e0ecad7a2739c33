"""The drafter's commit kernel: the Triton kernel (interpreted on CPU) equals the torch path
exactly (accepted sources, ring, fill, match cap, every count) on random trees and accepted
paths, including empty batches, one-node drafts, nothing or everything accepted, output
widths below and above the node count, rings narrower than the output, repeated tokens and
padding rows sharing a spare slot, and the rings saved before the commit; bad arguments
are named (a drafter on the kernels:
tests/test_draft_nodes.py); the kernel compiles for
sm_90."""

import functools
import random

import pytest
import torch

import agspec_gpu.kernels.drafter_commit as drafter_commit_mod
from agspec_gpu.kernels.drafter_commit import (MAX_BLOCK_N, _drafter_commit_kernel,
                                               drafter_commit, drafter_commit_torch)
from kernel_compile import NoLaunch, assert_one_compile_per_config, compile_all_for_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
T = 4


def random_case(rng: random.Random, B: int, N: int, M: int, D: int, S: int, R: int, K: int,
                vocab: int = 5, spare: bool = False) -> dict:
    """Random draft trees, an accepted path down each (a root-to-node chain, cut at a random
    length), outputs, and state rows. ``spare``: the last rows are padding on slot S - 1."""
    slots = rng.sample(range(S - 1), min(B, S - 1)) + [S - 1] * max(0, B - (S - 1))
    if spare:
        slots = slots[:B // 2] + [S - 1] * (B - B // 2)
    src = torch.full((B, N), -1, dtype=torch.int8)
    par = torch.full((B, N), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    depth = torch.zeros(B, N, dtype=torch.int64)
    path = torch.full((B, N), -1, dtype=torch.int64)
    nacc = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = rng.randint(0, N)
        num[b] = n
        for j in range(N):
            src[b, j] = rng.choice([-1, rng.randrange(8 * T)])
            if j < n:
                par[b, j] = rng.randrange(-1, j)
                depth[b, j] = 0 if par[b, j] < 0 else depth[b, int(par[b, j])] + 1
            else:
                par[b, j] = rng.randrange(-1, N)  # padding entries: ignored
        if n:
            node, chain = rng.randrange(n), []
            while node >= 0:
                chain.append(node)
                node = int(par[b, node])
            chain.reverse()
            a = rng.randint(0, len(chain))
            for j, c in enumerate(chain):
                path[b, j] = c
            nacc[b] = a
        if rng.random() < 0.3:  # entries past nacc must be ignored
            path[b, int(nacc[b]):] = torch.randint(-1, max(N, 1), (N - int(nacc[b]),))
    nout = torch.tensor([min(int(a) + 1, M) for a in nacc], dtype=torch.int32)
    out = torch.randint(-1, vocab, (B, M), dtype=torch.int32)
    return dict(slots=torch.tensor(slots, dtype=torch.int64), out=out, nout=nout, nacc=nacc,
                src=src, parents=par, num=num, depth=depth,
                calib_row=torch.randint(0, R, (B, N), dtype=torch.int64), path=path,
                recent=torch.randint(0, vocab, (S, D), dtype=torch.int32),
                recent_len=torch.randint(0, D + 1, (S,), dtype=torch.int32),
                match_cap=torch.randint(0, D + 1, (S,), dtype=torch.int32),
                drafted=torch.zeros(T, dtype=torch.float64),
                hits=torch.zeros(T, dtype=torch.float64),
                seen=torch.zeros(R * K, dtype=torch.float64),
                accepted=torch.zeros(R * K, dtype=torch.float64),
                before=torch.full((B, D + 2), -7, dtype=torch.int32))


def run_both(case: dict, K: int, spare_slot: int | None = None):
    """(kernel, torch) results: acc_src plus every updated tensor (the spare slot's ring,
    raced by padding rows, left out)."""
    outs = []
    for triton_path in (True, False):
        c = {k: v.clone().to(DEV) for k, v in case.items()}
        fn = functools.partial(drafter_commit, use_triton=True) if triton_path else \
            drafter_commit_torch
        acc = fn(**c, calib_depth=K)
        state = {k: c[k].cpu() for k in ("recent", "recent_len", "match_cap", "drafted",
                                         "hits", "seen", "accepted", "before")}
        if spare_slot is not None:
            for k in ("recent", "recent_len", "match_cap"):
                state[k] = state[k][:spare_slot]
            state["before"] = state["before"][case["slots"] != spare_slot]
        outs.append((acc.cpu(), state))
    return outs


SHAPES = [  # (B, N, M, D, S)
    (0, 8, 4, 8, 4), (1, 1, 1, 1, 2), (1, 1, 2, 4, 2), (3, 8, 9, 32, 5), (4, 16, 5, 3, 6),
    (5, 64, 33, 32, 9), (2, 40, 50, 16, 3), (6, 7, 7, 7, 8),
    (3, 0, 4, 8, 5), (3, 6, 0, 8, 5),  # no draft nodes; no output columns
    (2, MAX_BLOCK_N, 20, 16, 3), (2, 2 * MAX_BLOCK_N + 1, 20, 16, 3),  # the widest block; torch
]


@pytest.mark.parametrize("B,N,M,D,S", SHAPES)
def test_kernel_equals_torch_path(B, N, M, D, S, monkeypatch):
    if N > MAX_BLOCK_N:  # the torch path: the kernel must not launch
        monkeypatch.setattr(drafter_commit_mod, "_drafter_commit_kernel", NoLaunch())
    rng = random.Random(B * 1000 + N * 10 + M)
    R, K = 5, 6
    for trial in range(4):
        case = random_case(rng, B, N, M, D, S, R, K, vocab=3 if trial % 2 else 50)
        (acc_k, st_k), (acc_t, st_t) = run_both(case, K)
        assert torch.equal(acc_k, acc_t), trial
        for name in st_t:
            assert torch.equal(st_k[name], st_t[name]), (trial, name)
        if B:  # the counts add up: every valid reached node and every accepted one
            assert st_t["accepted"].sum() <= st_t["seen"].sum()
            assert st_t["hits"].sum() == (acc_t >= 0).sum()


def test_a_negative_output_count_pushes_nothing_on_both_paths():
    """``nout < 0`` (outside the contract) is 0 on both paths: the kernel once read
    outside its ring row where the torch path raised."""
    case = random_case(random.Random(3), 3, 8, 9, 16, 5, 5, 6)
    case["nout"] = torch.tensor([-1, -3, 2], dtype=torch.int32)
    (acc_k, st_k), (acc_t, st_t) = run_both(case, 6)
    assert torch.equal(acc_k, acc_t)
    for name in st_t:
        assert torch.equal(st_k[name], st_t[name]), name
    for b in (0, 1):  # rings of the rows that pushed nothing, as they were
        slot = int(case["slots"][b])
        assert torch.equal(st_t["recent"][slot], case["recent"][slot])


def test_the_kernel_leaves_a_slot_outside_the_state_alone():
    """A row whose slot is outside ``[0, S)`` (a caller's error) touches no ring, fill or
    cap (the kernel once wrote past the state); the other rows commit as the torch path
    does, and its counts still add up."""
    case = random_case(random.Random(5), 3, 8, 9, 16, 5, 5, 6)
    c = {k: v.clone().to(DEV) for k, v in case.items()}
    c["slots"] = torch.tensor([case["slots"][0], 5, -1], device=DEV)
    acc = drafter_commit(**c, calib_depth=6, use_triton=True)
    ref = {k: v.clone() for k, v in case.items()}
    ref["slots"], ref["nout"] = ref["slots"][:1], ref["nout"][:1]
    for k in ("out", "nacc", "src", "parents", "num", "depth", "calib_row", "path",
              "before"):
        ref[k] = ref[k][:1]
    acc_ref = drafter_commit_torch(**ref, calib_depth=6)
    assert torch.equal(acc[:1].cpu(), acc_ref)
    for k in ("recent", "recent_len", "match_cap"):
        assert torch.equal(c[k].cpu(), ref[k]), k
    assert (c["before"][1:].cpu() == 0).all()  # read as zeros, not from outside the state



@pytest.mark.parametrize("slots", [[-1, 0, 5, 4, 2, 7], [0, -1, 4, 5, -6, 1], [5, -1, 9]])
def test_both_paths_skip_a_slot_outside_the_state(slots):
    """Rows whose slot is outside ``[0, S)`` (negative, ``S`` or past it) on both paths
    alike (the torch path once wrapped or raised): their rings, fills and caps untouched,
    ``before`` read as zeros, also when the clamped slot (-1 -> 0, S -> S - 1) is a kept
    row's; the kept rows commit as in a batch without the others; counts and accepted
    sources are the whole batch's."""
    S, B = 5, len(slots)
    rng = random.Random(B)
    for _ in range(3):
        case = random_case(rng, B, 8, 9, 16, S, 5, 6, vocab=50)
        case["slots"] = torch.tensor(slots, dtype=torch.int64)
        (acc_k, st_k), (acc_t, st_t) = run_both(case, 6)
        assert torch.equal(acc_k, acc_t)
        for name in st_t:
            assert torch.equal(st_k[name], st_t[name]), name
        ok = (case["slots"] >= 0) & (case["slots"] < S)
        assert (st_t["before"][~ok] == 0).all()
        ref = {k: v.clone() for k, v in case.items()}
        for k in ("slots", "out", "nout", "nacc", "src", "parents", "num", "depth",
                  "calib_row", "path", "before"):
            ref[k] = ref[k][ok]
        drafter_commit_torch(**ref, calib_depth=6)
        for k in ("recent", "recent_len", "match_cap"):
            assert torch.equal(st_t[k], ref[k]), k
        assert torch.equal(st_t["before"][ok], ref["before"])
        whole = {k: v.clone() for k, v in case.items()}
        whole["slots"] = torch.where(ok, whole["slots"], S - 1)
        assert torch.equal(drafter_commit_torch(**whole, calib_depth=6), acc_t)
        for k in ("drafted", "hits", "seen", "accepted"):
            assert torch.equal(whole[k], st_t[k]), k

def test_padding_rows_on_a_shared_spare_slot_leave_real_slots_exact():
    rng = random.Random(7)
    for trial in range(3):
        case = random_case(rng, 6, 12, 8, 16, 5, 4, 6, spare=True)
        (acc_k, st_k), (acc_t, st_t) = run_both(case, 6, spare_slot=4)
        assert torch.equal(acc_k, acc_t)
        for name in st_t:
            assert torch.equal(st_k[name], st_t[name]), (trial, name)


def test_ring_push_keeps_the_newest_tokens():
    """A ring of 4 holding 1 2 3 4, two outputs 7 8 (then padding): 3 4 7 8; fill and cap grow
    by two, at most 4; negative ids (padding past nout) never enter; ``before`` holds the
    ring, fill and cap the commit found."""
    c = random_case(random.Random(0), 1, 2, 3, 4, 2, 1, 2)
    c["recent"][:] = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]], dtype=torch.int32)
    c["slots"][:] = 0
    c["out"][:] = torch.tensor([[7, 8, -1]], dtype=torch.int32)
    c["nout"][:] = 2
    c["recent_len"][:] = torch.tensor([3, 0], dtype=torch.int32)
    c["match_cap"][:] = torch.tensor([1, 0], dtype=torch.int32)
    for _, st in run_both(c, 2):
        assert st["recent"][0].tolist() == [3, 4, 7, 8]
        assert st["recent_len"][0] == 4 and st["match_cap"][0] == 3
        assert st["before"][0].tolist() == [1, 2, 3, 4, 3, 1]


def test_bad_arguments_are_named():
    c = random_case(random.Random(1), 2, 4, 3, 4, 3, 2, 3)
    with pytest.raises(ValueError, match="src"):
        drafter_commit(**{**c, "src": c["src"].to(torch.int32)}, calib_depth=3)
    with pytest.raises(ValueError, match="path"):
        drafter_commit(**{**c, "path": c["path"][:, :2].contiguous()}, calib_depth=3)
    with pytest.raises(ValueError, match="recent_len"):
        drafter_commit(**{**c, "recent_len": c["recent_len"][:2]}, calib_depth=3)
    for name in ("out", "src", "recent"):  # flattened: named, not an IndexError
        with pytest.raises(ValueError, match=f"^{name}: expected 2 dims"):
            drafter_commit(**{**c, name: c[name].flatten()}, calib_depth=3)
    # the calibration cells' depth: the kernel adds at row * K + depth, K from the caller
    # (0, or one that does not divide the cells, would add outside seen / accepted)
    for K in (0, 4, -3, 3.0, True):
        for triton_path in (True, False):
            with pytest.raises(ValueError, match="calib_depth"):
                drafter_commit(**c, calib_depth=K, use_triton=triton_path)
    with pytest.raises(ValueError, match="slots: on meta"):
        drafter_commit(**{**c, "slots": c["slots"].to("meta")}, calib_depth=3)
    with pytest.raises(ValueError, match="before"):  # a row of D + 2 per request
        drafter_commit(**{**c, "before": c["before"][:, :-1].contiguous()}, calib_depth=3)
    drafter_commit(**{**c, "before": None}, calib_depth=3, use_triton=True)  # optional


def test_tags_of_a_tier_past_the_table_count_nowhere():
    """A source tag whose tier is ``>= T`` (the table's length): both paths leave every
    count alone (the kernel would otherwise add one past the end of ``drafted`` and
    ``hits``), and agree on everything else."""
    c = random_case(random.Random(3), 3, 6, 5, 8, 4, 2, 3)
    c["src"][:] = 8 * T + 1  # tier T: none of the four
    c["src"][0, :2] = 8 * (T + 2)
    c["drafted"] = torch.zeros(T + 2, dtype=torch.float64)[:T]  # guard cells behind
    c["hits"] = torch.zeros(T + 2, dtype=torch.float64)[:T]
    (acc_k, st_k), (acc_t, st_t) = run_both(c, 3)
    assert torch.equal(acc_k, acc_t)
    for name in st_t:
        assert torch.equal(st_k[name], st_t[name]), name
    assert st_t["drafted"].sum() == 0 and st_t["hits"].sum() == 0


def test_one_compile_per_block_of_draft_width():
    """The accepted outputs' width (1 to the draft's depth + 1) and the draft width within
    its power-of-two block change every step: one compile."""
    rng = random.Random(5)
    launches = [lambda N=N, M=M: run_both(random_case(rng, 3, N, M, 8, 5, 5, 6), 6)
                for N, M in ((9, 1), (16, 5), (13, 16), (16, 17))]
    assert assert_one_compile_per_config(_drafter_commit_kernel, launches) == 1


def test_kernel_compiles_for_sm90():
    sig = dict(slot_ptr="*i64", out_ptr="*i32", nout_ptr="*i32", nacc_ptr="*i32",
               src_ptr="*i8", par_ptr="*i32", num_ptr="*i32", depth_ptr="*i64",
               row_ptr="*i64", path_ptr="*i64", recent_ptr="*i32", rlen_ptr="*i32",
               cap_ptr="*i32", acc_src_ptr="*i64", drafted_ptr="*fp64", hits_ptr="*fp64",
               seen_ptr="*fp64", cacc_ptr="*fp64", before_ptr="*i32", M="i32", N="i32",
               S="i32", D="i32", K="i32", NUM_TIERS="constexpr", BLOCK_N="constexpr",
               BLOCK_D="constexpr", SAVE_BEFORE="constexpr")
    compile_all_for_sm90([(_drafter_commit_kernel, sig,
                           dict(NUM_TIERS=4, BLOCK_N=64, BLOCK_D=32, SAVE_BEFORE=True)),
                          (_drafter_commit_kernel, sig,
                           dict(NUM_TIERS=4, BLOCK_N=64, BLOCK_D=32, SAVE_BEFORE=False)),
                          (_drafter_commit_kernel, sig,  # the widest block: no spill either
                           dict(NUM_TIERS=4, BLOCK_N=MAX_BLOCK_N, BLOCK_D=32,
                                SAVE_BEFORE=True))])


def test_ring_push_without_the_guard_equals_it_on_valid_slots():
    """``SlotState``'s pushes skip the out-of-range guard (their slots are their own):
    distinct valid slots, ragged counts (0 and past the ring's width included), the same
    rings, fills and match caps as the guarded form."""
    from agspec_gpu.kernels.drafter_commit import ring_push_torch
    g = torch.Generator().manual_seed(3)
    S, D, M = 6, 5, 7
    state = (torch.randint(0, 50, (S, D), generator=g, dtype=torch.int32),
             torch.randint(0, D + 1, (S,), generator=g, dtype=torch.int32),
             torch.randint(0, D + 1, (S,), generator=g, dtype=torch.int32))
    slots = torch.tensor([4, 0, 2, 5])
    toks = torch.randint(0, 50, (4, M), generator=g, dtype=torch.int32)
    num = torch.tensor([0, 3, 7, 1])
    guarded, direct = [t.clone() for t in state], [t.clone() for t in state]
    ring_push_torch(*guarded, slots, toks, num)
    ring_push_torch(*direct, slots, toks, num, guard=False)
    assert all(torch.equal(a, b) for a, b in zip(guarded, direct))
    assert not all(torch.equal(a, b) for a, b in zip(guarded, state))
