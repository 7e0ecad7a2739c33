"""Paged tree attention: mask round trip and the torch backend against a dense recompute."""

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

from agspec_gpu.attention import TorchPagedAttention, make_attention_backend
from agspec_gpu.tree import host_sizes, plan_tree, unpack_mask
from tree_reference import dense_mask, make_case, on_device

# (sizes, tree kind, prefix lengths, page size)
CASES = [
    ([0], "random", [0], 1),
    ([6], "chain", [5], 4),
    ([3, 0, 9], "random", [17, 0, 4], 3),
    ([4, 7], "wide", [16, 1], 16),
    ([35, 2], "random", [2, 9], 5),
]


@pytest.mark.parametrize("sizes,kind,prefix_lens,page_size", CASES)
def test_packed_mask_round_trip(sizes, kind, prefix_lens, page_size):
    trees, _, draft, roots, prefix, _, page_table = make_case(11, sizes, kind, prefix_lens,
                                                              page_size)
    meta = plan_tree(draft, roots, prefix, page_table, page_size)
    dense = unpack_mask(meta)
    assert dense.shape == (len(sizes), meta.max_qo_len, meta.max_kv_len)
    repacked = []
    for b, tree in enumerate(trees):
        want = dense_mask(tree, prefix_lens[b])
        qo_len, kv_len = want.shape
        assert np.array_equal(dense[b, :qo_len, :kv_len].numpy(), want)
        assert not dense[b, qo_len:].any() and not dense[b, :, kv_len:].any()
        repacked += np.packbits(dense[b, :qo_len, :kv_len].numpy().reshape(-1),
                                bitorder="little").tolist()
    assert meta.packed_mask[:len(repacked)].tolist() == repacked


