"""The draft-trie kernel: the Triton kernel (interpreted on CPU) equals the torch path on
random candidate windows (small vocabularies: many shared prefixes), separators, identical
candidates (periodic text), empty windows, one candidate of one token, widths that are not
powers of two, with and without calibration, depth caps and a probability floor; bit for bit
with exactly representable weights, to float32 rounding with arbitrary ones; a drafter whose
bad arguments are named; the kernel
compiles for sm_90. (A drafter on the kernels: tests/test_draft_nodes.py.)"""

import random

import pytest
import torch

from agspec_gpu.kernels.node_probs import _node_probs_kernel, node_probs, node_probs_torch
from kernel_compile import NoLaunch, assert_one_compile_per_config, compile_all_for_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
T, L = 4, 6  # tiers, longest match (calibration rows: 2 * T * (L + 1))


def random_case(rng: random.Random, B: int, C: int, K: int, vocab: int, dyadic: bool,
                kind: str = "random") -> dict:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    W = torch.randint(0, vocab, (B, C, K), generator=g, dtype=torch.int32)
    if kind == "random":  # a separator ends some windows, some are empty
        for b in range(B):
            for c in range(C):
                cut = rng.choice([K, K, rng.randrange(K + 1), 0])
                W[b, c, cut:] = -1
        W[torch.rand(B, C, K, generator=g) < 0.03] = -1  # stray -1 inside: never a node
    elif kind == "identical":  # periodic text: every candidate the same window
        W[:] = W[:, :1]
    elif kind == "empty":
        W[:] = -1
    S = torch.randint(-1, 8 * T, (B, C, K), generator=g, dtype=torch.int32)
    if dyadic:
        Wt = torch.tensor([rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]) for _ in range(B * C)],
                          dtype=torch.float32).view(B, C)
    else:
        Wt = torch.rand(B, C, generator=g, dtype=torch.float32) * 3
    R = 2 * T * (L + 1)
    seen = torch.randint(2, 40, (R, K + 2), generator=g).double()
    hits = (seen * torch.rand(R, K + 2, generator=g, dtype=torch.float64)).clamp(min=1e-3)
    return dict(W=W, S=S, Wt=Wt, best=torch.randint(0, L + 3, (B,), generator=g,
                                                     dtype=torch.int32),
                mode=torch.randint(0, 2, (B,), generator=g),
                k=torch.randint(1, K + 2, (B,), generator=g, dtype=torch.int32),
                calib_hits=hits, calib_seen=seen)


def both(case: dict, **kw):
    """The kernel on ``DEV`` and the torch path on the CPU: the reference (on CUDA torch's
    ``cumprod`` multiplies in float32, on the CPU in float64 as the kernel does)."""
    c = {n: v.to(DEV) for n, v in case.items()}
    got = node_probs(**c, num_tiers=T, max_match=L, use_triton=True, **kw)
    want = node_probs_torch(**case, num_tiers=T, max_match=L, **kw)
    return [x.cpu() for x in got], want


@pytest.mark.parametrize("B,C,K", [(1, 1, 1), (2, 3, 5), (3, 8, 32), (2, 16, 32), (2, 24, 7),
                                   (1, 5, 64)])
@pytest.mark.parametrize("calibrate", [True, False])
def test_kernel_equals_torch_path_bit_for_bit_with_dyadic_weights(B, C, K, calibrate):
    rng = random.Random(B * 100 + C * 10 + K + calibrate)
    for trial, kind in enumerate(["random", "random", "identical", "empty"]):
        case = random_case(rng, B, C, K, vocab=2 if trial == 1 else 7, dyadic=True, kind=kind)
        for min_prob in (0.0, 0.2):
            got, want = both(case, min_prob=min_prob, calibrate=calibrate)
            for name, g, w in zip(("key", "rep", "calib_row", "mass"), got, want):
                assert torch.equal(g, w), (trial, kind, min_prob, name)


def test_kernel_matches_torch_path_with_arbitrary_weights():
    rng = random.Random(5)
    for trial in range(6):
        case = random_case(rng, 3, 16, 32, vocab=3, dyadic=False)
        got, want = both(case, min_prob=0.0, calibrate=True)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-7)
        # the same nodes; their estimates within float32 rounding
        assert torch.equal(got[0] > -1.5, want[0] > -1.5)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)


def test_empty_batch():
    case = random_case(random.Random(0), 0, 4, 8, vocab=3, dyadic=True)
    got, want = both(case, min_prob=0.0, calibrate=True)
    assert all(g.shape == w.shape for g, w in zip(got, want)) and got[0].numel() == 0


@pytest.mark.parametrize("C,K", [(0, 4), (3, 0), (0, 0)])
def test_no_candidate_or_no_column_gives_no_node(C, K):
    """Rows without a candidate or a column: both paths give no node (key -2, every
    representative C, mass 0) rather than the torch path raising on an empty reduction."""
    case = random_case(random.Random(2), 2, max(C, 1), max(K, 1), vocab=3, dyadic=True)
    case["W"], case["S"] = (case[k][:, :C, :K].contiguous() for k in ("W", "S"))
    case["Wt"] = case["Wt"][:, :C].contiguous()
    for calibrate in (True, False):
        got, want = (node_probs(**case, num_tiers=T, max_match=L, min_prob=0.0,
                                calibrate=calibrate, use_triton=t) for t in (True, False))
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert got[0].shape == (2, C * K) and (got[0] == -2).all() and (got[1] == C).all()


