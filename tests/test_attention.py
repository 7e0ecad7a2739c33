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
