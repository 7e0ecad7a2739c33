"""Tree planning: Triton == torch exactly, both == a per-request reference, golden bytes."""

from dataclasses import fields

import numpy as np
import pytest
import torch

from agspec_gpu import DraftBatch
from agspec_gpu.kernels.tree_mask import _tree_mask_kernel, _tree_rows_kernel, tree_mask
from agspec_gpu.tree import TreeMetadata, host_sizes, plan_tree, unpack_mask
from kernel_compile import (compile_all_for_sm90, num_compiles,
                            recorded_specializations)
from tree_reference import DEVICE, dense_mask, make_case, on_device, reference_plan

FIELDS = ("input_ids", "position_ids", "kv_slots", "qo_indptr", "kv_indptr", "kv_indices",
          "kv_last_page_len", "packed_mask", "mask_indptr", "ancestor_bits")

# (sizes = num_draft_tokens per request, tree kind, prefix lengths, page size)
CASES = [
    ([0], "random", [0], 1),
    ([0], "random", [0], 16),
    ([5], "chain", [0], 1),
    ([3, 0], "random", [0, 5], 3),
    ([4, 4, 4], "wide", [2, 3, 4], 3),
    ([0, 7, 2, 9], "random", [15, 16, 17, 0], 16),
    ([6, 1, 0, 3, 8], "random", [1, 0, 2, 5, 3], 1),
    ([40, 33], "chain", [3, 29], 16),  # more than 32 rows: two-word ancestor bitsets
    ([37, 0, 12], "random", [47, 48, 0], 16),
    # long contexts: most of a row's bytes are context only (the torch path computes only
    # the bytes holding tree columns), rows that start mid-byte, three-word bitsets
    ([11, 0, 64], "random", [301, 1000, 77], 16),
    ([2, 1, 5], "wide", [7, 9, 1001], 8),
    # a batch wider than a block of the prefix sums' smaller sizes, separators of empty trees
    ([(7 * i) % 11 if i % 4 else 0 for i in range(37)], "random",
     [(13 * i) % 29 for i in range(37)], 4),
]


def first_mismatch(name, got, want):
    diff = (got != want).nonzero()
    idx = diff[0].tolist() if len(diff) else None
    return f"{name}: first mismatch at {idx}: got {got[tuple(idx)] if idx else None}, " \
           f"want {want[tuple(idx)] if idx else None}"


@pytest.mark.parametrize("sizes,kind,prefix_lens,page_size", CASES)
def test_triton_matches_torch_and_reference(sizes, kind, prefix_lens, page_size):
    trees, roots, draft, root_t, prefix_t, pages, page_table = make_case(
        len(sizes) * 7 + page_size, sizes, kind, prefix_lens, page_size)
    got_torch = plan_tree(draft, root_t, prefix_t, page_table, page_size, use_triton=False,
                          with_dense_mask=True)
    got_triton = plan_tree(*on_device(draft, root_t, prefix_t, page_table), page_size,
                           use_triton=True)
    for name in FIELDS:
        a, b = getattr(got_triton, name).cpu(), getattr(got_torch, name)
        assert torch.equal(a, b), first_mismatch(name, a, b)

    ref = reference_plan(trees, roots, prefix_lens, pages, page_size)
    total_q, nnz, nbytes = ref["qo_indptr"][-1], ref["kv_indptr"][-1], ref["mask_indptr"][-1]
    m = got_torch
    for name in ("qo_indptr", "kv_indptr", "mask_indptr", "kv_last_page_len"):
        assert getattr(m, name).tolist() == ref[name], name
    host = host_sizes(sizes, prefix_lens, page_size)  # what FlashInfer plans with
    assert host.num_mask_bytes == nbytes
    for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
        assert getattr(host, name).dtype == torch.int32
        assert getattr(host, name).tolist() == ref[name], name
    assert m.input_ids[:total_q].tolist() == ref["input_ids"]
    assert m.position_ids[:total_q].tolist() == ref["position_ids"]
    assert m.kv_slots[:total_q].tolist() == ref["kv_slots"]
    assert m.kv_indices[:nnz].tolist() == ref["kv_indices"]
    assert m.packed_mask[:nbytes].tolist() == ref["packed_mask"]
    # padding past the valid extents
    assert m.input_ids[total_q:].eq(0).all() and m.kv_slots[total_q:].eq(-1).all()
    assert m.packed_mask[nbytes:].eq(0).all()
    # the debug dense mask holds each row's columns 0 .. kv_len - 1
    for b, tree in enumerate(trees):
        want = dense_mask(tree, prefix_lens[b])
        rows = m.maybe_tree_mask[ref["qo_indptr"][b]:ref["qo_indptr"][b + 1]]
        assert np.array_equal(rows[:, :want.shape[1]].numpy(), want)
        assert not rows[:, want.shape[1]:].any()