def test_bad_arguments_are_named():
    c = random_case(random.Random(1), 2, 3, 4, vocab=3, dyadic=True)
    kw = dict(num_tiers=T, max_match=L, min_prob=0.0, calibrate=True)
    with pytest.raises(ValueError, match="k: on meta"):
        node_probs(**{**c, "k": c["k"].to("meta")}, **kw)
    with pytest.raises(ValueError, match="Wt"):
        node_probs(**{**c, "Wt": c["Wt"].double()}, **kw)
    with pytest.raises(ValueError, match="best"):
        node_probs(**{**c, "best": c["best"][:1]}, **kw)
    with pytest.raises(ValueError, match="calib_seen"):
        node_probs(**{**c, "calib_seen": c["calib_seen"][:3], "calib_hits": c["calib_hits"][:3]},
                   **kw)
    # scalars the kernel would take as they are (max_match = -1 read rows before the
    # table; a float num_tiers failed inside Triton): refused on both paths, by name
    for bad, name in ((dict(max_match=-1), "max_match"), (dict(max_match=2.0), "max_match"),
                      (dict(num_tiers=0), "num_tiers"), (dict(num_tiers=4.0), "num_tiers"),
                      (dict(num_tiers=True), "num_tiers"), (dict(min_prob="x"), "min_prob"),
                      (dict(min_prob=None), "min_prob"), (dict(calibrate=1), "calibrate")):
        for use_triton in (True, False):
            with pytest.raises(ValueError, match=f"^{name}: expected"):
                node_probs(**c, **{**kw, **bad}, use_triton=use_triton)
    with pytest.raises(ValueError, match="W: expected int32"):
        node_probs(**{**c, "W": c["W"][0]}, **kw)


def test_one_compile_per_block_of_candidates():
    """Three or four corpora of 8 candidates (C = 24 or 32) share one block of 32: one
    compile, whichever C a batch has."""
    rng = random.Random(4)
    launches = [lambda C=C: both(random_case(rng, 2, C, 5, 3, True), min_prob=0.0,
                                 calibrate=True) for C in (24, 32)]
    assert assert_one_compile_per_config(_node_probs_kernel, launches) == 1


def test_kernel_compiles_for_sm90():
    sig = dict(w_ptr="*i32", s_ptr="*i32", wt_ptr="*fp32", best_ptr="*i32", mode_ptr="*i64",
               k_ptr="*i32", hits_ptr="*fp64", seen_ptr="*fp64", key_ptr="*fp32",
               rep_ptr="*i64", row_ptr="*i64", mass_ptr="*fp32", C="i32", K="i32", KC="i32",
               MAX_MATCH="i32", MIN_PROB="fp32", NUM_TIERS="constexpr",
               CALIBRATE="constexpr", BLOCK_C="constexpr", BLOCK_K="constexpr")
    usage = compile_all_for_sm90([
        (_node_probs_kernel, sig, dict(NUM_TIERS=4, CALIBRATE=True, BLOCK_C=16, BLOCK_K=32)),
        (_node_probs_kernel, sig, dict(NUM_TIERS=4, CALIBRATE=False, BLOCK_C=8, BLOCK_K=64)),
        (_node_probs_kernel, sig, dict(NUM_TIERS=4, CALIBRATE=True, BLOCK_C=16, BLOCK_K=128))])
    # bit for bit with torch on a GPU too: the share's division IEEE-rounded, no contraction
    assert all(u["div_full_f32"] == 0 and u["fma_f32"] == 0 for u in usage), usage
    # the widest windows the launcher takes (MAX_BLOCK_WINDOWS): 20 bytes spilled at most
    compile_all_for_sm90([(_node_probs_kernel, sig, dict(NUM_TIERS=4, CALIBRATE=True,
                                                          BLOCK_C=32, BLOCK_K=64))],
                         max_spill_bytes=24)


def test_windows_past_the_widest_block_run_the_torch_path(monkeypatch):
    import agspec_gpu.kernels.node_probs as node_probs_mod

    monkeypatch.setattr(node_probs_mod, "_node_probs_kernel", NoLaunch())
    case = random_case(random.Random(2), 2, 40, 60, vocab=3, dyadic=True)  # 64 x 64 padded
    got = node_probs(**{k: v.to(DEV) for k, v in case.items()}, num_tiers=T, max_match=L,
                     min_prob=0.0, calibrate=True, use_triton=True)
    want = node_probs_torch(**case, num_tiers=T, max_match=L, min_prob=0.0, calibrate=True)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("calibrate", [True, False])
def test_a_childs_estimate_never_exceeds_its_parents(calibrate):
    """Candidates from different tiers (different calibration rows) sharing a prefix: the
    estimate multiplies each node's chance along the path, so a child never outranks its
    parent and best-first order is topological (a parent ranked after its child would get
    the child a wrong attention mask, and a wrong token accepted)."""
    rng = random.Random(11)
    for trial in range(8):
        case = random_case(rng, 3, 16, 12, vocab=2, dyadic=False)
        for use_triton in (False, True):  # the kernel's float32 sums too (not bit-equal)
            key, rep, _, _ = node_probs(**{k: v.to(DEV) for k, v in case.items()},
                                        num_tiers=T, max_match=L, min_prob=0.0,
                                        calibrate=calibrate, use_triton=use_triton)
            key, rep = key.cpu().view(3, 16, 12), rep.cpu()
            nodes = 0
            for b in range(3):
                for c in range(16):
                    for d in range(1, 12):
                        if key[b, c, d] > -1.5:
                            parent = key[b, int(rep[b, c, d - 1]), d - 1]
                            assert parent > -1.5 and key[b, c, d] <= parent, \
                                (use_triton, trial, b, c, d)
                            nodes += 1
            assert nodes > 0
