"""The depth-caps kernel (``kernels/depth_caps.py``) against its torch path and the
controller's rule; and its sm_90 compile."""

import random

import pytest
import torch

from agspec_gpu.controller import ControllerConfig, draft_depth
from agspec_gpu.kernels.depth_caps import _depth_caps_kernel, depth_caps
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def both(slots, best, scale, cap, prev, static_k=None, max_k=None):
    args = tuple(t.to(DEV) for t in (
        torch.tensor(slots, dtype=torch.int64), torch.tensor(best, dtype=torch.int32),
        torch.tensor(scale, dtype=torch.float32), torch.tensor(cap, dtype=torch.int32),
        torch.tensor(prev, dtype=torch.int64)))
    bound = None if max_k is None else torch.tensor(max_k, dtype=torch.int64, device=DEV)
    a = depth_caps(*args, static_k=static_k, max_k=bound, use_triton=False)
    b = depth_caps(*args, static_k=static_k, max_k=bound, use_triton=True)
    assert a[0].dtype == b[0].dtype == torch.int32 and a[1].dtype == b[1].dtype == torch.int64
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    return a[0].tolist(), a[1].tolist()


def test_rule_and_modes():
    # slot 2: 4.0 * 3 = 12 -> the role cap 8; slot 0: floor(4.5 * 1) = 4; slot 1: no match -> 1
    k, mode = both([2, 0, 1], [3, 1, 0], [4.5, 16.0, 4.0], [32, 32, 8], [1, 0, 1])
    assert k == [8, 4, 1] and mode == [1, 1, 0]
    k, _ = both([2, 0, 1], [3, 1, 0], [4.5, 16.0, 4.0], [32, 32, 8], [1, 0, 1], static_k=16)
    assert k == [16, 16, 16]  # static k ignores the scale and the role cap


@pytest.mark.parametrize("B", [0, 1, 130])  # 130: more than one program
def test_static_k_at_every_batch_size(B):
    rng = random.Random(B)
    S = B + 2
    slots = rng.sample(range(S), B)
    prev = [rng.randint(0, 1) for _ in range(S)]
    k, mode = both(slots, [rng.randint(0, 9) for _ in range(B)], [4.0] * S, [8] * S, prev,
                   static_k=5)
    assert k == [5] * B and mode == [prev[s] for s in slots]


def test_matches_the_controllers_draft_depth():
    rng = random.Random(0)
    for B in (0, 1, 5, 130):  # 130: more than one program
        S = B + 3
        slots = rng.sample(range(S), B)
        best = [rng.randint(0, 40) for _ in range(B)]
        scale = [rng.choice([4.0, 5.5, 7.3, 11.25, 16.0]) for _ in range(S)]
        cap = [rng.choice([1, 4, 16, 32]) for _ in range(S)]
        prev = [rng.randint(0, 1) for _ in range(S)]
        k, mode = both(slots, best, scale, cap, prev)
        want = draft_depth(torch.tensor(scale)[slots], torch.tensor(best, dtype=torch.int32),
                           torch.tensor(cap, dtype=torch.int32)[slots], ControllerConfig())
        assert k == want.tolist() and mode == [prev[s] for s in slots]


# (the interpreter's numpy says so: 3e38 * 3 overflows, 0 * inf is NaN, as meant)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_an_unbounded_scale_drafts_to_the_cap():
    """``ControllerConfig(s_max=inf)``: a scale whose product with the match passes int32
    drafts to the cap on both paths (the torch path's cast once wrapped it to 1); no match
    under an infinite scale (0 * inf) drafts 1."""
    inf = float("inf")
    k, _ = both([0, 1, 2, 3], [64, 1, 0, 3], [1e8, inf, inf, 3e38], [32, 16, 8, 4], [0] * 4)
    assert k == [32, 16, 1, 4]


# (the interpreter's numpy: the unused branch casts 3e38 * 5)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_a_cap_float32_rounds_is_never_passed():
    """Caps past 2**24 are not float32 numbers: the depth is the int cap itself, never the
    rounded one (2**31 - 1 rounded to 2**31 once cast to -2**31)."""
    big = 2 ** 31 - 1
    k, _ = both([0, 1, 2, 3], [5, 3, 1, 1], [3e38, 3e38, float(2 ** 25), 16.0],
                [big, 2 ** 25 - 1, 2 ** 25 - 1, 2 ** 25 - 1], [0] * 4)
    assert k == [big, 2 ** 25 - 1, 2 ** 25 - 1, 16]
    # a product under such a cap: float32's largest value below 2**31, floored exactly on
    # both paths (the torch path clamped it to 2**31 - 256)
    k, _ = both([0], [1], [float(2 ** 31 - 128)], [big], [0])
    assert k == [2 ** 31 - 128]
    want = draft_depth(torch.tensor([3e38]), torch.tensor([5], dtype=torch.int32),
                       torch.tensor([big], dtype=torch.int32),
                       ControllerConfig(s_max=float("inf")))
    assert want.tolist() == [big]


def test_the_kernel_reads_a_slot_outside_the_state_as_padding():
    """A slot outside ``[0, S)`` (a caller's error) reads no memory past the state: depth 1,
    mode 0 (the other rows as ever)."""
    args = (torch.tensor([2, 0, -1]), torch.tensor([3, 3, 3], dtype=torch.int32),
            torch.tensor([4.0, 4.0]), torch.tensor([32, 32], dtype=torch.int32),
            torch.tensor([1, 1]))
    k, mode = depth_caps(*(t.to(DEV) for t in args), use_triton=True)
    assert k.tolist() == [1, 12, 1] and mode.tolist() == [0, 1, 0]