def test_golden_tiny():
    # request 0: prefix 2, root 5, nodes 7 (root child), 8 (child of 7), 9 (root child)
    # request 1: prefix 0, root 6, no draft
    draft = DraftBatch.from_lists([[(7, -1), (8, 0), (9, -1)], []])
    page_table = torch.tensor([[3, 1, 4], [2, 0, 0]], dtype=torch.int32)
    expected_mask_0 = np.array([[1, 1, 1, 0, 0, 0],  # root
                                [1, 1, 1, 1, 0, 0],  # 7
                                [1, 1, 1, 1, 1, 0],  # 8 -> 7 -> root
                                [1, 1, 1, 0, 0, 1]],  # 9
                               dtype=bool)
    # bits 111000 111100 111110 111001, little-endian: 0b11000111, 0b11110011, 0b10011101
    expected_bytes = [199, 243, 157, 1]
    assert np.packbits(expected_mask_0.reshape(-1), bitorder="little").tolist() == \
        expected_bytes[:3]
    for use_triton in (False, True):
        device = DEVICE if use_triton else "cpu"
        m = plan_tree(*on_device(draft, torch.tensor([5, 6], dtype=torch.int32),
                                 torch.tensor([2, 0], dtype=torch.int32), page_table,
                                 device=device), page_size=2, use_triton=use_triton)
        m = TreeMetadata(**{f.name: getattr(m, f.name).cpu() if torch.is_tensor(
            getattr(m, f.name)) else getattr(m, f.name) for f in fields(m)})
        assert m.qo_indptr.tolist() == [0, 4, 5]
        assert m.kv_indptr.tolist() == [0, 3, 4]
        assert m.kv_indices[:4].tolist() == [3, 1, 4, 2]
        assert m.kv_last_page_len.tolist() == [2, 1]
        assert m.mask_indptr.tolist() == [0, 3, 4]
        assert m.input_ids[:5].tolist() == [5, 7, 8, 9, 6]
        assert m.position_ids[:5].tolist() == [2, 3, 4, 3, 0]
        # logical slots 2, 3 -> page 1; 4, 5 -> page 4; request 1 slot 0 -> page 2
        assert m.kv_slots[:5].tolist() == [2, 3, 8, 9, 4]
        assert m.packed_mask[:4].tolist() == expected_bytes
        assert m.ancestor_bits[0, :4, 0].tolist() == [0b1, 0b11, 0b111, 0b1001]
        dense = unpack_mask(m)
        assert np.array_equal(dense[0, :4, :6].numpy(), expected_mask_0)
        assert dense[1, 0].tolist() == [True] + [False] * (dense.shape[2] - 1)


