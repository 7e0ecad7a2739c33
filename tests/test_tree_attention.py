"""Split tree attention: the prefix pages' plan and the tree kernel (Triton == torch), and
the split's attention equal to the custom mask's, on ragged trees, padded graph-style plans
with a sink, empty prefixes and adversarial scores."""

import math

import numpy as np
import pytest
import torch

from agspec_gpu.attention import TorchPagedAttention
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.kernels.prefix_pages import PrefixPages, _prefix_pages_kernel, prefix_pages
from agspec_gpu.kernels.tree_attention import _tree_attention_kernel, tree_attention
from agspec_gpu.tree import TreeMetadata, host_sizes, plan_tree
from kernel_compile import (assert_one_compile_per_config, compile_all_for_sm90,
                            compile_for_sm90)
from tree_reference import DEVICE, make_case

# (sizes, tree kind, prefix lengths, page size): chains, bushy trees, empty drafts, empty
# prefixes, prefixes ending on and off a page boundary, one row
CASES = [
    ([0], "random", [0], 1),
    ([0], "chain", [7], 4),
    ([6], "chain", [5], 4),
    ([3, 0, 9], "random", [17, 0, 4], 3),
    ([4, 7], "wide", [16, 1], 16),
    ([35, 2], "random", [2, 9], 5),
    ([1, 1, 1, 1], "chain", [0, 4, 8, 3], 4),
]


def prefix_buffers(nb, P, fill=-7):
    def i32(n):
        return torch.full((n,), fill, dtype=torch.int32, device=DEVICE)
    return PrefixPages(i32(nb + 1), i32(P), i32(nb), i32(nb))


