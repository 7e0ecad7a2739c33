"""Best-first ranking and node emission: the Triton kernels (interpreted on CPU) equal the
torch paths on random keys with many exact ties, no nodes at all, every entry a node, widths
that are not powers of two, fewer slots than nodes; emission over real tries (from the trie
kernel's torch path) with any number of kept nodes; a drafter whose whole tree step runs the
kernels, and whose commits run the commit kernel, drafts and keeps exactly what the torch
path does; bad arguments are named; both kernels compile for sm_90."""

import functools
import random
from operator import attrgetter

import pytest
import torch

import agspec_gpu.drafter as drafter_mod
import agspec_gpu.kernels.draft_nodes as draft_nodes_mod
from agspec_gpu.accept import teacher_forced_accept
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.kernels.draft_nodes import (MAX_BLOCK_KEYS, _best_first_kernel, _emit_nodes_kernel,
                                            best_first,
                                            best_first_torch, emit_nodes, emit_nodes_torch,
                                            MAX_BLOCK_N)
from agspec_gpu.kernels.node_probs import node_probs_torch
from agspec_gpu.tiers import CorpusStore, TierConfig
from agspec_gpu.tokenizer import load_tokenizer
from kernel_compile import (NoLaunch, assert_one_compile_per_config, compile_all_for_sm90,
                            num_compiles, recorded_specializations)
from test_node_probs import L, T, random_case

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_keys(g: torch.Generator, B: int, CK: int, kind: str) -> torch.Tensor:
    if kind == "ties":  # a handful of values: most comparisons fall to the tie-break
        vals = torch.tensor([-2.0, 0.0, 0.125, 0.25, 0.5, 1.0])
        return vals[torch.randint(0, 6, (B, CK), generator=g)]
    if kind == "none":
        return torch.full((B, CK), -2.0)
    if kind == "all":
        return torch.rand(B, CK, generator=g)
    k = torch.rand(B, CK, generator=g)
    return torch.where(torch.rand(B, CK, generator=g) < 0.5, k, -2.0)


@pytest.mark.parametrize("B,C,K,N,max_nodes", [(1, 1, 1, 1, 1), (3, 3, 5, 15, 15),
                                               (2, 16, 32, 64, 64), (4, 8, 32, 64, 20),
                                               (2, 24, 7, 30, 64), (1, 2, 3, 0, 4)])
@pytest.mark.parametrize("kind", ["mixed", "ties", "none", "all"])
def test_best_first_kernel_equals_torch_path(B, C, K, N, max_nodes, kind):
    g = torch.Generator().manual_seed(B * 7 + C * 3 + K + N)
    key = random_keys(g, B, C * K, kind).to(DEV)
    got = best_first(key, C, K, N, max_nodes, use_triton=True)
    want = best_first_torch(key, C, K, N, max_nodes)
    for name, a, b in zip(("order", "ranked", "keep"), got, want):
        assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("B,C,K,max_n", [(1, 1, 1, 64), (2, 3, 5, 64), (3, 16, 32, 64),
                                         (2, 24, 7, 64), (2, 8, 32, MAX_BLOCK_N),
                                         (1, 16, 32, 300)])  # wider than a block: torch
def test_emit_nodes_kernel_equals_torch_path_on_real_tries(B, C, K, max_n, monkeypatch):
    if min(max_n, C * K) > MAX_BLOCK_N:  # the torch path: the kernel must not launch
        monkeypatch.setattr(draft_nodes_mod, "_emit_nodes_kernel", NoLaunch())
    rng = random.Random(B + C + K)
    for trial in range(3):
        case = random_case(rng, B, C, K, vocab=2 + trial, dyadic=True)
        key, rep, row, _ = node_probs_torch(**case, num_tiers=T, max_match=L, min_prob=0.0,
                                            calibrate=True)
        N = min(max_n, C * K)
        order, _, keep = best_first_torch(key, C, K, N, max_n)
        num = torch.tensor([rng.randint(0, int(x)) for x in keep], dtype=torch.int64)
        args = [t.to(DEV) for t in (order, num, case["W"], case["S"], rep, row)]
        got = emit_nodes(*args, use_triton=True)
        want = emit_nodes_torch(*args)
        for name, a, b in zip(("tok", "parent", "src", "depth", "row"), got, want):
            assert torch.equal(a.cpu(), b.cpu()), (trial, name)
        # a kept node's parent is an earlier kept node (topological order)
        par = want[1].cpu()
        for b in range(B):
            for i in range(int(num[b])):
                assert -1 <= int(par[b, i]) < i


