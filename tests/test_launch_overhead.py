"""A launch's host time: the launchers' block arithmetic equals Triton's without its cost,
and a planner reusing its buffers gets the same plans from its cached views of them.

(``bench/bench_launch_overhead.py`` times the launches; these tests hold what it relies on.)
"""

from pathlib import Path

import pytest
import torch
import triton

from agspec_gpu.kernels._launch import cast, cdiv, next_pow2
from agspec_gpu.tree import TreeMetadata, host_sizes, plan_tree
from tree_reference import DEVICE, make_case, on_device

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
FIELDS = ("input_ids", "position_ids", "kv_slots", "qo_indptr", "kv_indptr", "kv_indices",
          "kv_last_page_len", "packed_mask", "mask_indptr", "ancestor_bits")


def test_block_arithmetic_equals_tritons():
    for n in list(range(0, 5000)) + [2**20 - 1, 2**20, 2**20 + 1, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_cast_is_to_without_the_no_op_call():
    x = torch.arange(6, dtype=torch.int32)
    assert cast(x, torch.int32) is x and cast(x, torch.int32, x.device) is x
    for dtype in (torch.int64, torch.int8, torch.float32):
        y = cast(x, dtype)
        assert y.dtype == dtype and torch.equal(y, x.to(dtype))
    assert cast(x[::2], torch.int64).tolist() == [0, 2, 4]


def test_launchers_do_not_call_tritons_constexpr_helpers():
    """``triton.next_power_of_2`` / ``triton.cdiv`` cost 3-6 us per host call in Triton 3.x
    (its JIT wrapper): a launcher runs every step, so none calls them."""
    offenders = [f"{p.name}:{i}" for p in sorted(KERNELS.glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "triton.next_power_of_2(" in line or "triton.cdiv(" in line]
    assert not offenders, offenders


@pytest.mark.parametrize("use_triton", [False, True])
def test_plans_of_changing_shapes_into_one_pool_equal_fresh_plans(use_triton):
    """One pool planned for batches of 3, 1, 3 requests, with and without a sink and host
    sizes, in turn (each shape's views made once, then reused): every plan equals the same
    plan into fresh buffers, and the result of a shape is the same views every time."""
    device = DEVICE if use_triton else torch.device("cpu")
    pool = TreeMetadata.empty(max_batch_size=5, max_qo_len=9, max_pages_per_seq=12,
                              page_size=3, device=device)

    def pad(table):
        return torch.cat([table, torch.full((table.shape[0], 12 - table.shape[1]), 7,
                                            dtype=torch.int32)], dim=1)

    cases = [(11, [8, 2, 5], [10, 7, 0], None), (12, [4], [3], None),
             (13, [0, 8, 1], [5, 0, 9], 0), (14, [8, 2, 5], [1, 2, 3], None),
             (15, [3], [20], 0), (16, [6, 6, 6], [0, 0, 0], 0)]
    seen = {}
    for seed, sizes, prefix_lens, sink in cases:
        _, _, draft, roots, prefix, _, table = make_case(seed, sizes, "random", prefix_lens, 3)
        inputs = on_device(draft, roots, prefix, pad(table), device=device)
        host = host_sizes(sizes, prefix_lens, 3) if sink is None else None
        got = plan_tree(*inputs, 3, out=pool, sink_page=sink, host=host, use_triton=use_triton)
        fresh = TreeMetadata.empty(max_batch_size=5, max_qo_len=9, max_pages_per_seq=12,
                                   page_size=3, device=device)
        want = plan_tree(*inputs, 3, out=fresh, sink_page=sink, host=host,
                         use_triton=use_triton)
        for name in FIELDS:  # (the sink's ancestor bits are not planned: any values)
            a, b = getattr(got, name).cpu(), getattr(want, name).cpu()
            if name == "ancestor_bits":
                a, b = a[:len(sizes)], b[:len(sizes)]
            assert torch.equal(a, b), (seed, name)
        assert (got.max_qo_len, got.max_kv_len) == (want.max_qo_len, want.max_kv_len)
        if host is not None:
            assert got.maybe_host is host
        key = (len(sizes), sink, draft.max_nodes)
        if key in seen:  # the same shape: the same views of the pool
            assert got.qo_indptr.data_ptr() == seen[key].qo_indptr.data_ptr()
            assert got.ancestor_bits.shape == seen[key].ancestor_bits.shape
        seen[key] = got
    with pytest.raises(ValueError, match="maybe_host"):  # host sizes of another batch
        plan_tree(*inputs, 3, out=pool, host=host_sizes([1], [0], 3), use_triton=use_triton)


def test_step_kernels_fed_staging_ring_views_compile_once_per_config():
    """An e2e replay step stages its drafts, roots, prefix lengths and true tokens through a
    :class:`HostWriter` ring and hands the kernels views of it, which start anywhere (and
    sub-views of them): Triton specializes pointers on 16-byte alignment, so every kernel
    of the step leaves its ring-fed pointers unspecialized (else a run compiles the kernel
    again, 0.1-1.2 s, whenever a view's alignment changes)."""
    from agspec_gpu.accept import teacher_forced_accept, tree_qo_indptr
    from agspec_gpu.draft_batch import DraftBatch
    from agspec_gpu.host import HostWriter
    from agspec_gpu.kernels.kv_compact import _kv_compact_kernel, kv_compact
    from agspec_gpu.kernels.tree_accept import _tree_accept_kernel, greedy_tree_accept
    from agspec_gpu.kernels.tree_mask import _tree_mask_kernel, _tree_rows_kernel
    from kernel_compile import num_compiles, recorded_specializations

    writer = HostWriter(1 << 12, DEVICE)
    kernels = (_tree_accept_kernel, _kv_compact_kernel, _tree_rows_kernel, _tree_mask_kernel)
    kv = torch.zeros(2, 40, 2, 4, 2, 8, device=DEVICE)
    with recorded_specializations(*kernels) as seen:
        for step in range(12):
            B, N = 3, 4
            skew = [0] * (step % 5)  # lists of other lengths before: views start anywhere
            tok = [(7 * step + j) % 5 for j in range(B * N)]
            par = [j % N - 1 for j in range(B * N)]
            num = [N, step % (N + 1), 2]
            prefix = [3 + step, 9, 1]
            # one list, cut into the step's arrays at element offsets (as the drafter's
            # descriptors are): the views' alignment changes from step to step
            lists = [skew, tok, par, num, prefix, [t % 5 for t in range(B * N)]]
            (flat,) = writer.write(([x for xs in lists for x in xs], torch.int32))
            cuts = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).tolist()
            _, tok_t, par_t, num_t, prefix_t, truth = (flat[a:b] for a, b in zip(cuts, cuts[1:]))
            draft = DraftBatch(tok_t.view(B, N), par_t.view(B, N), num_t)
            paths = teacher_forced_accept(draft, truth.view(B, N))
            qo = tree_qo_indptr(draft)
            greedy_tree_accept(draft.token_ids, draft.parents, draft.num_draft_tokens,
                               torch.zeros(int(qo[-1]), dtype=torch.int64, device=DEVICE),
                               max_depth=N, row_start=qo[:-1], use_triton=True)
            table = torch.arange(B * 10, dtype=torch.int32, device=DEVICE).view(B, 10)
            meta = plan_tree(draft, num_t, prefix_t, table, 4, use_triton=True)
            kv_compact(kv, meta.kv_indptr, meta.kv_indices, prefix_t,
                       paths.path_nodes.to(torch.int32)[:, :2].contiguous(), use_triton=True)
    for kernel in kernels:
        specs = seen[kernel.fn.__name__]
        assert num_compiles(kernel, specs) == len({c for c, _ in specs}), kernel.fn.__name__


def test_a_pool_keeps_the_views_of_a_bounded_number_of_step_shapes(monkeypatch):
    """Page tables widen as contexts grow: a pool planned at ever new widths keeps the
    views of at most ``_MAX_PLAN_SHAPES`` shapes, and plans right after starting over."""
    import agspec_gpu.tree as tree_mod

    monkeypatch.setattr(tree_mod, "_MAX_PLAN_SHAPES", 3)
    pool = TreeMetadata.empty(max_batch_size=2, max_qo_len=5, max_pages_per_seq=12,
                              page_size=3, device="cpu")
    _, _, draft, roots, prefix, _, table = make_case(3, [4, 1], "random", [2, 5], 3)
    for width in range(table.shape[1], 12):
        wide = torch.cat([table, torch.full((2, width - table.shape[1]), 7,
                                            dtype=torch.int32)], dim=1)
        got = plan_tree(draft, roots, prefix, wide, 3, out=pool)
        fresh = TreeMetadata.empty(max_batch_size=2, max_qo_len=5, max_pages_per_seq=12,
                                   page_size=3, device="cpu")
        want = plan_tree(draft, roots, prefix, wide, 3, out=fresh)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (width, name)
        assert len(pool._plans) <= 3