@pytest.mark.parametrize("num_qo_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("sizes,kind,prefix_lens,page_size", CASES)
def test_torch_backend_matches_dense_attention(sizes, kind, prefix_lens, page_size,
                                               num_qo_heads, num_kv_heads):
    head_dim = 8
    trees, _, draft, roots, prefix, pages, page_table = make_case(
        5, sizes, kind, prefix_lens, page_size)
    meta = plan_tree(draft, roots, prefix, page_table, page_size, max_total_q=sum(sizes) + 9)
    g = torch.Generator().manual_seed(num_qo_heads)
    num_pages = int(page_table.max()) + 1
    cache = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(meta.capacity_q, num_qo_heads, head_dim, generator=g)
    attn = TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size)
    attn.plan(meta)
    out = attn.run(q, cache)

    group = num_qo_heads // num_kv_heads
    row0 = 0
    for b, tree in enumerate(trees):
        mask = torch.from_numpy(dense_mask(tree, prefix_lens[b]))
        qo_len, kv_len = mask.shape
        slots = torch.arange(kv_len)
        page = torch.from_numpy(pages[b])[slots // page_size].long()
        k = cache[page, 0, slots % page_size].double()  # [kv_len, H_kv, D]
        v = cache[page, 1, slots % page_size].double()
        for h in range(num_qo_heads):
            qh = q[row0:row0 + qo_len, h].double()
            scores = qh @ k[:, h // group].T / head_dim ** 0.5
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            want = probs @ v[:, h // group]
            torch.testing.assert_close(out[row0:row0 + qo_len, h].double(), want,
                                       atol=1e-5, rtol=1e-5)
        row0 += qo_len
    assert out[row0:].eq(0).all()  # padding rows


def test_backend_choice_and_misuse():
    backend = make_attention_backend("cpu", 4, 2, 8, 16, dtype=torch.float32)
    assert isinstance(backend, TorchPagedAttention)
    with pytest.raises(ValueError, match="multiple"):
        TorchPagedAttention(4, 3, 8, 16)
    with pytest.raises(ValueError, match="before plan"):
        backend.run(torch.zeros(1, 4, 8), torch.zeros(1, 2, 16, 2, 8))
    _, _, draft, roots, prefix, _, page_table = make_case(0, [2], "chain", [3], 16)
    meta = plan_tree(draft, roots, prefix, page_table, 16)
    backend.plan(meta)
    with pytest.raises(ValueError, match="q: expected"):
        backend.run(torch.zeros(1, 4, 8), torch.zeros(1, 2, 16, 2, 8))
    with pytest.raises(ValueError, match="page_size"):
        TorchPagedAttention(4, 2, 8, 8).plan(meta)


FLASHINFER_READY = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.skipif(not FLASHINFER_READY, reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch_backend(dtype, page_size):
    """Same metadata, both backends; B > 1 exercises the mask_indptr byte offsets."""
    from agspec_gpu.attention import FlashInferPagedAttention

    num_qo_heads, num_kv_heads, head_dim = 8, 2, 128
    fi = FlashInferPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size,
                                  device="cuda", dtype=dtype)
    ref = TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size)
    for seed, sizes, prefix_lens in ((3, [5, 0, 12], [37, 3, 129]), (4, [33, 7], [0, 300])):
        _, _, draft, roots, prefix, _, page_table = make_case(seed, sizes, "random",
                                                              prefix_lens, page_size)
        meta = plan_tree(*on_device(draft, roots, prefix, page_table), page_size)
        g = torch.Generator(device="cuda").manual_seed(seed)
        num_pages = int(page_table.max()) + 1
        cache = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=g,
                            device="cuda").to(dtype)
        q = torch.randn(meta.capacity_q, num_qo_heads, head_dim, generator=g,
                        device="cuda").to(dtype)
        ref.plan(meta)
        fi.plan(meta)
        want = ref.run(q, cache).float()
        torch.testing.assert_close(fi.run(q, cache).float(), want, atol=2e-2, rtol=2e-2)
        # the sizes from the host (TreeMetadata.maybe_host): FlashInfer plans without
        # reading the device, the same attention
        fi.plan(replace(meta, maybe_host=host_sizes(sizes, prefix_lens, page_size)))
        torch.testing.assert_close(fi.run(q, cache).float(), want, atol=2e-2, rtol=2e-2)


def test_flashinfer_workspace_holds_the_split_kv_scratch_of_the_largest_graph_plan():
    """FlashInfer's graph-mode prefill plan carves ``tmp_v float32 [H, tiles * cta_tile_q, D]``
    and ``tmp_s`` from the float workspace, ``tiles = max(2 * SMs // H_kv, ceil(rows * group
    / cta_tile_q) + requests - 1)`` (its ``scheduler.cuh``): 409 MB for Llama-3-8B's largest
    verification bucket, which the 128 MiB default could not hold, so no graph was captured."""
    from agspec_gpu.attention import prefill_workspace_bytes

    def flashinfer_needs(H, H_kv, D, sms, rows, requests, cta_tile_q):
        tiles = max(2 * sms // H_kv, -(-rows * (H // H_kv) // cta_tile_q) + requests - 1)
        return H * tiles * cta_tile_q * D * 4 + H * tiles * cta_tile_q * 4

    # Llama-3-8B on an H200 (132 SMs): the S = 64 bucket of 4,161 rows and the sink
    llama = flashinfer_needs(32, 8, 128, 132, 4161, 65, 128)
    assert llama > 400e6
    got = prefill_workspace_bytes(32, 8, 128, 132, max_rows=4161, max_requests=65)
    assert llama < got < 1.1 * llama + (16 << 20)
    for H, H_kv, D, rows, reqs in [(32, 8, 128, 64, 64), (14, 2, 64, 2081, 33), (4, 1, 64, 9, 9),
                                   (32, 32, 128, 4161, 65), (8, 8, 256, 100, 3)]:
        need = max(flashinfer_needs(H, H_kv, D, 132, rows, reqs, cta) for cta in (16, 64, 128))
        assert prefill_workspace_bytes(H, H_kv, D, 132, max_rows=rows, max_requests=reqs) > need
    # eager plans (no graph): split KV only within the grid cap; never under FlashInfer's own
    # default of 128 MiB
    assert prefill_workspace_bytes(32, 8, 128, 132) == 128 << 20
    eager_mqa = flashinfer_needs(64, 1, 128, 132, 0, 0, 128)
    assert prefill_workspace_bytes(64, 1, 128, 132) > eager_mqa > 128 << 20


class RecordingWrapper:
    """A stand-in for FlashInfer's prefill wrapper: records what ``plan`` is given."""

    def __init__(self, B: int):
        self._mask_indptr_buf = torch.full((B + 1,), -1, dtype=torch.int32)
        self.planned = None

    def plan(self, *args, **kwargs):
        self.planned = (args, kwargs)


@pytest.mark.parametrize("with_host", [False, True])
def test_flashinfer_plan_hands_the_steps_sizes_to_the_wrapper(with_host):
    """What ``flashinfer_plan`` gives ``wrapper.plan`` (run here with a stub: the GPU tests
    run the real one), from the device metadata or from the host sizes a loop holds: the
    same indptrs, pages and packed mask, and the byte offsets of the mask in the wrapper's
    ``mask_indptr`` (a field added to ``HostSizes`` broke this unpacking once, on every GPU
    step, with no CPU test to see it)."""
    from agspec_gpu.attention import flashinfer_plan

    sizes, prefix_lens, ps = [2, 0, 5], [7, 1, 30], 4
    _, _, draft, roots, prefix, _, table = make_case(2, sizes, "random", prefix_lens, ps)
    host = host_sizes(sizes, prefix_lens, ps) if with_host else None
    meta = plan_tree(draft, roots, prefix, table, ps, host=host)
    w = RecordingWrapper(len(sizes))
    flashinfer_plan(w, meta, 8, 2, 16, 0.25, torch.bfloat16)
    (qo, kv, indices, last, *dims), kw = w.planned
    assert dims == [8, 2, 16, ps]
    for got, want in ((qo, meta.qo_indptr), (kv, meta.kv_indptr), (last, meta.kv_last_page_len)):
        assert torch.equal(got.cpu(), want.cpu())
    n = int(meta.kv_indptr[-1])  # the pages (the device buffer's padding may follow them)
    assert torch.equal(indices[:n].cpu(), meta.kv_indices[:n].cpu())
    assert kw["packed_custom_mask"] is meta.packed_mask and kw["sm_scale"] == 0.25
    assert torch.equal(w._mask_indptr_buf, meta.mask_indptr)


@pytest.mark.parametrize("with_host", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_flashinfer_prefix_plan_hands_the_prefix_pages_unmasked(with_host, sink):
    """``flashinfer_plan_prefix`` (a split step's prefix part): the step's rows, the prefix
    pages and last-page lengths (from the device plan, or the host's equal copy), no mask,
    ``causal=False``."""
    from agspec_gpu.attention import flashinfer_plan_prefix
    from agspec_gpu.tree import TreeMetadata

    sizes, prefix_lens, ps = [2, 0, 5], [7, 0, 30], 4
    _, _, draft, roots, prefix, _, table = make_case(4, sizes, "random", prefix_lens, ps)
    Q = sum(sizes) + 3 + 4 * sink
    host = host_sizes(sizes, prefix_lens, ps, sink_rows=4 if sink else None) \
        if with_host else None
    out = TreeMetadata.empty(4, 6, table.shape[1], ps, "cpu", max_total_q=Q, with_prefix=True)
    meta = plan_tree(draft, roots, prefix, table, ps, out=out, host=host, prefix_pages=True,
                     sink_page=int(table.max()) + 1 if sink else None)
    w = RecordingWrapper(len(sizes) + sink)
    flashinfer_plan_prefix(w, meta, 8, 2, 16, 0.25, torch.bfloat16)
    (qo, kv, indices, last, *dims), kw = w.planned
    p = meta.maybe_prefix
    assert dims == [8, 2, 16, ps] and kw["causal"] is False and kw["sm_scale"] == 0.25
    assert "packed_custom_mask" not in kw and "custom_mask" not in kw
    for got, want in ((qo, meta.qo_indptr), (kv, p.kv_indptr), (last, p.kv_last_page_len)):
        assert torch.equal(got.cpu(), want.cpu())
    n = int(p.kv_indptr[-1])
    assert torch.equal(indices[:n], p.kv_indices[:n])
    # request 1 has no prefix: one entry on its first page, which the tree kernel ignores
    assert p.prefix_lens.tolist()[:3] == [7, 0, 30] and p.kv_last_page_len.tolist()[:3] == [3, 1, 2]