def test_bad_arguments_are_named():
    key = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="key"):
        best_first(key.double(), 2, 3, 6, 6)
    with pytest.raises(ValueError, match="N must be"):
        best_first(key, 2, 3, 7, 6)
    with pytest.raises(ValueError, match="^key: expected 2 dims, got \\[\\]"):
        best_first(torch.tensor(0.5), 1, 1, 1, 1)
    o = torch.zeros(2, 4, dtype=torch.int64)
    W = torch.zeros(2, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="rep"):
        emit_nodes(o, torch.zeros(2, dtype=torch.int64), W, W, W, torch.zeros(2, 2,
                                                                              dtype=torch.int64))
    rep, row = W.long(), torch.zeros(2, 2, dtype=torch.int64)
    num = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="W: expected 3 dims"):
        emit_nodes(o, num, W[:, 0], W, rep, row)
    with pytest.raises(ValueError, match="order: expected 2 dims"):
        emit_nodes(o[0], num, W, W, rep, row)
    with pytest.raises(ValueError, match="rep: on meta"):
        emit_nodes(o, num, W, W, rep.to("meta"), row)
    with pytest.raises(ValueError, match="max_nodes"):
        best_first(key, 2, 3, 6, 1.5)
    for args, name in (((2.0, 3, 6, 6), "C"), ((2, True, 6, 6), "K"), ((2, 3, -1, 6), "N"),
                       ((2, 3, 6.0, 6), "N"), ((2, 3, 6, -1), "max_nodes")):
        for use_triton in (True, False):
            with pytest.raises(ValueError, match=f"^{name}: expected an int"):
                best_first(key, *args, use_triton=use_triton)


