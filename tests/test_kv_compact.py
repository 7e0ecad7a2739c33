"""Committing the accepted path: kv_compact Triton == torch == a reference gather; the cache."""

import pytest
import torch

from agspec_gpu import DraftBatch
from agspec_gpu.kernels.kv_compact import _kv_compact_kernel, kv_compact
from agspec_gpu.kernels.rope_append import rope_append
from agspec_gpu.kv_cache import KVCacheFull, PagedKVCache
from agspec_gpu.tree import TreeMetadata, plan_tree
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90
from op_count import CountOps
from tree_reference import DEVICE


def make_cache(seed, B, page_size, max_len, num_layers=2, heads=2, head_dim=4,
               dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = -(-max_len // page_size)
    num_pages = B * width + 1
    data = torch.randn(num_layers, num_pages, 2, page_size, heads, head_dim, generator=g)
    pages = torch.randperm(num_pages, generator=g)[:B * width].view(B, width).to(torch.int32)
    return data.to(dtype), pages


def ragged(page_table):
    """``(kv_indptr, kv_indices)``: a padded page table in the plan's layout."""
    B, W = page_table.shape
    indptr = torch.arange(B + 1, dtype=torch.int32, device=page_table.device) * W
    return indptr, page_table.reshape(-1).contiguous()


def logical_rows(data, page_table, b, slots):
    """``[L, 2, len(slots), H, D]``: the rows of request ``b`` at logical ``slots``."""
    ps = data.shape[3]
    pages = page_table[b, [s // ps for s in slots]].long()
    return data[:, pages, :, [s % ps for s in slots]].permute(1, 2, 0, 3, 4)


# accepted node lists per request (increasing, root excluded); -1 padding is added
CASES = [
    ([[]], [0], 1),
    ([[0, 1, 2]], [3], 4),  # a chain prefix: nothing moves
    ([[1, 2]], [0], 1),  # move i=1 writes the slot move i=0 reads from
    ([[2, 5, 6], [], [0, 3]], [5, 0, 7], 3),
    ([[4], [1, 3, 4, 8], [0], [7, 9, 10, 11]], [15, 16, 1, 31], 16),
]


@pytest.mark.parametrize("accepted,prefix_lens,page_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_torch_and_reference(accepted, prefix_lens, page_size, dtype):
    B = len(accepted)
    A = max(len(a) for a in accepted) or 1
    max_len = max(prefix_lens) + 1 + 13
    data, page_table = make_cache(B * page_size, B, page_size, max_len, dtype=dtype)
    acc = torch.tensor([a + [-1] * (A - len(a)) for a in accepted], dtype=torch.int32)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)

    expected = data.clone()
    for b, nodes in enumerate(accepted):
        if nodes:
            src = logical_rows(data, page_table, b, [prefix_lens[b] + 1 + n for n in nodes])
            ps = page_size
            dst = [prefix_lens[b] + 1 + i for i in range(len(nodes))]
            pages = page_table[b, [s // ps for s in dst]].long()
            expected[:, pages, :, [s % ps for s in dst]] = src.permute(2, 0, 1, 3, 4)

    got_torch, got_triton = data.clone(), data.clone().to(DEVICE)
    kv_compact(got_torch, *ragged(page_table), prefix, acc, use_triton=False)
    kv_compact(got_triton, *ragged(page_table.to(DEVICE)), prefix.to(DEVICE), acc.to(DEVICE),
               use_triton=True)
    got_triton = got_triton.cpu()
    assert torch.equal(got_triton, got_torch), (got_triton != got_torch).nonzero()[:5]
    assert torch.equal(got_torch, expected), (got_torch != expected).nonzero()[:5]
    for b, nodes in enumerate(accepted):  # the committed sequence, read back logically
        n = prefix_lens[b] + 1 + len(nodes)
        want = logical_rows(data, page_table, b, list(range(prefix_lens[b] + 1)) +
                            [prefix_lens[b] + 1 + x for x in nodes])
        assert torch.equal(logical_rows(got_triton, page_table, b, list(range(n))), want)


def test_rejects_bad_inputs():
    data, page_table = make_cache(0, 1, 4, 8)
    acc = torch.tensor([[0]], dtype=torch.int32)
    prefix = torch.tensor([1], dtype=torch.int32)
    indptr, indices = ragged(page_table)
    with pytest.raises(ValueError, match="kv_data"):
        kv_compact(data[0], indptr, indices, prefix, acc)
    with pytest.raises(ValueError, match="accepted_nodes"):
        kv_compact(data, indptr, indices, prefix, acc.long())
    with pytest.raises(ValueError, match="kv_indptr"):
        kv_compact(data, indptr[:1], indices, prefix, acc)
    with pytest.raises(ValueError, match="kv_indices"):
        kv_compact(data, indptr, page_table, prefix, acc)
    with pytest.raises(ValueError, match="prefix_lens"):
        kv_compact(data, indptr, indices, prefix.repeat(2), acc)
    with pytest.raises(ValueError, match="kv_data: must be contiguous"):
        kv_compact(data.transpose(0, 1), indptr, indices, prefix, acc)  # still 6-D, [.., 2, ..]
    args = dict(kv_indptr=indptr, kv_indices=indices, prefix_lens=prefix, accepted_nodes=acc)
    for name in args:
        for use_triton in (True, False):
            with pytest.raises(ValueError, match=f"^{name}: expected device cpu, got meta"):
                kv_compact(data, **{**args, name: args[name].to("meta")},
                           use_triton=use_triton)


def test_commits_of_any_batch_share_the_compiled_kernel():
    """The batch's page count and accepted width change every step and are not
    specialized: one compile per cache layout."""
    data, pages = make_cache(0, 16, 4, 32)  # one cache, 16 x 8 pages
    data = data.to(DEVICE)

    def launch(B, A, width):
        acc = torch.full((B, A), -1, dtype=torch.int32)
        acc[:, 0] = 0
        args = (*ragged(pages[:B, :width]), torch.zeros(B, dtype=torch.int32), acc)
        return lambda: kv_compact(data, *(t.to(DEVICE) for t in args), use_triton=True)

    assert assert_one_compile_per_config(_kv_compact_kernel, [
        launch(B, A, w) for B, A, w in ((1, 1, 1), (2, 3, 5), (16, 16, 1), (4, 5, 8))]) == 1


def test_kernel_compiles_for_sm90():
    sig = {"kv_ptr": "*bf16", "kv_indptr_ptr": "*i32", "kv_indices_ptr": "*i32",
           "prefix_lens_ptr": "*i32", "accepted_ptr": "*i32", "stride_layer": "i64",
           "stride_page": "i64", "num_indices": "i32",
           "num_cache_pages": "i32", "A": "i32", "page_size": "i32", "ROW": "i32",
           "BLOCK_COLS": "constexpr"}
    # the launcher takes any cache dtype: the model's (bf16, fp16) and fp32
    compile_all_for_sm90([(_kv_compact_kernel, {**sig, "kv_ptr": ptr}, {"BLOCK_COLS": 1024})
                          for ptr in ("*bf16", "*fp16", "*fp32")])


def test_canonical_device_keeps_cpu_and_indexed_devices():
    from agspec_gpu.host import canonical_device

    assert canonical_device("cpu") == torch.device("cpu")
    assert canonical_device(torch.device("cuda", 1)) == torch.device("cuda", 1)  # no CUDA call


def test_cache_allocator_lifecycle():
    cache = PagedKVCache(1, num_pages=6, page_size=4, num_kv_heads=1, head_dim=2,
                         dtype=torch.float32, device="cpu", max_seqs=2, max_pages_per_seq=4)
    assert cache.layer(0).shape == (7, 2, 4, 1, 2)  # + the null page
    cache.allocate("a", 5)
    cache.allocate("b", 1)
    cache.allocate("a", 8)  # already enough
    assert cache.capacity("a") == 8 and cache.num_free_pages == 3
    table = cache.page_table(["b", "a"])
    assert table.shape == (2, 4) and table.dtype == torch.int32
    assert table[1, :2].tolist() == [0, 1] and table[0, 0].item() == 2
    assert table[0, 1:].eq(cache.null_page).all()
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        cache.allocate("a", 17)
    with pytest.raises(KVCacheFull, match="rows"):
        cache.allocate("c", 1)
    cache.free("b")
    cache.allocate("c", 16)  # its row and page are reusable
    assert cache.num_free_pages == 0
    assert cache.pages_needed("a", 12) == 1 and cache.pages_needed("a", 8) == 0
    assert cache.pages_needed("new", 9) == 3
    with pytest.raises(KVCacheFull, match="0 free"):
        cache.allocate("a", 12)
    assert cache.capacity("a") == 8  # a failed allocation changes nothing
    with pytest.raises(ValueError, match="unknown"):
        cache.free("b")
    with pytest.raises(ValueError, match="unknown"):
        cache.page_table(["b"])


def test_allocate_many_is_one_scatter_and_all_or_nothing():
    """A step's allocations at once: the same page tables as one ``allocate`` per sequence
    (new and growing sequences, some needing nothing), written with one copy and one
    scatter; a step that does not fit (pages or rows), a sequence given twice or counts
    that do not match raise before any sequence changes."""
    def cache():
        return PagedKVCache(1, num_pages=12, page_size=4, num_kv_heads=1, head_dim=2,
                            dtype=torch.float32, device="cpu", max_seqs=4,
                            max_pages_per_seq=6)
    one, many = cache(), cache()
    steps = [(["a", "b"], [5, 1]), (["b", "c", "a"], [9, 4, 8]), (["c", "a"], [4, 0]),
             (["a", "b", "c"], [13, 17, 6])]
    for seq_ids, counts in steps:
        free = one.num_free_pages
        for sid, n in zip(seq_ids, counts):
            one.allocate(sid, n)
        count = CountOps()
        with count.mode:  # the ring's views and numpy writes launch nothing
            many.allocate_many(seq_ids, counts)
        assert count.ops == (["index_copy_"] if one.num_free_pages < free else [])
        ids = sorted(one._rows)
        assert torch.equal(one.page_table(ids), many.page_table(ids))
        assert one.num_free_pages == many.num_free_pages
    assert many.num_free_pages == 1
    table = many.page_table(["a", "b", "c"])
    for exc, match, seq_ids, counts in (
            (KVCacheFull, r"allocate_many\(2 sequences\): 3 pages needed, 1 free",
             ["a", "c"], [17, 13]),
            (ValueError, r"allocate\('d', 25\): 7 pages exceed max_pages_per_seq=6",
             ["a", "d"], [16, 25]),
            (ValueError, "seq_ids: each sequence at most once", ["a", "a"], [16, 17]),
            (ValueError, "num_tokens: 1 counts for 2 seq_ids", ["a", "b"], [16])):
        with pytest.raises(exc, match=match):
            many.allocate_many(seq_ids, counts)
        assert torch.equal(many.page_table(["a", "b", "c"]), table)
        assert many.num_free_pages == 1 and "d" not in many


def test_step_kv_goes_to_node_order_slots():
    """A step's KV (written by the runner's ``rope_append`` at ``slots_of``) lands at each
    tree row's logical slot ``prefix_len + r``, whatever its depth; padding rows on the
    null page only."""
    cache = PagedKVCache(2, num_pages=8, page_size=3, num_kv_heads=2, head_dim=4,
                         dtype=torch.float32, device="cpu")
    cache.allocate("s", 9)
    draft = DraftBatch.from_lists([[(7, -1), (8, -1), (9, 1)]])  # depths 1, 1, 2
    meta = plan_tree(draft, torch.tensor([5], dtype=torch.int32),
                     torch.tensor([4], dtype=torch.int32), cache.page_table(["s"]), 3,
                     max_total_q=6)
    k = torch.arange(6 * 8, dtype=torch.float32).view(6, 2, 4)
    qkv = torch.cat([torch.zeros(6, 4), k.view(6, 8), -k.view(6, 8)], 1)  # 1 query head
    ones, zeros = torch.ones(6, 4), torch.zeros(6, 4)  # the identity rotation
    rope_append(qkv, ones, zeros, *cache.slots_of(meta), cache.layer(1), 1, 2)
    table = cache.page_table(["s"])[0]
    for r in range(4):  # tree row r at logical slot 4 + r, whatever its depth
        slot = 4 + r
        assert torch.equal(cache.layer(1)[table[slot // 3], 0, slot % 3], k[r])
        assert torch.equal(cache.layer(1)[table[slot // 3], 1, slot % 3], -k[r])
    assert meta.position_ids[:4].tolist() == [4, 5, 5, 6]
    # rows 4, 5 are padding: written to the null page only
    assert torch.equal(cache.layer(1)[cache.null_page, 0, 0], k[5]) or \
        torch.equal(cache.layer(1)[cache.null_page, 0, 0], k[4])
    assert cache.layer(0).eq(0).all()


def test_compact_moves_nothing_for_empty_batches():
    data, page_table = make_cache(0, 1, 4, 8)
    before = data.clone()
    kv_compact(data, *ragged(page_table), torch.tensor([0], dtype=torch.int32),
               torch.zeros(1, 0, dtype=torch.int32))
    assert torch.equal(data, before)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_compact_within_a_plans_pages_equals_the_page_table(use_triton, sink):
    """The commit reads the verification plan's ragged pages (``meta.kv_indptr`` /
    ``kv_indices``: each request only the pages its step covers, a padded plan's sink after
    them): the same moves as over each request's full page table."""
    ps = 3
    cache = PagedKVCache(2, num_pages=40, page_size=ps, num_kv_heads=2, head_dim=4,
                         dtype=torch.float32, device=DEVICE, max_pages_per_seq=12)
    prefix = [0, 7, 2, 13]
    trees = [[(1, -1), (2, 0), (3, 1)], [(4, -1), (5, -1), (6, 1), (7, 2), (8, 3)], [],
             [(9, -1), (9, 0), (9, 1), (9, 0), (9, 3), (9, 4), (9, 5)]]
    accepted = [[0, 1, 2], [1, 3, 4], [], [3, 4, 5, 6]]
    ids = [f"s{b}" for b in range(4)]
    for sid, p, t in zip(ids, prefix, trees):
        cache.allocate(sid, p + 1 + len(t) + 5)  # more pages than the step covers
    g = torch.Generator().manual_seed(3)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    draft = DraftBatch.from_lists(trees, device=DEVICE)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    table = cache.page_table(ids)
    meta = plan_tree(draft, i32([5] * 4), i32(prefix), table, ps, max_total_q=32,
                     sink_page=cache.null_page if sink else None,
                     out=TreeMetadata.empty(5, 8, 12, ps, DEVICE, max_total_q=32) if sink
                     else None)
    assert meta.kv_indptr[1:5].tolist() != (torch.arange(1, 5) * 12).tolist()
    acc = i32([a + [-1] * (4 - len(a)) for a in accepted])
    want, got = cache.data.clone(), cache.data.clone()
    kv_compact(want, *ragged(table), i32(prefix), acc, use_triton=False)
    kv_compact(got, meta.kv_indptr, meta.kv_indices, i32(prefix), acc, use_triton=use_triton)
    assert not torch.equal(want, cache.data)
    assert torch.equal(got, want)


@pytest.mark.parametrize("use_triton", [False, True])
def test_compact_skips_moves_from_pages_the_request_does_not_have(use_triton):
    """An inconsistent ``kv_indptr`` (a source slot past the request's pages, or past
    ``kv_indices``) moves nothing for that node: no read of another request's pages."""
    data, page_table = make_cache(1, 2, 4, 16)
    data = data.to(DEVICE)
    indptr, indices = ragged(page_table.to(DEVICE))
    acc = torch.tensor([[5], [5]], dtype=torch.int32, device=DEVICE)  # slot 7: page 1
    prefix = torch.tensor([1, 1], dtype=torch.int32, device=DEVICE)
    short = torch.tensor([0, 4, 5], dtype=torch.int32, device=DEVICE)  # request 1: one page
    got = data.clone()
    kv_compact(got, short, indices, prefix, acc, use_triton=use_triton)
    want = data.clone()
    kv_compact(want, indptr, indices, prefix, acc, use_triton=False)  # both requests whole
    p0, p1 = page_table[0, 0].item(), page_table[1, 0].item()
    assert torch.equal(got[:, p0], want[:, p0]) and not torch.equal(got[:, p0], data[:, p0])
    assert torch.equal(got, data.index_copy(1, torch.tensor([p0], device=DEVICE),
                                            want[:, [p0]]))  # request 1: skipped
    past = torch.tensor([0, 4, 100], dtype=torch.int32, device=DEVICE)
    got = data.clone()
    kv_compact(got, past, indices[:5], prefix, acc, use_triton=use_triton)
    assert torch.equal(got[:, p0], want[:, p0])
    assert torch.equal(got[:, p1], data[:, p1])       # request 1's pages past kv_indices


@pytest.mark.parametrize("H,D,dtype", [(3, 5, torch.float32), (9, 128, torch.bfloat16),
                                       (2, 1024, torch.float16), (1, 1, torch.bfloat16)])
def test_rows_of_any_width_and_dtype(H, D, dtype):
    """Kernel equals torch path for KV rows that are not a power of two, wider than one
    column block (``H * D`` > 1024) or a single element, in each dtype."""
    g = torch.Generator().manual_seed(H * D)
    L, ps, B, width = 2, 4, 3, 6
    data = torch.randn(L, B * width + 1, 2, ps, H, D, generator=g).to(dtype).to(DEVICE)
    table = torch.randperm(B * width + 1, generator=g)[:B * width].int().to(DEVICE)
    indptr = (torch.arange(B + 1, dtype=torch.int32) * width).to(DEVICE)
    acc = torch.tensor([[1, 3, 4, -1], [0, 2, -1, -1], [5, 6, 9, 12]], dtype=torch.int32,
                       device=DEVICE)
    prefix = torch.tensor([2, 7, 4], dtype=torch.int32, device=DEVICE)
    a, b = data.clone(), data.clone()
    kv_compact(a, indptr, table, prefix, acc, use_triton=False)
    kv_compact(b, indptr, table, prefix, acc, use_triton=True)
    assert not torch.equal(a, data) and torch.equal(a, b)


def test_moves_outside_the_cache_are_skipped_on_both_paths():
    """Page ids outside ``[0, num_pages)`` or a negative prefix (a caller's error): the kernel
    once wrote outside the cache (the torch path raised or wrapped); both paths skip those
    moves and make the others."""
    data, pages = make_cache(4, 3, 4, 16)
    indptr, indices = ragged(pages)
    indices = indices.clone()
    indices[4] = data.shape[1]  # request 1's first page: past the cache
    indices[9] = -1  # request 2's second page
    prefix = torch.tensor([2, 1, -3], dtype=torch.int32)
    accepted = torch.tensor([[1, 3], [2, -1], [4, 6]], dtype=torch.int32)
    outs = []
    for use_triton in (False, True):
        d = data.clone().to(DEVICE)
        kv_compact(d, indptr.to(DEVICE), indices.to(DEVICE), prefix.to(DEVICE),
                   accepted.to(DEVICE), use_triton=use_triton)
        outs.append(d.cpu())
    assert torch.equal(outs[0], outs[1])
    changed = (outs[0] != data).flatten(2).any(-1).any(0).nonzero()[:, 0].tolist()
    assert set(changed) <= set(pages[0].tolist()) and changed  # request 0's moves only
