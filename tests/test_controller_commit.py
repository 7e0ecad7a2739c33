"""The controller-commit kernel (``kernels/controller_commit.py``) against its torch path and
the controller's rule; and its sm_90 compile."""

import random

import pytest
import torch

from agspec_gpu.controller import ControllerConfig, update_scale
from agspec_gpu.kernels.controller_commit import (_controller_commit_kernel, controller_commit,
                                                  controller_commit_torch)
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90

CFG = ControllerConfig()
KW = dict(alpha=CFG.alpha, beta=CFG.beta, s_min=CFG.s_min, s_max=CFG.s_max)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def state(S: int, rng: random.Random):
    scale = torch.tensor([rng.choice([CFG.s_min, 0.5, 4.5, 7.3, 11.0, CFG.s_max])
                          for _ in range(S)], dtype=torch.float32)
    cap = torch.tensor([rng.choice([1, 3, 8, 32]) for _ in range(S)], dtype=torch.int32)
    prev = torch.tensor([rng.randint(0, 1) for _ in range(S)], dtype=torch.int64)
    return scale, cap, prev


def run_both(slots, nd, num, nacc, scale, cap, prev, kw=KW, bound=None):
    """Both paths on copies of the state (on the GPU where there is one); asserts they agree
    exactly; returns the result (on the CPU)."""
    slots, nd, num, nacc, cap = (t.to(DEV) for t in (slots, nd, num, nacc, cap))
    bound = None if bound is None else bound.to(DEV)
    outs = []
    for use_triton in (False, True):
        s, p = scale.clone().to(DEV), prev.clone().to(DEV)
        controller_commit(slots, nd, num, nacc, s, cap, p, **kw, bound=bound,
                          use_triton=use_triton)
        outs.append((s.cpu(), p.cpu()))
    (s0, p0), (s1, p1) = outs
    assert torch.equal(s0, s1) and torch.equal(p0, p1)
    return s0, p0


def test_rule_full_rejected_capped_and_no_draft():
    """Four requests: accepted to its depth (x alpha), a rejection (x beta), a full
    acceptance the cap cut (unchanged), no draft (unchanged, not full)."""
    slots = torch.tensor([3, 0, 2, 1])
    nd = torch.tensor([[0, 1, 2, 1], [0, 0, 1, 2], [0, 1, 2, 3], [5, 5, 5, 5]])
    num = torch.tensor([4, 4, 4, 0], dtype=torch.int32)  # depths 3, 3, 4, 0
    nacc = torch.tensor([3, 1, 4, 0], dtype=torch.int32)
    scale = torch.full((5,), 8.0)
    cap = torch.tensor([32, 32, 4, 32, 32], dtype=torch.int32)
    prev = torch.full((5,), 7, dtype=torch.int64)
    s, p = run_both(slots, nd, num, nacc, scale, cap, prev)
    assert s.tolist() == [8.0 * CFG.beta, 8.0, 8.0, 8.0 * CFG.alpha, 8.0]
    assert p.tolist() == [0, 0, 1, 1, 7]  # slot 4 untouched