@pytest.mark.parametrize("use_triton", [False, True])
def test_preallocated_buffers_are_reused(use_triton):
    device = DEVICE if use_triton else torch.device("cpu")
    out = TreeMetadata.empty(max_batch_size=4, max_qo_len=9, max_pages_per_seq=6, page_size=3,
                             device=device)
    _, _, draft, roots, prefix, _, page_table = make_case(3, [5, 2], "random", [4, 8], 3)
    page_table = torch.cat([page_table, torch.zeros(2, 6 - page_table.shape[1],
                                                    dtype=torch.int32)], dim=1)
    fresh = plan_tree(draft, roots, prefix, page_table, 3)
    inputs = on_device(draft, roots, prefix, page_table, device=device)
    for _ in range(2):  # the second plan overwrites the first in the same storage
        reused = plan_tree(*inputs, 3, out=out, use_triton=use_triton)
    assert reused.packed_mask.data_ptr() == out.packed_mask.data_ptr()
    assert reused.qo_indptr.data_ptr() == out.qo_indptr.data_ptr()
    n, nnz, nbytes = (int(fresh.qo_indptr[-1]), int(fresh.kv_indptr[-1]),
                      int(fresh.mask_indptr[-1]))
    for name, k in (("input_ids", n), ("position_ids", n), ("kv_slots", n),
                    ("kv_indices", nnz), ("packed_mask", nbytes)):
        assert torch.equal(getattr(reused, name)[:k].cpu(), getattr(fresh, name)[:k]), name
    for name in ("qo_indptr", "kv_indptr", "mask_indptr", "kv_last_page_len", "ancestor_bits"):
        assert torch.equal(getattr(reused, name).cpu(), getattr(fresh, name)), name


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("sizes,prefix_lens", [([0], [0]), ([3], [11]), ([5, 0], [2, 9])])
def test_replanning_dirty_buffers_rewrites_every_padding_entry(use_triton, sizes, prefix_lens):
    """The kernels write the tails themselves (no fills around them): a small plan into the
    buffers of a larger one equals the same plan into clean buffers, entry for entry."""
    device = DEVICE if use_triton else torch.device("cpu")

    def empty():
        return TreeMetadata.empty(max_batch_size=4, max_qo_len=9, max_pages_per_seq=8,
                                  page_size=3, device=device)

    def pad(table):
        return torch.cat([table, torch.full((table.shape[0], 8 - table.shape[1]), 7,
                                            dtype=torch.int32)], dim=1)

    _, _, draft, roots, prefix, _, table = make_case(5, [8, 8, 7, 8], "random",
                                                     [10, 7, 9, 8], 3)
    dirty = empty()
    plan_tree(*on_device(draft, roots, prefix, pad(table), device=device), 3, out=dirty,
              use_triton=use_triton)
    _, _, draft, roots, prefix, _, table = make_case(6, sizes, "random", prefix_lens, 3)
    inputs = on_device(draft, roots, prefix, pad(table), device=device)
    got = plan_tree(*inputs, 3, out=dirty, use_triton=use_triton)
    want = plan_tree(*inputs, 3, out=empty(), use_triton=use_triton)
    for name in FIELDS:
        a, b = getattr(got, name).cpu(), getattr(want, name).cpu()
        assert torch.equal(a, b), first_mismatch(name, a, b)
    for name in ("input_ids", "position_ids", "kv_slots", "kv_indices", "packed_mask"):
        assert torch.equal(getattr(dirty, name).cpu(), getattr(want, name).cpu()), name


@pytest.mark.parametrize("sizes,prefix_lens", [([0], [0]), ([4, 0, 7], [9, 0, 3]),
                                                ([(5 * i) % 9 for i in range(21)],
                                                 [(11 * i) % 23 for i in range(21)])])