def host_prefix_pages(prefix_lens, page_table, page_size, sink_page):
    """Per request its pages up to the prefix (its first page without one), a sink's one."""
    pages, last, lens = [], [], []
    for b, p in enumerate(prefix_lens):
        n = max(1, -(-p // page_size))
        pages.append(list(page_table[b, :n]))
        last.append(p - (n - 1) * page_size if p else 1)
        lens.append(p)
    if sink_page is not None:
        pages.append([sink_page])
        last.append(1)
        lens.append(1)
    return [0] + np.cumsum([len(p) for p in pages]).tolist(), sum(pages, []), last, lens


@pytest.mark.parametrize("prefix_lens,page_size", [
    ([], 4), ([0], 1), ([5], 4), ([4, 0, 9, 1], 4), ([33, 16, 15, 17], 16), ([2] * 9, 1)])
@pytest.mark.parametrize("sink_page", [None, 3])
@pytest.mark.parametrize("use_triton", [False, True])
def test_prefix_pages_match_the_host_reference(prefix_lens, page_size, sink_page, use_triton):
    rng = np.random.default_rng(len(prefix_lens))
    B = len(prefix_lens)
    width = max([-(-(p + 1) // page_size) for p in prefix_lens] + [1]) + 1
    table = rng.permutation(max(B, 1) * width + 5)[:B * width].reshape(B, width).astype(np.int32)
    out = prefix_buffers(B + 1, B * width + 2)
    prefix_pages(torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE),
                 torch.from_numpy(table).to(DEVICE), page_size, out, sink_page=sink_page,
                 use_triton=use_triton)
    indptr, pages, last, lens = host_prefix_pages(prefix_lens, table, page_size, sink_page)
    nb = len(last)
    assert out.kv_indptr[:nb + 1].tolist() == indptr
    assert out.kv_indices[:indptr[-1]].tolist() == pages
    assert out.kv_last_page_len[:nb].tolist() == last
    assert out.prefix_lens[:nb].tolist() == lens
    if B:  # FlashInfer plans from the host's copy of the same sizes
        host = host_sizes([0] * B, prefix_lens, page_size,
                          sink_rows=None if sink_page is None else 2)
        assert host.prefix_kv_indptr.tolist() == indptr
        assert host.prefix_kv_last_page_len.tolist() == last


def test_prefix_pages_drop_what_exceeds_the_buffer_and_check_their_arguments():
    table = torch.arange(8, dtype=torch.int32, device=DEVICE).view(2, 4)
    lens = torch.tensor([16, 16], dtype=torch.int32, device=DEVICE)  # 4 pages each
    for use_triton in (False, True):
        out = prefix_buffers(2, 5)
        prefix_pages(lens, table, 4, out, use_triton=use_triton)
        assert out.kv_indices.tolist() == [0, 1, 2, 3, 4]  # request 1's last 3 dropped
        assert out.kv_indptr.tolist() == [0, 4, 8]
    with pytest.raises(ValueError, match="prefix_lens"):
        prefix_pages(lens.long(), table, 4, prefix_buffers(2, 8))
    with pytest.raises(ValueError, match="prefix_lens"):
        prefix_pages(lens[:1], table, 4, prefix_buffers(2, 8))
    with pytest.raises(ValueError, match="out"):
        prefix_pages(lens, table, 4, prefix_buffers(1, 8), sink_page=0)
    for bad in (-1, 2.5, True, 2**31):  # (planned as pages, or an obscure error, before)
        for use_triton in (True, False):
            with pytest.raises(ValueError, match="^sink_page: expected an int"):
                prefix_pages(lens, table, 4, prefix_buffers(3, 8), sink_page=bad,
                             use_triton=use_triton)
    for bad in (4.0, True, 0):
        with pytest.raises(ValueError, match="page_size"):
            prefix_pages(lens, table, bad, prefix_buffers(2, 8))
    with pytest.raises(ValueError, match="^page_table: expected dtype torch.int32"):
        prefix_pages(lens, table.long(), 4, prefix_buffers(2, 8))
    with pytest.raises(ValueError, match="every request needs a page"):
        prefix_pages(lens, table[:, :0], 4, prefix_buffers(2, 8))
    with pytest.raises(ValueError, match="^page_table: expected device .*, got meta"):
        prefix_pages(lens, table.to("meta"), 4, prefix_buffers(2, 8))
    on_meta = prefix_buffers(2, 8)._replace(kv_indices=torch.zeros(8, dtype=torch.int32,
                                                                   device="meta"))
    with pytest.raises(ValueError, match="^out.kv_indices: expected device .*, got meta"):
        prefix_pages(lens, table, 4, on_meta)


def test_a_prefix_past_its_page_table_writes_no_made_up_pages():
    """Outside the contract (the table covers the prefix): the pages the table lacks are
    left as they were on both paths (the kernel once wrote page 0, a real page), however
    long the prefix."""
    table = torch.arange(6, dtype=torch.int32, device=DEVICE).view(2, 3) + 10
    lens = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    outs = []
    for use_triton in (False, True):
        out = prefix_buffers(2, 12)
        prefix_pages(lens, table, 4, out, use_triton=use_triton)
        outs.append(out.kv_indices.tolist())
    assert outs[0] == outs[1] == [10, 11, 12] + [-7] * 7 + [13, -7]
    # a prefix near 2**31: sizes in int64 on both paths (the kernel's int32 sum wrapped
    # to a negative count), and its loop stops at the table (2**27 pages here)
    lens = torch.tensor([2 ** 31 - 1, 3], dtype=torch.int32, device=DEVICE)
    got = []
    for use_triton in (False, True):
        out = prefix_buffers(2, 12)
        prefix_pages(lens, table, 16, out, use_triton=use_triton)
        got.append([x.tolist() for x in (out.kv_indptr, out.kv_indices,
                                         out.kv_last_page_len, out.prefix_lens)])
    assert got[0] == got[1]
    assert got[0][0][:3] == [0, 2 ** 27, 2 ** 27 + 1] and got[0][2] == [15, 3]


def split_and_custom(case, num_qo_heads, num_kv_heads, *, head_dim=8, scale=1.0, seed=0,
                     dtype=torch.float32, extra_rows=9):
    """``(meta, q, cache, custom)``: a split plan of ``case``, random q and cache, and the
    custom mask's attention (the reference)."""
    sizes, kind, prefix_lens, page_size = case
    _, _, draft, roots, prefix, _, page_table = make_case(seed, sizes, kind, prefix_lens,
                                                          page_size)
    meta = plan_tree(draft, roots, prefix, page_table, page_size,
                     max_total_q=sum(sizes) + len(sizes) + extra_rows, prefix_pages=True)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(int(page_table.max()) + 1, 2, page_size, num_kv_heads, head_dim,
                        generator=g)
    q = torch.randn(meta.capacity_q, num_qo_heads, head_dim, generator=g) * scale
    custom = TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size)
    custom.plan(plan_tree(draft, roots, prefix, page_table, page_size,
                          max_total_q=meta.capacity_q))
    want = custom.run(q, cache)
    return meta, q.to(dtype), cache.to(dtype), want


@pytest.mark.parametrize("num_qo_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1), (3, 1)])
@pytest.mark.parametrize("case", CASES)
def test_split_attention_equals_the_custom_mask(case, num_qo_heads, num_kv_heads):
    meta, q, cache, want = split_and_custom(case, num_qo_heads, num_kv_heads)
    split = TorchPagedAttention(num_qo_heads, num_kv_heads, 8, case[3], split=True)
    split.plan(meta)
    got = split.run(q, cache)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert got[int(meta.qo_indptr[-1]):].eq(0).all()  # padding rows


def prefix_part(meta, q, cache, page_size):
    """The split's prefix part in torch: ``(o_prefix, lse base 2)``."""
    H, D = q.shape[1:]
    part = TorchPagedAttention(H, cache.shape[3], D, page_size, split=True)
    part.plan(meta)
    # the reference's own prefix part: run it through the split with no tree rows
    scores_meta = meta
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf)
    p = scores_meta.maybe_prefix
    qo = meta.qo_indptr.tolist()
    G = H // cache.shape[3]
    for b in range(meta.batch_size):
        pages = p.kv_indices[p.kv_indptr[b]:p.kv_indptr[b + 1]].long()
        n = (len(pages) - 1) * page_size + int(p.kv_last_page_len[b])
        slots = torch.arange(n)
        k = cache[pages[slots // page_size], 0, slots % page_size].float().repeat_interleave(G, 1)
        v = cache[pages[slots // page_size], 1, slots % page_size].float().repeat_interleave(G, 1)
        s = torch.einsum("rhd,khd->hrk", q[qo[b]:qo[b + 1]].float(), k) / math.sqrt(D)
        lse[qo[b]:qo[b + 1]] = (torch.logsumexp(s, -1) / math.log(2)).T
        o[qo[b]:qo[b + 1]] = torch.einsum("hrk,khd->rhd", torch.softmax(s, -1), v).to(q.dtype)
    return o, lse


@pytest.mark.parametrize("num_qo_heads,num_kv_heads", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_kernel_triton_matches_torch(case, num_qo_heads, num_kv_heads, dtype):
    meta, q, cache, want = split_and_custom(case, num_qo_heads, num_kv_heads, dtype=dtype,
                                            head_dim=16)
    o_prefix, lse = prefix_part(meta, q, cache, case[3])
    p = meta.maybe_prefix
    outs = []
    for use_triton in (False, True):
        args = [t.to(DEVICE) for t in (q, cache, meta.kv_slots, meta.qo_indptr,
                                        meta.ancestor_bits, p.prefix_lens, o_prefix, lse)]
        outs.append(tree_attention(*args, num_tree=meta.batch_size, sm_scale=16 ** -0.5,
                                   use_triton=use_triton).cpu())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(outs[0].float(), want.float(), **(
        tol if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)))


@pytest.mark.parametrize("use_triton", [False, True])
def test_large_scores_and_repeated_keys_stay_finite_and_exact(use_triton):
    """Scores of hundreds (a softmax without its running max would overflow) and a cache
    whose every key is the same (ties everywhere): still the custom mask's attention."""
    case = ([5, 3, 0], "random", [9, 0, 31], 4)
    meta, q, cache, want = split_and_custom(case, 4, 2, scale=60.0, seed=3)
    cache[:, 0] = cache[0, 0, 0]  # one key everywhere
    custom = TorchPagedAttention(4, 2, 8, 4)
    _, _, draft, roots, prefix, _, table = make_case(3, *case)
    custom.plan(plan_tree(draft, roots, prefix, table, 4, max_total_q=meta.capacity_q))
    want = custom.run(q, cache)
    o_prefix, lse = prefix_part(meta, q, cache, 4)
    p = meta.maybe_prefix
    args = [t.to(DEVICE) for t in (q, cache, meta.kv_slots, meta.qo_indptr, meta.ancestor_bits,
                                    p.prefix_lens, o_prefix, lse)]
    got = tree_attention(*args, num_tree=3, sm_scale=8 ** -0.5, use_triton=use_triton).cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_padded_plan_with_a_sink_as_the_graphs_plan_it(use_triton):
    """VerifyGraphs' plan: S requests (two padding ones of prefix 0 on the null page), the
    sink over the rows left (its prefix part alone), padded draft width: the real requests'
    rows equal the unpadded custom attention's."""
    real = ([4, 2], "random", [6, 13], 4)
    _, _, draft, roots, prefix, _, table = make_case(8, *real)
    null = int(table.max()) + 1
    S, N, Q = 4, 6, 4 + 6 + 5
    tok = torch.zeros(S, N, dtype=torch.int32)
    par = torch.zeros(S, N, dtype=torch.int32)
    tok[:2, :draft.token_ids.shape[1]] = draft.token_ids
    par[:2, :draft.parents.shape[1]] = draft.parents
    num = torch.tensor(draft.num_draft_tokens.tolist() + [0, 0], dtype=torch.int32)
    ptable = torch.full((S, table.shape[1]), null, dtype=torch.int32)
    ptable[:2] = table
    out = TreeMetadata.empty(S + 1, N + 1, table.shape[1], 4, "cpu", max_total_q=Q,
                             with_prefix=True)
    meta = plan_tree(DraftBatch(tok, par, num), torch.cat([roots, roots]),
                     torch.cat([prefix, torch.zeros(2, dtype=torch.int32)]), ptable, 4,
                     out=out, sink_page=null, prefix_pages=True, use_triton=use_triton)
    assert meta.has_sink and meta.batch_size == S + 1
    assert meta.maybe_prefix.prefix_lens.tolist() == [6, 13, 0, 0, 1]
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(null + 1, 2, 4, 2, 8, generator=g)
    q = torch.randn(Q, 4, 8, generator=g)
    split = TorchPagedAttention(4, 2, 8, 4, split=True)
    split.plan(meta)
    got = split.run(q, cache)
    ref = TorchPagedAttention(4, 2, 8, 4)
    n = 2 + int(draft.num_draft_tokens.sum())
    ref.plan(plan_tree(draft, roots, prefix, table, 4, max_total_q=n))
    want = ref.run(q[:n].contiguous(), cache)
    torch.testing.assert_close(got[:n], want, atol=2e-6, rtol=1e-5)
    assert torch.isfinite(got).all()  # padding requests and the sink: junk, not NaN


def test_tree_kernel_checks_its_arguments():
    case = ([3], "random", [5], 4)
    meta, q, cache, _ = split_and_custom(case, 4, 2)
    o, lse = prefix_part(meta, q, cache, 4)
    p = meta.maybe_prefix
    args = dict(q=q, kv_cache=cache, kv_slots=meta.kv_slots, qo_indptr=meta.qo_indptr,
                ancestor_bits=meta.ancestor_bits, prefix_lens=p.prefix_lens, o_prefix=o,
                lse_prefix=lse)
    for name, bad in (("q", q.double()), ("kv_cache", cache.half()),
                      ("kv_slots", meta.kv_slots.long()), ("lse_prefix", lse[:-1]),
                      ("o_prefix", o[:, :2]), ("prefix_lens", p.prefix_lens[:0]),
                      ("kv_cache", cache[:, :, :, :0]), ("kv_cache", cache[:, :, :0]),
                      ("kv_cache", cache.transpose(0, 2).contiguous().transpose(0, 2))):
        with pytest.raises(ValueError, match=name):
            tree_attention(**{**args, name: bad}, num_tree=1, sm_scale=0.3)
    for bad in (2, 0.5, True):  # (a float or bool: torch raised IndexError, the kernel ran)
        with pytest.raises(ValueError, match="num_tree"):
            tree_attention(**args, num_tree=bad, sm_scale=0.3)
    narrow = torch.zeros(1, 33, 1, dtype=torch.int32)  # 33 rows, one 32-bit word
    with pytest.raises(ValueError, match="ancestor_bits: 1 words cannot hold 33 rows"):
        tree_attention(**{**args, "ancestor_bits": narrow}, num_tree=1, sm_scale=0.3)
    for bad in (torch.empty_like(q).double(), torch.empty_like(q)[:-1],
                torch.empty_like(q).transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="^out: expected contiguous"):
            tree_attention(**args, num_tree=1, sm_scale=0.3, out=bad)
    for name in ("kv_cache", "kv_slots", "qo_indptr", "ancestor_bits", "prefix_lens",
                 "o_prefix", "lse_prefix"):
        with pytest.raises(ValueError, match=f"^{name}: .*meta"):
            tree_attention(**{**args, name: args[name].to("meta")}, num_tree=1, sm_scale=0.3)
    with pytest.raises(ValueError, match="^out: on meta"):
        tree_attention(**args, num_tree=1, sm_scale=0.3, out=torch.empty_like(q, device="meta"))
    empty = tree_attention(**{k: (v[:0] if k in ("q", "kv_slots", "o_prefix", "lse_prefix")
                                  else v) for k, v in args.items()}, num_tree=1, sm_scale=0.3)
    assert empty.shape == (0, 4, 8)


def test_a_split_plan_needs_prefix_buffers():
    _, _, draft, roots, prefix, _, table = make_case(0, [2], "chain", [3], 4)
    out = TreeMetadata.empty(1, 3, table.shape[1], 4, "cpu")
    with pytest.raises(ValueError, match="prefix"):
        plan_tree(draft, roots, prefix, table, 4, out=out, prefix_pages=True)
    plain = plan_tree(draft, roots, prefix, table, 4)
    assert plain.maybe_prefix is None and not plain.has_sink


def test_launches_of_any_batch_share_the_compiled_kernels():
    """The step's row, request and page counts change every step and are not specialized:
    the tree kernel compiles once per model shape whatever the batch (the prefix pages once
    per power-of-two batch block, as the planner's kernels)."""
    def launch(case):
        meta, q, cache, _ = split_and_custom(case, 4, 2, extra_rows=0)
        o, lse = prefix_part(meta, q, cache, case[3])
        p = meta.maybe_prefix
        args = [t.to(DEVICE) for t in (q, cache, meta.kv_slots, meta.qo_indptr,
                                        meta.ancestor_bits, p.prefix_lens, o, lse)]
        return lambda: tree_attention(*args, num_tree=meta.batch_size, sm_scale=0.35,
                                      use_triton=True)

    cases = [([3, 0, 9], "random", [17, 0, 4], 4), ([4, 7, 1], "wide", [16, 1, 2], 4),
             ([35, 2, 5, 1, 0], "random", [2, 9, 3, 3, 0], 4), ([2], "chain", [5], 4)]
    assert assert_one_compile_per_config(_tree_attention_kernel, [launch(c) for c in cases]) == 1

    def plan(lens, width):
        table = torch.arange(len(lens) * width, dtype=torch.int32,
                             device=DEVICE).view(len(lens), width)
        return lambda: prefix_pages(torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                    table, 4, prefix_buffers(len(lens) + 1, 64), sink_page=1,
                                    use_triton=True)
    assert assert_one_compile_per_config(_prefix_pages_kernel, [
        plan([1, 5, 9], 3), plan([0, 17, 2], 7), plan([33, 3, 8], 11)]) == 1


@pytest.mark.parametrize("G,D,block_t", [(4, 128, 16), (7, 128, 8), (1, 64, 32)])
def test_tree_kernel_compiles_for_sm90(G, D, block_t):
    def sig(ptr):
        return {"q_ptr": ptr, "kv_ptr": ptr, "kv_slots_ptr": "*i32", "qo_indptr_ptr": "*i32",
                "ancestor_bits_ptr": "*i32", "prefix_lens_ptr": "*i32", "o_prefix_ptr": ptr,
                "lse_prefix_ptr": "*fp32", "out_ptr": ptr, "num_requests": "i32",
                "num_tree": "i32", "R": "i32", "W": "i32", "page_size": "i32",
                "sm_scale_log2": "fp32", "H": "constexpr", "G": "constexpr", "GP": "constexpr",
                "D": "constexpr", "BLOCK_D": "constexpr", "BLOCK_T": "constexpr"}
    GP = 1 << (G - 1).bit_length()
    # every dtype the launcher takes (fp16 / bf16 / fp32), one child process
    compile_all_for_sm90([(_tree_attention_kernel, sig(ptr), {
        "H": 8 * G, "G": G, "GP": GP, "D": D, "BLOCK_D": D, "BLOCK_T": block_t})
        for ptr in ("*bf16", "*fp16", "*fp32")])


def test_prefix_pages_kernel_compiles_for_sm90():
    sig = {"prefix_lens_ptr": "*i32", "page_table_ptr": "*i32", "kv_indptr_ptr": "*i32",
           "kv_indices_ptr": "*i32", "kv_last_page_len_ptr": "*i32",
           "prefix_lens_out_ptr": "*i32", "B": "i32", "max_pages": "i32", "P": "i32",
           "page_size": "i32", "sink_page": "i32", "BLOCK_B": "constexpr",
           "BLOCK_P": "constexpr"}
    compile_for_sm90(_prefix_pages_kernel, sig, {"BLOCK_B": 64, "BLOCK_P": 128})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tree_kernel_with_sink_requests(dtype):
    """A plan with padding requests (the sink: ``num_tree`` below the plan's requests), as
    a padded graph step runs it: the kernel equals the torch path in each dtype."""
    _, _, draft, roots, prefix, _, table = make_case(8, [4, 2], "random", [6, 13], 4)
    null = int(table.max()) + 1
    S, N, Q = 4, 6, 4 + 6 + 5
    tok = torch.zeros(S, N, dtype=torch.int32, device=DEVICE)
    par = torch.zeros(S, N, dtype=torch.int32, device=DEVICE)
    tok[:2, :draft.token_ids.shape[1]] = draft.token_ids
    par[:2, :draft.parents.shape[1]] = draft.parents
    num = torch.cat([draft.num_draft_tokens.to(torch.int32),
                     torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    ptable = torch.full((S, table.shape[1]), null, dtype=torch.int32, device=DEVICE)
    ptable[:2] = table
    out = TreeMetadata.empty(S + 1, N + 1, table.shape[1], 4, DEVICE, max_total_q=Q,
                             with_prefix=True)
    meta = plan_tree(DraftBatch(tok, par, num), torch.cat([roots, roots]),
                     torch.cat([prefix, torch.zeros(2, dtype=torch.int32, device=DEVICE)]),
                     ptable, 4, out=out, sink_page=null, prefix_pages=True)
    assert meta.has_sink
    g = torch.Generator().manual_seed(1)
    H, Hkv, D = 4, 2, 16
    cache = torch.randn(null + 1, 2, 4, Hkv, D, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(Q, H, D, generator=g).to(dtype).to(DEVICE)
    o_p = torch.randn(Q, H, D, generator=g).to(dtype).to(DEVICE)
    lse = (torch.randn(Q, H, generator=g) * 3).to(DEVICE)
    p = meta.maybe_prefix
    outs = [tree_attention(q, cache, meta.kv_slots, meta.qo_indptr, meta.ancestor_bits,
                           p.prefix_lens, o_p, lse, num_tree=meta.batch_size - 1,
                           sm_scale=D ** -0.5, use_triton=u) for u in (False, True)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)
    assert torch.isfinite(outs[1].float()).all()
    # every request a sink (num_tree = 0): the prefix's part alone
    q, o_p, lse = q[:5].float(), o_p[:5].float(), lse[:5]
    args = (cache[:3].float(), torch.arange(5, dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE),
            torch.zeros(0, 4, 1, dtype=torch.int32, device=DEVICE),
            torch.tensor([3, 0], dtype=torch.int32, device=DEVICE))
    outs = [tree_attention(q, *args, o_p, lse, num_tree=0, sm_scale=0.3, use_triton=u)
            for u in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)


def test_a_tree_row_without_a_kv_slot_is_not_attended():
    """A tree row whose KV slot is -1 (none: ``kv_slots``' padding value) inside its own
    tree: no row attends to it, on both paths alike; a root without a slot and without a
    prefix sees nothing (zeros)."""
    case = ([5, 4], "random", [0, 6], 4)
    meta, q, cache, _ = split_and_custom(case, 4, 2, head_dim=16, seed=2)
    o_prefix, lse = prefix_part(meta, q, cache, case[3])
    slots = meta.kv_slots.clone()
    qo = meta.qo_indptr.tolist()
    slots[[qo[0], qo[0] + 2, qo[1] + 1]] = -1  # request 0's root and a node; request 1's node
    outs = []
    for use_triton in (False, True):
        args = [t.to(DEVICE) for t in (q, cache, slots, meta.qo_indptr, meta.ancestor_bits,
                                        meta.maybe_prefix.prefix_lens, o_prefix, lse)]
        outs.append(tree_attention(*args, num_tree=meta.batch_size, sm_scale=16 ** -0.5,
                                   use_triton=use_triton).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(outs[0]).all() and outs[0][qo[0]].eq(0).all()
    full = tree_attention(q, cache, meta.kv_slots, meta.qo_indptr, meta.ancestor_bits,
                          meta.maybe_prefix.prefix_lens, o_prefix, lse,
                          num_tree=meta.batch_size, sm_scale=16 ** -0.5, use_triton=False)
    assert not torch.equal(full[qo[1] + 1], outs[0][qo[1] + 1])  # the slot did count


@pytest.mark.parametrize("sink", [None, 5])
def test_prefix_pages_past_one_block(sink):
    """Requests of more than 128 pages (the kernel's page block loops), an empty prefix and
    a sink: kernel equals torch path."""
    lens = [300, 0, 129, 1000]  # page_size 1 / 4: 300, 1, 129 / 33, 250 pages
    for ps in (1, 4):
        width = max(-(-(p + 1) // ps) for p in lens) + 1
        rng = np.random.default_rng(0)
        table = torch.from_numpy(rng.permutation(len(lens) * width + 7)[:len(lens) * width]
                                 .reshape(len(lens), width).astype(np.int32)).to(DEVICE)
        outs = []
        for u in (False, True):
            nb, P = len(lens) + 1, len(lens) * width + 2
            o = PrefixPages(*(torch.full((n,), -7, dtype=torch.int32, device=DEVICE)
                              for n in (nb + 1, P, nb, nb)))
            prefix_pages(torch.tensor(lens, dtype=torch.int32, device=DEVICE), table, ps, o,
                         sink_page=sink, use_triton=u)
            outs.append(o)
        n = int(outs[0].kv_indptr[len(lens) + (sink is not None)])
        for f in PrefixPages._fields:
            a, b = getattr(outs[0], f), getattr(outs[1], f)
            if f == "kv_indices":
                a, b = a[:n], b[:n]
            assert torch.equal(a, b), (ps, f)


def recompute(trees, prefix_lens, pages, page_size, q, cache, scale):
    """``float64 [Q, H, D]``: each tree row's attention recomputed alone, from the trees'
    parent lists and the page table, with no plan: the request's prefix slots, then its
    ancestors-or-self at ``prefix + row`` (rows of request ``b`` from ``sum(qo_len[:b])``;
    the rest zero)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    G = q.shape[1] // cache.shape[3]
    row0 = 0
    for b, tree in enumerate(trees):
        for r in range(len(tree) + 1):
            seen, x = [], r
            while x:
                seen.append(x)
                x = tree[x - 1][1] + 1
            slots = list(range(prefix_lens[b])) + [prefix_lens[b] + t for t in [0] + seen[::-1]]
            page = torch.tensor([int(pages[b, s // page_size]) for s in slots])
            off = torch.tensor([s % page_size for s in slots])
            k = cache[page, 0, off].double().repeat_interleave(G, 1)  # [n, H, D]
            v = cache[page, 1, off].double().repeat_interleave(G, 1)
            s = torch.einsum("hd,nhd->hn", q[row0 + r].double(), k) * scale
            out[row0 + r] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
        row0 += len(tree) + 1
    return out


@pytest.mark.parametrize("case", CASES + [([31, 32, 33], "random", [1, 0, 16], 16),
                                          ([64, 0], "wide", [9, 3], 8)])
def test_every_path_equals_a_per_row_recompute(case):
    """The custom mask, the split and the tree kernel (both paths) against each row's
    attention recomputed from the parent lists alone (the other tests share the plan and
    ``unpack_mask`` with the code under test); padding rows exactly zero."""
    sizes, kind, prefix_lens, page_size = case
    trees, _, draft, roots, prefix, pages, table = make_case(5, sizes, kind, prefix_lens,
                                                             page_size)
    H, H_kv, D = 6, 2, 12
    meta = plan_tree(draft, roots, prefix, table, page_size,
                     max_total_q=sum(sizes) + len(sizes) + 5, prefix_pages=True)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(int(table.max()) + 1, 2, page_size, H_kv, D, generator=g)
    q = torch.randn(meta.capacity_q, H, D, generator=g) * 2
    want = recompute(trees, prefix_lens, pages, page_size, q, cache, D ** -0.5)
    got = {}
    for split in (False, True):
        attn = TorchPagedAttention(H, H_kv, D, page_size, split=split)
        attn.plan(meta)
        got[f"split={split}"] = attn.run(q, cache)
    o_prefix, lse = prefix_part(meta, q, cache, page_size)
    for use_triton in (False, True):
        args = [t.to(DEVICE) for t in (q, cache, meta.kv_slots, meta.qo_indptr,
                                        meta.ancestor_bits, meta.maybe_prefix.prefix_lens,
                                        o_prefix, lse)]
        got[f"triton={use_triton}"] = tree_attention(
            *args, num_tree=meta.batch_size, sm_scale=D ** -0.5, use_triton=use_triton).cpu()
    n = int(meta.qo_indptr[-1])
    for name, out in got.items():
        torch.testing.assert_close(out[:n].double(), want[:n], atol=2e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert out[n:].eq(0).all(), name