def test_a_draft_its_requests_bound_cut_keeps_the_scale():
    """A request's own depth bound (near its max_new_tokens or its context's limit) cut a
    draft accepted whole: the scale stays, as under the role cap; copy mode is still
    recorded. A bound the draft did not reach, a rejection and no draft as without one."""
    slots = torch.tensor([3, 0, 2, 1, 4])
    nd = torch.tensor([[0, 1, 2, 1], [0, 0, 1, 2], [0, 1, 2, 3], [5, 5, 5, 5], [0, 1, 0, 1]])
    num = torch.tensor([4, 4, 4, 0, 4], dtype=torch.int32)  # depths 3, 3, 4, 0, 2
    nacc = torch.tensor([3, 1, 4, 0, 2], dtype=torch.int32)
    bound = torch.tensor([3, 3, 9, 0, 2 ** 62])
    scale = torch.full((6,), 8.0)
    cap = torch.full((6,), 32, dtype=torch.int32)
    prev = torch.full((6,), 7, dtype=torch.int64)
    s, p = run_both(slots, nd, num, nacc, scale, cap, prev, bound=bound)
    assert s.tolist() == [8.0 * CFG.beta, 8.0, 8.0 * CFG.alpha, 8.0, 8.0 * CFG.alpha, 8.0]
    assert p.tolist() == [0, 0, 1, 1, 1, 7]
    free, _ = run_both(slots, nd, num, nacc, scale, cap, prev)
    assert free.tolist()[3] == 8.0 * CFG.alpha  # without the bound: grown
    rng = random.Random(3)  # and the two paths agree on random bounds, across widths
    for _ in range(30):
        B, N, S = rng.randint(0, 6), rng.randint(0, 9), 8
        sl = torch.tensor(rng.sample(range(S), B), dtype=torch.int64)
        n = torch.tensor([rng.randint(0, N) for _ in range(B)], dtype=torch.int32)
        d = torch.tensor([[rng.randint(0, 4) for _ in range(N)] for _ in range(B)],
                         dtype=torch.int64).reshape(B, N)
        a = torch.tensor([rng.randint(0, 5) for _ in range(B)], dtype=torch.int32)
        b = torch.tensor([rng.choice([0, 1, 2, 3, 5, 2 ** 62]) for _ in range(B)],
                         dtype=torch.int64)
        run_both(sl, d, n, a, *state(S, rng), bound=b)


def test_matches_the_controllers_update_scale():
    rng = random.Random(0)
    for _ in range(40):
        B, N, S = rng.randint(0, 6), rng.randint(0, 9), 8
        slots = torch.tensor(rng.sample(range(S), B), dtype=torch.int64)
        nd = torch.tensor([[rng.randint(0, 6) for _ in range(N)] for _ in range(B)],
                          dtype=torch.int64).view(B, N)
        num = torch.tensor([rng.randint(0, N) for _ in range(B)], dtype=torch.int32)
        nacc = torch.tensor([rng.randint(0, 8) for _ in range(B)], dtype=torch.int32)
        scale, cap, prev = state(S, rng)
        s, p = run_both(slots, nd, num, nacc, scale, cap, prev)
        depth = [max([int(nd[b, j]) + 1 for j in range(int(num[b]))], default=0)
                 for b in range(B)]
        want = update_scale(scale[slots], torch.tensor(depth, dtype=torch.int64), nacc,
                            cap[slots], CFG)
        assert torch.equal(s[slots], want)
        assert p[slots].tolist() == [int(a >= d > 0) for a, d in zip(nacc.tolist(), depth)]
        rest = torch.ones(S, dtype=torch.bool)
        rest[slots] = False
        assert torch.equal(s[rest], scale[rest]) and torch.equal(p[rest], prev[rest])


@pytest.mark.parametrize("B,N", [(0, 3), (1, 0), (2, 0), (1, 1)])
def test_an_empty_batch_or_draft_changes_nothing_but_the_drafted(B, N):
    """No request, or requests with no draft column: every scale stays and no slot is
    full; one node accepted: the slot grows."""
    slots = torch.arange(B, dtype=torch.int64)
    nd = torch.zeros(B, N, dtype=torch.int64)
    num = torch.full((B,), N, dtype=torch.int32)
    nacc = torch.full((B,), N, dtype=torch.int32)
    scale, cap, prev = torch.full((3,), 8.0), torch.full((3,), 32, dtype=torch.int32), \
        torch.full((3,), 7, dtype=torch.int64)
    s, p = run_both(slots, nd, num, nacc, scale, cap, prev)
    grown = 8.0 * CFG.alpha if N else 8.0
    assert s.tolist() == [grown] * B + [8.0] * (3 - B)
    assert p.tolist() == [int(N > 0)] * B + [7] * (3 - B)