def test_sink_takes_the_rows_left_over(sizes, prefix_lens):
    """``sink_page``: request ``B`` over the rows past the batch's (a CUDA graph's fixed row
    count), one KV entry on the sink page that every one of its rows sees; Triton == torch,
    into clean and into dirty buffers."""
    B, ps, null = len(sizes), 4, 3
    _, _, draft, roots, prefix, _, table = make_case(7, sizes, "random", prefix_lens, ps)
    pages = table.shape[1]

    def empty(device):
        return TreeMetadata.empty(B + 1, draft.max_nodes + 1, pages, ps, device,
                                  max_total_q=sum(sizes) + B + 13,
                                  max_total_pages=B * pages + 5,
                                  max_mask_bytes=(sum(sizes) + B + 13) * pages * ps // 8 + B + 2)

    got = {}
    for use_triton in (False, True):
        device = DEVICE if use_triton else torch.device("cpu")
        dirty = empty(device)
        dirty.packed_mask.fill_(7)
        dirty.kv_indices.fill_(9)
        dirty.input_ids.fill_(5)
        dirty.kv_slots.fill_(5)
        inputs = on_device(draft, roots, prefix, table, device=device)
        for out in (empty(device), dirty):
            m = plan_tree(*inputs, ps, out=out, sink_page=null, use_triton=use_triton)
            got.setdefault(use_triton, []).append(
                {name: getattr(m, name).cpu().clone() for name in FIELDS})
    want = got[False][0]
    for run in got[False][1:] + got[True]:
        for name in FIELDS:
            if name == "ancestor_bits":  # the sink has no tree: its bits are unspecified
                assert torch.equal(run[name][:B], want[name][:B]), name
            else:
                assert torch.equal(run[name], want[name]), first_mismatch(name, run[name],
                                                                          want[name])
    plain = plan_tree(draft, roots, prefix, table, ps, use_triton=False)
    total_q, total_pages = int(plain.qo_indptr[-1]), int(plain.kv_indptr[-1])
    total_bytes, Q = int(plain.mask_indptr[-1]), sum(sizes) + B + 13
    assert want["qo_indptr"].tolist() == plain.qo_indptr.tolist() + [Q]
    assert want["kv_indptr"].tolist() == plain.kv_indptr.tolist() + [total_pages + 1]
    sink_bytes = -(-(Q - total_q) // 8)
    assert want["mask_indptr"].tolist() == plain.mask_indptr.tolist() + [
        total_bytes + sink_bytes]
    assert want["kv_last_page_len"].tolist() == plain.kv_last_page_len.tolist() + [1]
    host = host_sizes(sizes, prefix_lens, ps, sink_rows=Q - total_q)
    for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
        assert getattr(host, name).tolist() == want[name].tolist(), name
    assert want["kv_indices"][total_pages] == null
    assert want["kv_indices"][total_pages + 1:].eq(0).all()
    mask = want["packed_mask"]
    assert mask[total_bytes:total_bytes + sink_bytes].eq(255).all()
    assert mask[total_bytes + sink_bytes:].eq(0).all()
    assert want["kv_slots"][total_q:].eq(-1).all() and want["input_ids"][total_q:].eq(0).all()


class _GridRecorder:
    """Stands in for a Triton kernel: records each launch's grid, then launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("max_programs", [1, 3, 4096])
@pytest.mark.parametrize("sizes,prefix_lens", [([6], [21]), ([3, 0, 8, 1], [40, 0, 17, 3]),
                                                ([(3 * i) % 7 for i in range(33)],
                                                 [(7 * i) % 19 for i in range(33)])])
def test_mask_grid_follows_the_buffer_not_the_tables_width(monkeypatch, max_programs, sizes,
                                                           prefix_lens):
    """A page table as wide as a KV pool (a decoder's verify graphs: 2,048 pages here) and
    buffers bounded by the pool (``padded_step_capacity``): the mask kernel launches one
    program a block of the buffer (at most ``MAX_MASK_PROGRAMS``, each looping over the
    blocks left: 1 and 3 make them loop), not a block of a full-width row per request (56
    to 231 times as many here); Triton == torch, the sink's bytes and the tail included."""
    import agspec_gpu.kernels.tree_mask as tm
    from agspec_gpu.kernels._launch import cdiv
    from agspec_gpu.tree import padded_step_capacity

    B, ps, width, null = len(sizes), 4, 2048, 0
    _, _, draft, roots, prefix, _, table = make_case(9, sizes, "random", prefix_lens, ps)
    pool = int(table.max()) + 1
    wide = torch.full((B, width), null, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    R, Q = draft.max_nodes + 1, sum(sizes) + B + 11
    pages, mask_bytes = padded_step_capacity(B, R, Q, width, ps, pool, sink=True)
    rec = _GridRecorder(tm._tree_mask_kernel)
    monkeypatch.setattr(tm, "_tree_mask_kernel", rec)
    monkeypatch.setattr(tm, "MAX_MASK_PROGRAMS", max_programs)
    got = []
    for use_triton in (False, True):
        device = DEVICE if use_triton else torch.device("cpu")
        out = TreeMetadata.empty(B + 1, R, width, ps, device, max_total_q=Q,
                                 max_total_pages=pages, max_mask_bytes=mask_bytes)
        out.packed_mask.fill_(7)  # dirty: every byte is rewritten
        m = plan_tree(*on_device(draft, roots, prefix, wide, device=device), ps, out=out,
                      sink_page=null, use_triton=use_triton)
        got.append({name: getattr(m, name).cpu() for name in FIELDS if name != "ancestor_bits"})
    for name, want in got[0].items():
        assert torch.equal(got[1][name], want), first_mismatch(name, got[1][name], want)
    plain = plan_tree(draft, roots, prefix, table, ps, use_triton=False)
    nbytes = int(plain.mask_indptr[-1])
    assert torch.equal(got[1]["packed_mask"][:nbytes], plain.packed_mask[:nbytes])
    assert rec.grids == [(min(-(-mask_bytes // tm.BLOCK_BYTES), max_programs),)]
    # the grid before: a program a block of a full-width row, per request
    assert B * cdiv(cdiv(R * width * ps, 8), tm.BLOCK_BYTES) > 40 * rec.grids[0][0]


def test_rejects_bad_inputs():
    _, _, draft, roots, prefix, _, page_table = make_case(1, [2], "chain", [0], 4)
    with pytest.raises(ValueError, match="page_table"):
        plan_tree(draft, roots, prefix, page_table[0], 4)
    with pytest.raises(ValueError, match="root_ids"):
        plan_tree(draft, roots[:0], prefix, page_table, 4)
    for page_size in (0, 4.0, True, -4):  # named before it sizes a buffer or reaches a kernel
        for use_triton in (True, False):
            with pytest.raises(ValueError, match="page_size: expected an int"):
                plan_tree(draft, roots, prefix, page_table, page_size, use_triton=use_triton)
            with pytest.raises(ValueError, match="page_size: expected an int"):
                tree_mask(draft.token_ids, draft.parents, draft.num_draft_tokens, roots, prefix,
                          page_table, page_size, use_triton=use_triton)
    small = TreeMetadata.empty(1, 2, 4, 4, "cpu")
    with pytest.raises(ValueError, match="out"):
        plan_tree(draft, roots, prefix, page_table, 4, out=small)
    pages, mask = torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shared: 4 pages and 3 mask bytes"):
        TreeMetadata.empty(1, 2, 4, 4, "cpu", shared=(pages, mask))  # 4 pages, 4 bytes
    with pytest.raises(ValueError, match="packed_mask: expected uint8"):
        TreeMetadata.empty(1, 2, 4, 4, "cpu", shared=(pages, mask.new_zeros(4).int()))
    on_shared = TreeMetadata.empty(1, 2, 4, 4, "cpu", shared=(pages, mask[:0].new_zeros(9)))
    assert on_shared.packed_mask.numel() == 4 and on_shared.kv_indices.numel() == 4
    with pytest.raises(ValueError, match="maybe_host"):  # sizes of another batch
        plan_tree(draft, roots, prefix, page_table, 4, host=host_sizes([2, 0], [0, 0], 4))
    assert plan_tree(draft, roots, prefix, page_table, 4,
                     host=host_sizes([2], [0], 4)).maybe_host.qo_indptr.tolist() == [0, 3]
    for bad in (([1, 2], [0]), ([-1], [0]), ([1], [-3])):
        with pytest.raises(ValueError, match="num_draft, prefix_lens"):
            host_sizes(*bad, 4)
    # a step whose packed mask passes int32 offsets (FlashInfer's mask_indptr): 513 rows
    # over 2**25 cached tokens, 2.15e9 bytes
    with pytest.raises(ValueError, match="num_draft, prefix_lens: the step's packed mask"):
        host_sizes([512], [1 << 25], 16)
    assert host_sizes([511], [(1 << 25) - 600], 16).num_mask_bytes < 1 << 31


def test_a_plan_without_buffers_holds_the_steps_own_sizes():
    """Given the host's sizes, ``plan_tree`` without ``out`` allocates the step's own pages
    and mask bytes, not the page table's width times the batch (a prefill chunk of one long
    context among short ones held 0.5 GB of zeroed mask at batch 64), and plans the same."""
    sizes, prefix_lens, ps = [3, 0, 5], [40, 2, 9], 4
    _, _, draft, roots, prefix, _, table = make_case(3, sizes, "random", prefix_lens, ps)
    wide = torch.cat([table, table.new_zeros(3, 30)], 1)  # a table wider than the step
    host = host_sizes(sizes, prefix_lens, ps)
    exact = plan_tree(draft, roots, prefix, wide, ps, host=host)
    static = plan_tree(draft, roots, prefix, wide, ps)
    assert exact.packed_mask.numel() == host.num_mask_bytes == int(static.mask_indptr[-1])
    assert exact.kv_indices.numel() == int(host.kv_indptr[-1]) < static.kv_indices.numel()
    assert static.packed_mask.numel() > 4 * host.num_mask_bytes
    for name in FIELDS:
        a, b = getattr(exact, name), getattr(static, name)
        n = min(a.numel(), b.numel())
        assert torch.equal(a.flatten()[:n], b.flatten()[:n]), name


def test_plans_of_any_batch_share_the_compiled_kernels():
    """Batch size, draft width, prefix lengths, row and page totals change every step and
    are not specialized: plans compile once per block config (powers of two of the batch,
    its width, rows and pages), however their sizes fall between the blocks' bounds."""
    kernels = (_tree_rows_kernel, _tree_mask_kernel)
    with recorded_specializations(*kernels) as seen:
        for seed, (sizes, prefix) in enumerate([
                ([3], [17]), ([4], [32]), ([15], [0]), ([14], [0]), ([16], [32]), ([1], [0]),
                ([5, 0, 2], [40, 1, 16]), ([6, 4, 1, 0], [47, 1, 15, 32]),
                ([4, 4, 4, 16], [64, 15, 3, 200]), ([9] * 9, list(range(0, 90, 10))),
                ([2] * 16, [16 * i for i in range(16)]), ([16, 1], [100, 255])]):
            _, _, draft, roots, prefix_lens, _, page_table = make_case(
                seed, sizes, "random", prefix, 16)
            B, pages, rows = len(sizes), page_table.shape[1], sum(sizes) + len(sizes) + 9
            inputs = on_device(draft, roots, prefix_lens, page_table)
            plan_tree(*inputs, 16, use_triton=True)
            out = TreeMetadata.empty(B + 1, draft.max_nodes + 1, pages, 16, DEVICE,
                                     max_total_q=rows, max_total_pages=B * pages + 1,
                                     max_mask_bytes=rows * pages * 16 // 8 + B + 2)
            plan_tree(*inputs, 16, out=out, sink_page=0, use_triton=True)  # a graph's plan
    assert all(num_compiles(k, seen[k.fn.__name__]) >= 1 for k in kernels)


def test_kernels_compile_for_sm90():
    i32 = "*i32"
    rows_sig = {name: i32 for name in (
        "token_ids_ptr", "parents_ptr", "num_draft_ptr", "root_ids_ptr", "prefix_lens_ptr",
        "page_table_ptr", "qo_indptr_ptr", "kv_indptr_ptr", "mask_indptr_ptr",
        "last_page_len_ptr", "input_ids_ptr", "position_ids_ptr", "kv_slots_ptr",
        "kv_indices_ptr", "ancestors_ptr")}
    rows_sig.update({name: "i32" for name in ("B", "N", "max_pages", "R", "W", "Q", "P",
                                                "page_size", "sink_page")})
    rows_sig.update(BLOCK_B="constexpr", BLOCK_W="constexpr", BLOCK_R="constexpr",
                    BLOCK_P="constexpr", HAS_SINK="constexpr")
    mask_sig = {"prefix_lens_ptr": i32, "qo_indptr_ptr": i32, "mask_indptr_ptr": i32,
                "ancestors_ptr": i32, "packed_mask_ptr": "*u8", "B": "i32", "R": "i32",
                "W": "i32", "M": "i32", "BLOCK_BYTES": "constexpr", "HAS_SINK": "constexpr"}
    blocks = {"BLOCK_B": 64, "BLOCK_W": 4, "BLOCK_R": 128, "BLOCK_P": 128}
    compile_all_for_sm90([
        (_tree_rows_kernel, rows_sig, dict(blocks, HAS_SINK=False)),
        (_tree_rows_kernel, rows_sig, dict(blocks, HAS_SINK=True)),
        (_tree_mask_kernel, mask_sig, {"BLOCK_BYTES": 128, "HAS_SINK": False}),
        (_tree_mask_kernel, mask_sig, {"BLOCK_BYTES": 128, "HAS_SINK": True}),
    ])


@pytest.mark.parametrize("use_triton", [False, True])
def test_the_launcher_alone_allocates_checks_and_plans_what_plan_tree_plans(use_triton):
    """``tree_mask`` (the kernels' one-call launcher: checks, allocates its buffers, launches)
    fills what ``plan_tree`` returns for the same step, and names a bad input or buffer."""
    from agspec_gpu.kernels.tree_mask import TreeMaskBuffers

    device = DEVICE if use_triton else torch.device("cpu")
    _, _, draft, roots, prefix, _, table = make_case(7, [5, 0, 3], "random", [4, 9, 0], 3)
    draft, roots, prefix, table = on_device(draft, roots, prefix, table, device=device)
    args = (draft.token_ids, draft.parents, draft.num_draft_tokens, roots, prefix, table, 3)
    got = tree_mask(*args, use_triton=use_triton)
    want = plan_tree(draft, roots, prefix, table, 3, use_triton=use_triton)
    n, nnz, nbytes = (int(want.qo_indptr[-1]), int(want.kv_indptr[-1]),
                      int(want.mask_indptr[-1]))
    for name, k in (("input_ids", n), ("position_ids", n), ("kv_slots", n),
                    ("kv_indices", nnz), ("packed_mask", nbytes)):
        assert torch.equal(getattr(got, name)[:k], getattr(want, name)[:k]), name
    for name in ("qo_indptr", "kv_indptr", "mask_indptr", "kv_last_page_len", "ancestor_bits"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(ValueError, match="parents"):
        tree_mask(args[0], args[1][:, :-1].contiguous(), *args[2:])
    with pytest.raises(ValueError, match="prefix_lens"):
        tree_mask(*args[:4], args[4].long(), *args[5:])
    small = TreeMaskBuffers(*(x[:1] if name == "qo_indptr" else x
                              for name, x in zip(TreeMaskBuffers._fields, got)))
    with pytest.raises(ValueError, match="out.qo_indptr"):
        tree_mask(*args, out=small)
    if device.type == "cpu":  # a tensor on another device: named
        names = ("parents", "num_draft_tokens", "root_ids", "prefix_lens", "page_table")
        for i, name in enumerate(names, 1):
            bad = args[:i] + (args[i].to("meta"),) + args[i + 1:]
            with pytest.raises(ValueError, match=f"^{name}: expected device cpu, got meta"):
                tree_mask(*bad, use_triton=use_triton)
        for name in ("qo_indptr", "kv_indices", "packed_mask", "ancestor_bits"):
            on_meta = got._replace(**{name: getattr(got, name).to("meta")})
            with pytest.raises(ValueError, match=f"^out.{name}: expected device cpu, got meta"):
                tree_mask(*args, out=on_meta, use_triton=use_triton)


@pytest.mark.parametrize("B,N,sink_page,qo_indptr", [
    (0, 3, None, [0]), (0, 3, 0, [0, 0]), (2, 0, None, [0, 1, 2]), (2, 0, 0, [0, 1, 2, 2])])
def test_an_empty_batch_or_drafts_without_node_columns(B, N, sink_page, qo_indptr):
    """B = 0 (with and without a sink, which then has no rows) and N = 0 (roots alone):
    both paths plan the same, every field."""
    i32 = dict(dtype=torch.int32)
    args = (torch.zeros(B, N, **i32), torch.full((B, N), -1, **i32), torch.zeros(B, **i32),
            torch.arange(B, **i32) + 5, torch.tensor([3, 0][:B], **i32),
            torch.arange(2 * B, **i32).view(B, 2))
    want = tree_mask(*args, 4, sink_page=sink_page, use_triton=False)
    got = tree_mask(*(t.to(DEVICE) for t in args), 4, sink_page=sink_page, use_triton=True)
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert want.qo_indptr.tolist() == qo_indptr
    if B:  # the roots at their prefix positions
        assert want.input_ids.tolist() == [5, 6] and want.position_ids.tolist() == [3, 0]


@pytest.mark.parametrize("sizes,prefix_lens,page_size,max_q,max_mask_bytes", [
    ([6, 3], [21, 40], 4, 20, 37), ([11, 0, 9], [300, 5, 77], 16, 20, 500),
    ([2, 7], [9, 13], 8, 4, 5)])
def test_capacities_smaller_than_the_step_drop_the_same_tail(sizes, prefix_lens, page_size,
                                                             max_q, max_mask_bytes):
    """Buffers too small for the step (``host_sizes(out=)`` is the check that raises): both
    paths write what fits and drop the rest alike, rows and mask bytes."""
    _, _, draft, roots, prefix, _, table = make_case(3, sizes, "random", prefix_lens,
                                                     page_size)
    R, got = draft.max_nodes + 1, []
    for use_triton in (False, True):
        device = DEVICE if use_triton else torch.device("cpu")
        out = TreeMetadata.empty(len(sizes), R, table.shape[1], page_size, device,
                                 max_total_q=max_q, max_mask_bytes=max_mask_bytes)
        out.packed_mask.fill_(7)
        m = plan_tree(*on_device(draft, roots, prefix, table, device=device), page_size,
                      out=out, use_triton=use_triton)
        got.append({name: getattr(m, name).cpu() for name in FIELDS})
    assert int(got[0]["mask_indptr"][-1]) > max_mask_bytes or \
        int(got[0]["qo_indptr"][-1]) > max_q
    for name, want in got[0].items():
        assert torch.equal(got[1][name], want), first_mismatch(name, got[1][name], want)


@pytest.mark.parametrize("sizes,kind,prefix,ps", [
    ([150, 3], "chain", [5, 700], 4),  # 151 rows (the row block loops), 5-word bitsets
    ([140], "random", [600], 2),  # 301+ pages
    ([130, 0, 129], "wide", [0, 515, 1], 1),
])
def test_plans_past_one_block_of_rows_and_pages(sizes, kind, prefix, ps):
    """Trees of more than 128 nodes and prefixes of more than 128 pages: kernel equals torch
    path and the reference plan."""
    trees, roots, draft, root_t, prefix_t, pages, table = make_case(1, sizes, kind, prefix, ps)
    a = plan_tree(draft, root_t, prefix_t, table, ps, use_triton=False)
    b = plan_tree(draft, root_t, prefix_t, table, ps, use_triton=True)
    for f in ("input_ids", "position_ids", "kv_slots", "qo_indptr", "kv_indptr",
              "kv_indices", "kv_last_page_len", "packed_mask", "mask_indptr",
              "ancestor_bits"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    ref = reference_plan(trees, roots, prefix, pages, ps)
    assert a.packed_mask[:ref["mask_indptr"][-1]].tolist() == ref["packed_mask"]
    assert a.kv_indices[:ref["kv_indptr"][-1]].tolist() == ref["kv_indices"]
    assert a.position_ids[:ref["qo_indptr"][-1]].tolist() == ref["position_ids"]


def test_the_launcher_allocates_a_sinks_entries_and_checks_its_page():
    """``tree_mask(..., sink_page=p)`` without ``out`` allocates the sink's indptr entries,
    page and mask bytes (it once allocated a sinkless batch's and refused its own buffers),
    and plans what the torch path plans; a sink page that is no page index is named."""
    _, _, draft, roots, prefix, _, table = make_case(2, [3, 1], "random", [4, 0], 4)
    args = (draft.token_ids, draft.parents, draft.num_draft_tokens, roots, prefix, table, 4)
    want = tree_mask(*args, sink_page=0, use_triton=False)
    assert want.qo_indptr.tolist() == [0, 4, 6, 8]  # Q = 2 * (3 + 1) rows: the sink takes 2
    assert want.kv_last_page_len.numel() == 3 and want.kv_indices[int(want.kv_indptr[2])] == 0
    d, r, p, t = on_device(draft, roots, prefix, table)
    got = tree_mask(d.token_ids, d.parents, d.num_draft_tokens, r, p, t, 4, sink_page=0,
                    use_triton=True)
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sink_page"):
            tree_mask(*args, sink_page=bad)
        with pytest.raises(ValueError, match="sink_page"):
            plan_tree(draft, roots, prefix, table, 4, sink_page=bad)


def test_rows_past_a_short_page_table_are_padding_on_both_paths():
    """A page table that does not cover a request's rows breaks ``tree_mask``'s contract;
    both paths then plan those rows as padding (token 0, position 0, slot -1) alike (the
    Triton path once wrote their tree positions)."""


    _, _, draft, roots, prefix, _, table = make_case(2, [6, 3], "chain", [5, 2], 4)
    short = table[:, :2].contiguous()  # 8 slots; request 0 needs 12
    want = tree_mask(draft.token_ids, draft.parents, draft.num_draft_tokens, roots, prefix,
                     short, 4, use_triton=False)
    d, r, p, t = on_device(draft, roots, prefix, short)
    got = tree_mask(d.token_ids, d.parents, d.num_draft_tokens, r, p, t, 4, use_triton=True)
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert want.position_ids[:7].tolist() == [5, 6, 7, 0, 0, 0, 0]
    assert want.kv_slots[3:7].tolist() == [-1] * 4


def test_a_negative_prefix_counts_as_zero_on_both_paths():
    """A negative ``prefix_lens`` entry (never read on the host) plans as a prefix of 0 on
    both paths: the kernel read the page table before its row and wrote negative
    positions; the torch path raised IndexError."""
    _, _, draft, roots, prefix, _, table = make_case(2, [4, 2], "random", [0, 3], 4)
    zero = tree_mask(draft.token_ids, draft.parents, draft.num_draft_tokens, roots, prefix,
                     table, 4, use_triton=False)
    neg = prefix.clone()
    neg[0] = -5
    for use_triton in (False, True):
        d, r, p, t = on_device(draft, roots, neg, table)
        got = tree_mask(d.token_ids, d.parents, d.num_draft_tokens, r, p, t, 4,
                        use_triton=use_triton)
        for name in FIELDS:
            assert torch.equal(getattr(got, name).cpu(), getattr(zero, name)), (use_triton,
                                                                                name)


def test_the_debug_mask_holds_every_sink_row():
    """``with_dense_mask``: a sink of more rows than ``max_qo_len`` has each of them see its
    one KV entry (the unpacked mask once stopped at ``max_qo_len`` rows)."""
    _, _, draft, roots, prefix, _, table = make_case(4, [2], "random", [3], 4)
    out = TreeMetadata.empty(2, 3, table.shape[1], 4, "cpu", max_total_q=13)
    meta = plan_tree(draft, roots, prefix, table, 4, out=out, sink_page=1, with_dense_mask=True)
    assert meta.qo_indptr.tolist() == [0, 3, 13]
    assert meta.maybe_tree_mask[3:, 0].all() and not meta.maybe_tree_mask[3:, 1:].any()