@pytest.mark.parametrize("static_k", [None, 5])
def test_both_paths_read_a_slot_outside_the_state_as_padding(static_k):
    """Negative slots, ``S`` and past it (the torch path once wrapped or raised) read as
    padding on both paths, depth 1 (or ``static_k``) and mode 0, mixed with kept rows at the
    slots they would clamp to (0, S - 1), whose results are as in a batch without them."""
    slots = [-1, 0, 3, 2, -5, 9, 1]
    best = [3, 2, 4, 1, 7, 0, 5]
    scale, cap, prev = [4.0, 2.5, 0.5], [32, 4, 8], [1, 0, 1]
    k, mode = both(slots, best, scale, cap, prev, static_k=static_k)
    ok = [b for b, s in enumerate(slots) if 0 <= s < 3]
    want = both([slots[b] for b in ok], [best[b] for b in ok], scale, cap, prev,
                static_k=static_k)
    assert [k[b] for b in ok] == want[0] and [mode[b] for b in ok] == want[1]
    pad = [b for b in range(len(slots)) if b not in ok]
    assert [k[b] for b in pad] == [static_k or 1] * 4 and [mode[b] for b in pad] == [0] * 4
    assert both([-1, 3], [3, 3], [], [], [], static_k=static_k) == ([static_k or 1] * 2,
                                                                      [0, 0])  # S = 0

@pytest.mark.parametrize("static_k", [None, 5])
def test_a_requests_own_bound_caps_its_depth(static_k):
    """``max_k``: each request's depth is at most its bound (what it may still emit less the
    bonus token); 0 and a negative bound draft nothing; a bound past the rule changes
    nothing; a padding slot's row takes its bound too. Both paths, across programs."""
    rng = random.Random(7)
    for B in (0, 1, 6, 130):
        S = B + 2
        slots = [rng.choice([*range(S), -1, S]) for _ in range(B)]
        best = [rng.randint(0, 12) for _ in range(B)]
        scale = [rng.choice([0.5, 4.0, 16.0]) for _ in range(S)]
        cap = [rng.choice([1, 8, 32]) for _ in range(S)]
        prev = [rng.randint(0, 1) for _ in range(S)]
        bound = [rng.choice([-2 ** 40, -3, 0, 1, 2, 5, 2 ** 31, 2 ** 62]) for _ in range(B)]
        free, mode = both(slots, best, scale, cap, prev, static_k=static_k)
        k, mode_b = both(slots, best, scale, cap, prev, static_k=static_k, max_k=bound)
        assert k == [min(f, max(m, 0)) for f, m in zip(free, bound)] and mode_b == mode
    k, _ = both([0, 1, 2], [9, 9, 9], [4.0] * 3, [32] * 3, [0] * 3, static_k=static_k,
                max_k=[0, 3, 64])
    assert k == [0, 3, static_k or 32]


def test_rejects_bad_inputs():
    good = dict(slots=torch.tensor([0]), best=torch.ones(1, dtype=torch.int32),
                scale=torch.ones(2), cap=torch.ones(2, dtype=torch.int32),
                prev_full=torch.zeros(2, dtype=torch.int64))
    for name, bad in (("slots", torch.tensor([0.0])), ("best", torch.ones(2, dtype=torch.int32)),
                      ("scale", torch.ones(2, dtype=torch.float64)),
                      ("cap", torch.ones(3, dtype=torch.int32)),
                      ("prev_full", torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(ValueError, match=name):
            depth_caps(**{**good, name: bad}, use_triton=True)
    for bad in (0, 2.0, True, 2 ** 31):
        with pytest.raises(ValueError, match="static_k"):
            depth_caps(**good, static_k=bad, use_triton=True)
    for bad in (torch.ones(1, dtype=torch.int32), torch.ones(2, dtype=torch.int64)):
        for use_triton in (False, True):
            with pytest.raises(ValueError, match="max_k"):
                depth_caps(**good, max_k=bad, use_triton=use_triton)


def test_rejects_a_tensor_on_another_device():
    good = dict(slots=torch.tensor([0]), best=torch.ones(1, dtype=torch.int32),
                scale=torch.ones(2), cap=torch.ones(2, dtype=torch.int32),
                prev_full=torch.zeros(2, dtype=torch.int64))
    for name in ("best", "scale", "cap", "prev_full"):
        with pytest.raises(ValueError, match=f"^{name}: on meta"):
            depth_caps(**{**good, name: good[name].to("meta")}, use_triton=True)


def test_one_compile_for_every_batch():
    """The batch size is not specialized (a graph bucket, or any size eagerly): one compile
    per static mode."""
    def launch(B):
        S = B + 1
        return lambda: depth_caps(
            torch.zeros(B, dtype=torch.int64, device=DEV), torch.ones(B, dtype=torch.int32,
                                                                      device=DEV),
            torch.ones(S, device=DEV), torch.ones(S, dtype=torch.int32, device=DEV),
            torch.zeros(S, dtype=torch.int64, device=DEV), use_triton=True)

    assert assert_one_compile_per_config(_depth_caps_kernel,
                                         [launch(B) for B in (1, 2, 16, 64, 65)]) == 1


def test_kernel_compiles_for_sm90():
    sig = dict(slots_ptr="*i64", best_ptr="*i32", scale_ptr="*fp32", cap_ptr="*i32",
               prev_full_ptr="*i64", max_k_ptr="*i64", k_ptr="*i32", mode_ptr="*i64",
               B="i32", S="i32", static_k="i32", STATIC="constexpr", HAS_MAX_K="constexpr",
               BLOCK_B="constexpr")
    compile_all_for_sm90([(_depth_caps_kernel, sig, dict(STATIC=static, HAS_MAX_K=has_max,
                                                         BLOCK_B=128))
                          for static in (False, True) for has_max in (False, True)])