def test_drafter_on_the_kernels_equals_the_torch_path(monkeypatch):
    """Two drafters on the same steps (batch budget on, calibrated, tenants with and without
    a workspace), one running its propose and commit on the kernels (suffix_match with its
    queries read from the ring and its windows, candidate_rows, depth_caps, node_probs,
    best_first, budget_keep, emit_nodes, controller_commit, drafter_commit; the match has
    its own tests too): the same drafts, budget-cut ones included, and the same state after
    every commit, whether the verifier passes its accepted path or not."""
    tok = load_tokenizer("cl100k")
    text = tok.encode("def f(x):\n    return x + 1\n\nprint(f(2))\nfor i in range(3):\n"
                      "    print(f(i))\n" * 5)
    ds = []
    for _ in range(2):
        store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=64), device=DEV)
        store.add_workspace_file("w", "w.py", "def f(x):\n    return x + 2\n" * 4)
        # no CUDA graphs on a GPU: the steps call the patched functions; 4 occurrences per
        # corpus, not 8: blocks of at most 512 candidate entries, not 1,024 (the
        # interpreter's sorts are the test's time; the 1,024 block has its own tests)
        d = Drafter(store, DrafterConfig(cuda_graphs=False, max_positions=4), max_batch=8)
        for i in range(6):
            d.open_session(f"s{i}", "w" if i % 2 else f"t{i}", prompt_ids=text[: 30 + 9 * i])
        ds.append(d)
    real = {n: getattr(drafter_mod, n)
            for n in ("suffix_match", "candidate_rows", "depth_caps", "node_probs",
                      "best_first", "budget_keep", "emit_nodes", "controller_commit",
                      "drafter_commit")}

    def use(kernels: bool) -> None:
        for n, f in real.items():
            monkeypatch.setattr(drafter_mod, n, functools.partial(f, use_triton=kernels))

    drafted = 0
    for step, b in enumerate([6, 3, 1, 4, 6]):
        sids = [f"s{i}" for i in range(b)]
        drafts = []
        for i, d in enumerate(ds):
            use(i == 0)
            drafts.append(d.propose(sids))
        for f in ("token_ids", "parents", "num_draft_tokens", "maybe_source"):
            assert torch.equal(getattr(drafts[0], f), getattr(drafts[1], f)), (step, f)
        drafted += int(drafts[0].num_draft_tokens.sum())
        truth = drafts[0].token_ids[:, :3].clamp(min=0)
        res = teacher_forced_accept(drafts[0], truth)
        n = res.num_accepted.to(torch.int32)
        out = torch.cat([truth, truth[:, :1]], 1).to(torch.int32)
        for i, d in enumerate(ds):
            use(i == 0)
            d.observe(sids, out, n + 1, n, path_nodes=res.path_nodes if step % 2 else None)
        for name in ("state.scale", "state.prev_full", "stats.calib_seen", "stats.calib_hits",
                     "stats.tier_hits", "stats.tier_drafts", "state.recent", "state.recent_len",
                     "state.match_cap", "last_accepted_sources"):
            assert torch.equal(attrgetter(name)(ds[0]), attrgetter(name)(ds[1])), (step, name)
    assert drafted > 0 and ds[0].stats.calib_seen.ne(2.0).any()


def test_best_first_compiles_once_per_block_of_candidates():
    """Three or four corpora of 8 candidates each (C = 24 or 32, K = 32) share one block of
    1,024 scores: one compile, whichever C a batch has; the production block's rankings
    equal the torch path's (ties among them)."""
    g = torch.Generator().manual_seed(3)

    def launch(C: int, kind: str) -> None:
        key = random_keys(g, 2, C * 32, kind).to(DEV)
        got = best_first(key, C, 32, 64, 64, use_triton=True)
        for name, a, b in zip(("order", "ranked", "keep"), got,
                              best_first_torch(key, C, 32, 64, 64)):
            assert torch.equal(a, b), (C, kind, name)

    launches = [functools.partial(launch, C, kind) for C, kind in ((24, "mixed"), (32, "ties"))]
    assert assert_one_compile_per_config(_best_first_kernel, launches) == 1