def test_torch_path_is_in_place():
    slots, nd = torch.tensor([0]), torch.tensor([[0, 1]])
    scale, cap, prev = torch.full((2,), 8.0), torch.full((2,), 32, dtype=torch.int32), \
        torch.zeros(2, dtype=torch.int64)
    controller_commit_torch(slots, nd, torch.tensor([2], dtype=torch.int32),
                            torch.tensor([2], dtype=torch.int32), scale, cap, prev, **KW)
    assert scale.tolist() == [8.0 * CFG.alpha, 8.0] and prev.tolist() == [1, 0]


def test_the_kernel_leaves_a_slot_outside_the_state_alone():
    """A slot outside ``[0, S)`` (a caller's error) is neither read nor written by the
    kernel (it once wrote past the state: a heap corruption on the CPU); the other rows
    update as ever."""
    slots = torch.tensor([3, 0, -1])
    nd = torch.tensor([[0, 1], [0, 1], [0, 1]])
    num = torch.full((3,), 2, dtype=torch.int32)
    nacc = torch.full((3,), 2, dtype=torch.int32)
    store = torch.full((6,), 8.0, device=DEV)
    flags = torch.full((6,), 7, dtype=torch.int64, device=DEV)
    scale, prev = store[1:4], flags[1:4]  # S = 3 inside guards on either side
    controller_commit(slots.to(DEV), nd.to(DEV), num.to(DEV), nacc.to(DEV), scale,
                      torch.full((3,), 32, dtype=torch.int32, device=DEV), prev, **KW,
                      use_triton=True)
    assert store.tolist() == [8.0, 8.0 * CFG.alpha, 8.0, 8.0, 8.0, 8.0]
    assert flags.tolist() == [7, 1, 7, 7, 7, 7]



@pytest.mark.parametrize("slots", [[-1, 0, 4, 3], [3, 4, 0, -1], [-9, 4, 9, 2, 0, 3, -1],
                                   [-1, 4], [5, 0, -2, 3, 4]])
def test_both_paths_skip_a_slot_outside_the_state(slots):
    """A row whose slot is outside ``[0, S)`` (negative, ``S`` or past it) is skipped on both
    paths alike (the torch path once wrapped or raised), also when that row's clamped slot
    is a kept row's (-1 -> 0, S -> S - 1) with another update: the kept rows update as in
    a batch without the skipped rows, and no other slot changes."""
    S = 4
    rng = random.Random(len(slots))
    B = len(slots)
    slots = torch.tensor(slots, dtype=torch.int64)
    ok = (slots >= 0) & (slots < S)
    nd = torch.tensor([[0, 1, 2]] * B)
    num = torch.full((B,), 3, dtype=torch.int32)  # depth 3: accepted whole or rejected
    nacc = torch.tensor([3 * (b % 2) for b in range(B)], dtype=torch.int32)
    for _ in range(3):
        scale, cap, prev = state(S, rng)
        s, p = run_both(slots, nd, num, nacc, scale, cap, prev)  # asserts both paths agree
        want_s, want_p = scale.clone(), prev.clone()
        controller_commit_torch(slots[ok], nd[ok], num[ok], nacc[ok], want_s, cap, want_p,
                                **KW)
        assert torch.equal(s, want_s) and torch.equal(p, want_p)

def test_rejects_bad_inputs():
    good = dict(slots=torch.tensor([0]), nd=torch.zeros(1, 2, dtype=torch.int64),
                num_draft_tokens=torch.ones(1, dtype=torch.int32),
                nacc=torch.ones(1, dtype=torch.int32), scale=torch.ones(3),
                cap=torch.ones(3, dtype=torch.int32), prev_full=torch.zeros(3, dtype=torch.int64))
    for name, bad in (("slots", torch.tensor([0], dtype=torch.int32)), ("nd", torch.zeros(2)),
                      ("num_draft_tokens", torch.ones(2, dtype=torch.int32)),
                      ("nacc", torch.ones(1)), ("scale", torch.ones(3, dtype=torch.float64)),
                      ("cap", torch.ones(2, dtype=torch.int32)),
                      ("prev_full", torch.zeros(3, dtype=torch.int32))):
        with pytest.raises(ValueError, match=name):
            controller_commit(**{**good, name: bad}, **KW, use_triton=True)


def test_rejects_a_tensor_on_another_device_and_a_strided_state():
    good = dict(slots=torch.tensor([0]), nd=torch.zeros(1, 2, dtype=torch.int64),
                num_draft_tokens=torch.ones(1, dtype=torch.int32),
                nacc=torch.ones(1, dtype=torch.int32), scale=torch.ones(3),
                cap=torch.ones(3, dtype=torch.int32), prev_full=torch.zeros(3, dtype=torch.int64))
    for name in ("slots", "num_draft_tokens", "nacc", "scale", "cap", "prev_full"):
        with pytest.raises(ValueError, match=f"^{name}: on meta"):
            controller_commit(**{**good, name: good[name].to("meta")}, **KW, use_triton=True)
    strided = torch.ones(6)[::2]  # [3], stride 2: the kernel indexes the state by slot
    with pytest.raises(ValueError, match="state must be contiguous"):
        controller_commit(**{**good, "scale": strided}, **KW, use_triton=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter
def test_scales_at_float32s_extremes_stay_finite():
    """Scales at and near float32's largest (x alpha overflows to inf) and tiny ones,
    alpha = 1e3, no upper bound (s_max = inf): both paths clamp to float32's largest and
    ``s_min``, equal and finite, on full acceptances and rejections alike."""
    f32_max = torch.finfo(torch.float32).max
    slots = torch.tensor([0, 1, 2, 3, 4])
    nd = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1]])
    num = torch.tensor([2, 2, 2, 2, 2], dtype=torch.int32)  # depth 2
    nacc = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)  # full, reject, full, reject, full
    scale = torch.tensor([f32_max, f32_max, 1e38, 1e-38, 1e-38], dtype=torch.float32)
    cap = torch.full((5,), 32, dtype=torch.int32)
    prev = torch.zeros(5, dtype=torch.int64)
    kw = dict(KW, alpha=1e3, s_max=float("inf"))
    s, p = run_both(slots, nd, num, nacc, scale, cap, prev, kw=kw)
    assert torch.isfinite(s).all(), s
    assert s[0] == s[2] == f32_max and s[1] == torch.tensor(f32_max * CFG.beta).float()
    assert s[3:].tolist() == [CFG.s_min] * 2 and p.tolist() == [1, 0, 1, 0, 1]


def test_one_compile_per_draft_width_block():
    """Batch size and draft width are not specialized: one compile per power-of-two block
    of the width."""
    def launch(B, N):
        S = B + 1
        return lambda: controller_commit(
            torch.arange(B, device=DEV), torch.zeros(B, N, dtype=torch.int64, device=DEV),
            torch.ones(B, dtype=torch.int32, device=DEV),
            torch.ones(B, dtype=torch.int32, device=DEV), torch.ones(S, device=DEV),
            torch.ones(S, dtype=torch.int32, device=DEV),
            torch.zeros(S, dtype=torch.int64, device=DEV), **KW, use_triton=True)

    assert assert_one_compile_per_config(
        _controller_commit_kernel,
        [launch(B, N) for B, N in ((1, 1), (2, 1), (1, 17), (16, 32), (64, 20))]) == 2


def test_kernel_compiles_for_sm90():
    sig = dict(slots_ptr="*i64", nd_ptr="*i64", num_ptr="*i32", nacc_ptr="*i32",
               scale_ptr="*fp32", cap_ptr="*i32", prev_full_ptr="*i64", bound_ptr="*i64",
               N="i32", S="i32", alpha="fp32", beta="fp32", s_min="fp32", s_max="fp32",
               HAS_BOUND="constexpr", BLOCK_N="constexpr")
    compile_all_for_sm90([(_controller_commit_kernel, sig, dict(HAS_BOUND=h, BLOCK_N=n))
                          for h in (False, True) for n in (256, 1)])