def test_drafter_steps_compile_each_kernel_once_per_block_shape(monkeypatch):
    """On a GPU a Triton kernel compiles once per specialization of its arguments, and an
    int argument is specialized by value class (1, a multiple of 16, other) unless marked
    ``do_not_specialize``. A drafter's steps at batch sizes 1 to 8, eager and padded to the
    graph buckets, with sessions of one to three corpora, launch each of its kernels (the
    match among them) with one specialization per constexpr config: the batch size, its
    corpus count and its draft widths never are, so a serving run whose batch changes
    compiles nothing once its block shapes have run (a compile takes 0.1-1.2 s, a step
    5-30 ms)."""
    from agspec_gpu.kernels import (batch_budget, candidate_rows, controller_commit,
                                    depth_caps, drafter_commit, node_probs,
                                    suffix_match_triton)

    tok = load_tokenizer("cl100k")
    text = tok.encode("def f(x):\n    return x + 1\n\nprint(f(2))\nfor i in range(3):\n"
                      "    print(f(i))\n" * 5)
    store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=64), device=DEV)
    store.add_workspace_file("w", "w.py", "def f(x):\n    return x + 2\n" * 4)
    # narrow drafts (blocks of at most 128 candidate entries, not 1,024): the interpreter's
    # sorts are the test's time; the count of specializations does not depend on widths
    cfg = DrafterConfig(cuda_graphs=False, max_positions=4, max_draft_depth=8, max_nodes=16)
    d = Drafter(store, cfg, max_batch=8)
    for i in range(8):
        d.open_session(f"s{i}", "w" if i % 2 else f"t{i}", prompt_ids=text[: 20 + 9 * i])
    for n in ("suffix_match", "candidate_rows", "depth_caps", "node_probs", "best_first",
              "budget_keep", "emit_nodes", "controller_commit", "drafter_commit"):
        monkeypatch.setattr(drafter_mod, n, functools.partial(getattr(drafter_mod, n),
                                                              use_triton=True))
    kernels = (suffix_match_triton._suffix_match_kernel, candidate_rows._candidate_rows_kernel,
               depth_caps._depth_caps_kernel, node_probs._node_probs_kernel,
               _best_first_kernel, batch_budget._budget_keep_kernel, _emit_nodes_kernel,
               controller_commit._controller_commit_kernel,
               drafter_commit._drafter_commit_kernel)
    batches = [1, 2, 5, 8, 3, 1, 7, 4]
    with recorded_specializations(*kernels) as seen:
        for step, b in enumerate(batches):
            if step == len(batches) // 2:  # the rest padded to the graphs' buckets
                d._graphs = d._step_graphs(use_graphs=False)
            sids = [f"s{i}" for i in range(b)]
            draft = d.propose(sids)
            truth = draft.token_ids[:, :2].clamp(min=0)
            res = teacher_forced_accept(draft, truth)
            n = res.num_accepted.to(torch.int32)
            d.observe(sids, torch.cat([truth, truth[:, :1]], 1).to(torch.int32), n + 1, n,
                      path_nodes=res.path_nodes if step % 2 else None)
    counts = {k.fn.__name__: num_compiles(k, seen[k.fn.__name__]) for k in kernels}
    # the block shapes: a handful per kernel at most (powers of two of the widths)
    assert all(1 <= c <= 4 for c in counts.values()), counts


def test_kernels_compile_for_sm90():
    s1 = dict(key_ptr="*fp32", order_ptr="*i64", ranked_ptr="*fp32", keep_ptr="*i64", C="i32",
              K="i32", N="i32", MAX_NODES="i32", BLOCK="constexpr")
    s2 = dict(order_ptr="*i64", num_ptr="*i64", w_ptr="*i32", s_ptr="*i32", rep_ptr="*i64",
              row_ptr="*i64", tok_ptr="*i32", par_ptr="*i32", src_ptr="*i8", nd_ptr="*i64",
              nrow_ptr="*i64", C="i32", K="i32", N="i32", BLOCK_N="constexpr")
    compile_all_for_sm90([(_best_first_kernel, s1, dict(BLOCK=512)),
                          (_emit_nodes_kernel, s2, dict(BLOCK_N=64)),
                          (_emit_nodes_kernel, s2, dict(BLOCK_N=MAX_BLOCK_N))])
    # the widest block the launcher takes: 16 bytes spilled at most (220 at twice that)
    compile_all_for_sm90([(_best_first_kernel, s1, dict(BLOCK=MAX_BLOCK_KEYS))],
                         max_spill_bytes=16)


def test_keys_past_the_widest_block_run_the_torch_path(monkeypatch):
    """A draft config whose candidates x depth pass ``MAX_BLOCK_KEYS`` (allowed: up to
    4096 deep) sorts through torch, not a kernel that would spill hundreds of bytes."""
    monkeypatch.setattr(draft_nodes_mod, "_best_first_kernel", NoLaunch())
    C, K = 24, 100  # 2,400 keys
    key = torch.rand(2, C * K, generator=torch.Generator().manual_seed(0))
    key[:, ::3] = -2.0
    got = best_first(key.to(DEV), C, K, 64, 64, use_triton=True)
    for a, b in zip(got, best_first_torch(key, C, K, 64, 64)):
        assert torch.equal(a.cpu(), b)


def test_edge_keys_and_counts_agree():
    """Out-of-contract inputs a helper's audit found the paths disagreeing on: node keys of
    -0.0 or just below 0 (the kernel sorts the keys' bits, where the sign bit had ranked
    them with the non-nodes; both now rank them as 0.0), and ``emit_nodes`` told to emit
    more nodes than the ``N`` columns (lanes past ``N`` had read order entry 0 and been
    taken as a parent), or more than the kept nodes (a representative of none). Empty
    batches and no columns too."""
    g = torch.Generator().manual_seed(0)
    # and keys that are not nodes but not -2 either (NaN: a 0/0 estimate; -inf, -3): both
    # paths read them as -2, tied with the other non-nodes
    for vals in ([-0.0, 0.0, 0.5], [-0.0, 0.25], [-1e-8, 0.0, 0.1],
                 [float("nan"), 0.5, 0.2], [float("-inf"), -3.0, 0.4, 0.0]):
        v = torch.tensor(vals + [-2.0])
        key = v[torch.randint(0, len(v), (2, 12), generator=g)]
        a = best_first(key, 3, 4, 12, 12, use_triton=True)
        b = best_first_torch(key, 3, 4, 12, 12)
        for name, x, y in zip(("order", "ranked", "keep"), a, b):
            assert torch.equal(x, y), (vals, name, x.tolist(), y.tolist())
        assert not (a[1] < 0).logical_and(a[1] > -1.5).any()  # nodes read as >= 0
        assert not a[1].isnan().any() and ((a[1] >= 0) | (a[1] == -2)).all()
    order = torch.tensor([[0, 1, 3]])  # (c0, d0), (c0, d1), (c1, d0)
    W = torch.tensor([[[5, 6, 7], [8, 9, 10]]], dtype=torch.int32)
    rep = torch.tensor([[[0, 0, 0], [1, 1, 1]]])
    row = torch.zeros(1, 2, dtype=torch.int64)
    for num in (3, 4):
        args = (order, torch.tensor([num]), W, W, rep, row)
        a, b = emit_nodes_torch(*args), emit_nodes(*args, use_triton=True)
        for name, x, y in zip(("tok", "par", "src", "depth", "row"), a, b):
            assert torch.equal(x, y), (num, name, x.tolist(), y.tolist())
        assert a[1].tolist() == [[-1, 0, -1]]
    # more than the kept nodes (``num`` past ``keep``): an entry that is no node has a
    # representative C (none) one level up; the torch path read that as candidate 0 one
    # level down (here entry 5 its own parent), the kernel as no parent
    W = torch.tensor([[[5, -1, -1], [6, 7, 8]]], dtype=torch.int32)
    rep = torch.tensor([[[0, 2, 2], [1, 1, 1]]])
    args = (torch.tensor([[0, 3, 4, 5, 1, 2]]), torch.tensor([6]), W, W, rep, row)
    a, b = emit_nodes_torch(*args), emit_nodes(*args, use_triton=True)
    for name, x, y in zip(("tok", "par", "src", "depth", "row"), a, b):
        assert torch.equal(x, y), (name, x.tolist(), y.tolist())
    assert a[1].tolist() == [[-1, -1, 1, 2, 0, -1]]
    for B, N in ((0, 5), (2, 0)):
        key = torch.full((B, 12), -2.0)
        got = best_first(key, 3, 4, N, 5, use_triton=True), best_first_torch(key, 3, 4, N, 5)
        assert all(torch.equal(x, y) for x, y in zip(*got))
        args = (torch.zeros(B, N, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                torch.zeros(B, 3, 4, dtype=torch.int32), torch.zeros(B, 3, 4, dtype=torch.int32),
                torch.zeros(B, 3, 4, dtype=torch.int64), torch.zeros(B, 3, dtype=torch.int64))
        got = emit_nodes(*args, use_triton=True), emit_nodes_torch(*args)
        assert all(torch.equal(x, y) for x, y in zip(*got))
