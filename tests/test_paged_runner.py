"""PagedLlamaRunner == the Hugging Face model's own forward on every root-to-node path."""

import os

import numpy as np
import pytest
import torch

from agspec_gpu import DraftBatch
from agspec_gpu.kernels.kv_compact import kv_compact
from agspec_gpu.runners.paged import PagedLlamaRunner
from tree_reference import random_trees

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, initializer_range=0.1,
            attn_implementation="eager")


def tiny_model(kind: str):
    if kind == "qwen2":
        config = transformers.Qwen2Config(**TINY)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if kind == "llama3":
            rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16}
        if int(transformers.__version__.split(".")[0]) >= 5:
            config = transformers.LlamaConfig(**TINY, rope_parameters=rope)
        else:  # transformers 4.x: rope_theta, and the scaling without the default's
            scaling = None if rope["rope_type"] == "default" else rope
            config = transformers.LlamaConfig(**TINY, rope_theta=rope["rope_theta"],
                                              rope_scaling=scaling)
        model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # zero biases and unit norms would hide a wrong use of them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def path_to(tree, node):
    """Tokens from the root's first child down to ``node`` (empty for the root, node -1)."""
    out = []
    while node >= 0:
        out.append(tree[node][0])
        node = tree[node][1]
    return out[::-1]


def check_step(model, runner, seq_ids, histories, trees, roots, prefix_lens):
    """Plans and runs a tree step; compares every row with HF on history + root + path."""
    draft = DraftBatch.from_lists(trees)
    meta = runner.plan(seq_ids, draft, torch.tensor(roots, dtype=torch.int32),
                       torch.tensor(prefix_lens, dtype=torch.int32))
    before = runner.kv_cache.data.clone()
    logits = runner.forward(meta)
    assert logits.shape == (meta.capacity_q, 1000)
    # into a caller's buffer (the graphs' shared logits): the same values, written there
    after = runner.kv_cache.data.clone()
    runner.kv_cache.data.copy_(before)
    buf = torch.full((meta.capacity_q + 3, 1000), float("nan"))
    got = runner.forward(meta, out=buf[:meta.capacity_q])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, logits)
    assert torch.equal(runner.kv_cache.data, after) and buf[meta.capacity_q:].isnan().all()
    qo = meta.qo_indptr.tolist()
    with torch.no_grad():
        for b, tree in enumerate(trees):
            for r in range(1 + len(tree)):
                ids = histories[b] + [roots[b]] + path_to(tree, r - 1)
                want = model(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[qo[b] + r], want, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"request {b} row {r}: {m}")
    return meta


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_prefill_tree_step_and_commit_match_hf(kind, split):
    """Tree steps (split attention, or the custom mask) and prefill chunks (the custom mask
    always) equal the HF model's logits of every path."""
    model = tiny_model(kind)
    runner = PagedLlamaRunner.from_hf_model(model, num_pages=96, page_size=4, max_seqs=4,
                                            split_attention=split)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 1000, n)] for n in (7, 12, 1)]
    seq_ids = ["a", "b", "c"]

    last = runner.prefill(seq_ids, prompts, chunk_size=5)  # chunks exercise prefix continuation
    # each prompt holds its own pages, not the widest chunk's (7 -> 2 pages, 12 -> 3, 1 -> 1)
    assert [runner.kv_cache.capacity(s) for s in seq_ids] == [8, 12, 4]
    with torch.no_grad():
        for b, p in enumerate(prompts):
            want = model(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(last[b], want, atol=1e-4, rtol=1e-4)

    # step 1: a random tree, a chain, an empty draft
    trees = [random_trees(rng, [7], "random")[0], random_trees(rng, [3], "chain")[0], []]
    roots = [int(t) for t in last.argmax(-1)]
    prefix = [len(p) for p in prompts]
    meta = check_step(model, runner, seq_ids, prompts, trees, roots, prefix)

    # commit the deepest path of each tree: compact its KV behind the root
    accepted = []
    for tree in trees:
        node = max(range(len(tree)), key=lambda j: len(path_to(tree, j)), default=-1)
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = tree[node][1]
        accepted.append(nodes[::-1])
    width = max(len(a) for a in accepted)
    kv_compact(runner.kv_cache.data, meta.kv_indptr, meta.kv_indices,  # the step's pages
               torch.tensor(prefix, dtype=torch.int32),
               torch.tensor([a + [-1] * (width - len(a)) for a in accepted], dtype=torch.int32))
    histories = [p + [roots[b]] + [trees[b][j][0] for j in accepted[b]]
                 for b, p in enumerate(prompts)]

    # step 2 on the committed caches: the new prefix is history, its KV compacted in place
    trees2 = [random_trees(rng, [n], "random")[0] for n in (2, 5, 4)]
    roots2 = [int(t) for t in rng.integers(0, 1000, 3)]
    check_step(model, runner, seq_ids, histories, trees2, roots2, [len(h) for h in histories])


def test_from_pretrained_round_trip(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    runner = PagedLlamaRunner.from_pretrained(tmp_path, num_pages=16, page_size=8)
    ids = [3, 14, 15, 92, 65]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(runner.prefill(["s"], [ids])[0], want, atol=1e-4, rtol=1e-4)


def test_models_of_llamas_weight_names_but_another_forward_are_refused():
    """The paged runner computes Llama / Qwen2 / Mistral (full attention, SiLU): models that
    share Llama's weight names but not its forward (Qwen3's q/k norms, Gemma's scaled
    embeddings and norms, Granite's multipliers, another activation, a sliding window)
    would run, wrongly; they are refused naming what differs."""
    from agspec_gpu.runners.paged import ModelShape

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)
    for cfg, match in ((transformers.Qwen3Config(**small), "model_type 'qwen3'"),
                       (transformers.GemmaConfig(**small), "model_type 'gemma'"),
                       (transformers.GraniteConfig(**small), "model_type 'granite'"),
                       (transformers.LlamaConfig(hidden_act="gelu", **small), "hidden_act"),
                       (transformers.MistralConfig(sliding_window=16, **small), "sliding")):
        with pytest.raises(ValueError, match=match):
            ModelShape.from_hf_config(cfg)
    for cfg in (transformers.LlamaConfig(**small), transformers.Qwen2Config(**small),
                transformers.MistralConfig(sliding_window=None, **small)):
        assert ModelShape.from_hf_config(cfg).hidden_size == 16


def test_paged_batch_continues_the_callers_sequences():
    """PagedBatch(seq_ids=...): the caller's KV sequences outlive the batch, and a later
    batch that names how many tokens they hold (``cached``) computes only the rest."""
    from agspec_gpu.runners.paged_batch import PagedBatch

    model = tiny_model("llama")
    runner = PagedLlamaRunner.from_hf_model(model, num_pages=64, page_size=4, max_seqs=4)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 1000, n)] for n in (9, 3)]
    batch = PagedBatch(runner)
    batch.prefill(prompts, seq_ids=["a", "b"])
    assert batch.prefix_lens_host == [9, 3]
    batch.close()
    assert "a" in runner.kv_cache and "b" in runner.kv_cache  # the caller's: kept
    longer = [prompts[0] + [5, 6, 7], prompts[1] + [8]]
    rows, forward = [], runner.forward
    runner.forward = lambda meta, **kw: rows.append(meta.capacity_q) or forward(meta, **kw)
    last = batch.prefill(longer, seq_ids=["a", "b"], cached=[9, 3])
    del runner.forward
    assert rows == [3 + 1]  # the new tokens' rows only, not 2 x the longest chunk
    with torch.no_grad():
        for b, p in enumerate(longer):
            want = model(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(last[b], want, atol=1e-4, rtol=1e-4)
    for bad in ([9, 4], [12, 0], [-1, 0], [0]):
        with pytest.raises(ValueError, match="cached"):
            batch.prefill(longer, seq_ids=["a", "b"], cached=bad)
    with pytest.raises(ValueError, match="cached"):
        batch.prefill(longer, cached=[1, 1])  # counts without the sequences they count
    with pytest.raises(ValueError, match="seq_ids"):
        batch.prefill(longer, seq_ids=["a"])
    own = PagedBatch(runner)
    own.prefill(prompts)
    own.close()  # its own sequences: freed, the caller's untouched
    for s in ("a", "b"):
        runner.kv_cache.free(s)
    assert runner.kv_cache.num_free_pages == runner.kv_cache.num_pages


def test_paged_batch_checks_what_could_reach_another_batchs_pages():
    """Freed pages keep their KV, so every argument that could make a batch read or free
    pages not its own is checked before anything changes: rows to keep (negative, out of
    range, repeated), ``cached`` counts the pool does not hold, an acceptance result of
    another batch size, token ids outside the vocabulary. A prefill that runs out of pages
    leaves a batch that closes and prefills again, and the pool whole."""
    from agspec_gpu.accept import greedy_accept
    from agspec_gpu.kv_cache import KVCacheFull
    from agspec_gpu.runners.paged_batch import PagedBatch

    model = tiny_model("llama")
    runner = PagedLlamaRunner.from_hf_model(model, num_pages=8, page_size=4, max_seqs=4)
    cache = runner.kv_cache
    batch = PagedBatch(runner)
    batch.prefill([[1, 2, 3, 4, 5], [6, 7, 8]])
    for bad in ([-1], [2], [0, 0], [0.0]):
        with pytest.raises(ValueError, match="rows"):
            batch.select_rows(bad)
    assert batch.batch_size == 2 and cache.num_free_pages == 8 - 3
    with pytest.raises(ValueError, match="token_lists: token ids must be in"):
        PagedBatch(runner).prefill([[1, -1, 3]])
    with pytest.raises(ValueError, match="token_lists: token ids must be in"):
        PagedBatch(runner).prefill([[1000]])
    with pytest.raises(ValueError, match="cached: more tokens than the pool holds"):
        PagedBatch(runner).prefill([[1, 2, 3, 4]], seq_ids=["never"], cached=[3])
    draft = DraftBatch.from_lists([[(9, -1)], [(9, -1)]], "cpu")
    logits, qo_indptr = batch.verify_rows(draft, torch.tensor([5, 8], dtype=torch.int32))
    res = greedy_accept(draft, logits, qo_indptr)
    one = greedy_accept(DraftBatch.from_lists([[(9, -1)]], "cpu"), logits[:2],
                        qo_indptr[:2])
    with pytest.raises(ValueError, match="result: an AcceptResult of 2 requests"):
        batch.commit_kv(one)
    batch.commit(res)
    assert batch.prefix_lens_host == [p + 1 + int(n) for p, n in zip((5, 3), res.num_accepted)]
    batch.close()
    assert cache.num_free_pages == 8
    with pytest.raises(KVCacheFull):  # 9 pages for 36 tokens, the pool has 8
        batch.prefill([[1] * 20, [2] * 16])
    assert cache.num_free_pages == 8 and batch.batch_size == 0
    batch.close()
    batch.prefill([[1, 2, 3]])
    batch.close()
    assert cache.num_free_pages == 8


def test_paged_batch_fits_each_requests_own_nodes_then_the_roots_alone():
    """A step's pages follow each request's own node count (``num_draft``), not the
    batch's width: a request with no nodes leaves its pages to the others. When only the
    roots fit, ``fit_width`` is 0 and ``fit_draft`` cuts every draft (a plain decoding
    step, one padded column); when not even they fit, None and KVCacheFull."""
    from agspec_gpu.kv_cache import KVCacheFull
    from agspec_gpu.runners.paged_batch import PagedBatch

    model = tiny_model("llama")
    runner = PagedLlamaRunner.from_hf_model(model, num_pages=32, page_size=4, max_seqs=4)
    cache = runner.kv_cache
    rng = np.random.default_rng(4)
    batch = PagedBatch(runner)
    batch.prefill([[int(t) for t in rng.integers(0, 1000, n)] for n in (8, 7)])
    assert batch.prefix_lens_host == [8, 7]  # 2 pages each; roots: 9 and 8 slots

    def leave_free(n: int) -> None:
        if "x" in cache:
            cache.free("x")
        cache.allocate("x", (cache.num_free_pages - n) * 4)
        assert cache.num_free_pages == n

    leave_free(3)  # w nodes each: ceil((9 + w) / 4) - 2 + ceil((8 + w) / 4) - 2 pages
    assert batch.fit_width(8) == 4
    assert batch.fit_width(8, num_draft=[0, 8]) == 8  # request 0's root: one page
    leave_free(1)
    assert batch.pages_needed(0) == 1 and batch.fit_width(4) == 0
    assert batch.fit_width(4, num_draft=[0, 0]) == 4  # (no node: the roots are the step)
    draft = DraftBatch.from_lists([[(5, -1), (6, 0)], [(7, -1)]])
    width, num_draft, cut = batch.fit_draft(2, [2, 1], draft)
    assert (width, num_draft, cut.num_draft_tokens.tolist()) == (1, [0, 0], [0, 0])
    leave_free(0)
    assert batch.fit_width(4) is None
    with pytest.raises(KVCacheFull, match="kv_cache_tokens"):
        batch.fit_draft(2, [2, 1], draft)
    cache.free("x")
    batch.close()
    assert cache.num_free_pages == cache.num_pages


def test_paged_batch_commit_in_two_halves_equals_commit():
    """``commit_kv`` (device: compaction, prefix add) then ``commit_lengths`` (host) is
    ``commit``: the same host lengths and the same next step's logits, the lengths given or
    read from the device. Between the halves the batch refuses to verify, fit or drop rows,
    which would size pages with stale lengths; a half out of order or a wrong count of
    lengths is named."""
    from agspec_gpu.accept import greedy_accept
    from agspec_gpu.runners.paged_batch import PagedBatch

    model = tiny_model("llama")
    runner = PagedLlamaRunner.from_hf_model(model, num_pages=96, page_size=4, max_seqs=9)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 1000, n)] for n in (7, 2, 5)]
    batches = [PagedBatch(runner) for _ in range(3)]
    roots = [b.prefill(prompts).argmax(-1).to(torch.int32) for b in batches]
    torch.testing.assert_close(roots[1], roots[0])
    ctx = [list(p) for p in prompts]  # what each request's KV holds

    def next_token(ids):
        with torch.no_grad():
            return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    for step in range(2):
        # request 0: two target tokens then a wrong one (accepts 2); request 1: random
        # (accepts 0); request 2: a wrong first branch, the target's token second (accepts 1)
        r = [int(x) for x in roots[0]]
        c0 = next_token(ctx[0] + [r[0]])
        c1 = next_token(ctx[0] + [r[0], c0])
        trees = [[(c0, -1), (c1, 0), ((c1 + 1) % 1000, 1)],
                 [(int(t), -1) for t in rng.integers(0, 1000, 2)],
                 [((next_token(ctx[2] + [r[2]]) + 1) % 1000, -1),
                  (next_token(ctx[2] + [r[2]]), -1)]]
        outs = []
        for k, batch in enumerate(batches):
            draft = DraftBatch.from_lists(trees)
            logits, qo = batch.verify_rows(draft, roots[k])
            res = greedy_accept(draft, logits, qo)
            if k == 0:
                batch.commit(res)
            else:
                batch.commit_kv(res)
                for call in (lambda: batch.verify_rows(draft, roots[k]),
                             lambda: batch.fit_width(4), lambda: batch.select_rows([0, 1, 2])):
                    with pytest.raises(ValueError, match="between commit_kv"):
                        call()
                with pytest.raises(ValueError, match="num_accepted_host: 2 counts for 3"):
                    batch.commit_lengths([0, 0])
                batch.commit_lengths(None if k == 1 else res.num_accepted.tolist())
                with pytest.raises(ValueError, match="without a preceding commit_kv"):
                    batch.commit_lengths([0, 0, 0])
            roots[k] = res.bonus_ids().to(torch.int32)
            outs.append((logits, batch.prefix_lens_host, res.num_accepted.tolist()))
        assert outs[0][2] == [2, 0, 1]
        for logits, lens, n_acc in outs[1:]:
            torch.testing.assert_close(logits, outs[0][0])
            assert lens == outs[0][1] and n_acc == outs[0][2]
        out_ids = res.output_ids.tolist()
        for b, a in enumerate(outs[0][2]):
            ctx[b] += [r[b]] + out_ids[b][:a]
        assert outs[0][1] == [len(c) for c in ctx]
    for batch in batches:
        batch.close()
    assert runner.kv_cache.num_free_pages == runner.kv_cache.num_pages


# the runner here is on the CPU: its Triton kernels run only interpreted (a GPU machine
# compiles them; tests/test_gpu.py runs the runner there)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter for CPU tensors")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_forward_with_the_triton_layer_kernels_equals_the_torch_path(kind, monkeypatch):
    """The forward a GPU runs (the fused RoPE + KV append, RMSNorm and SiLU * up kernels;
    interpreted here) gives the torch path's prefill and tree-step logits and cache (the null
    page, which padding rows share, aside): bit for bit with the Triton RoPE + append alone
    (it rounds as torch does), within fp32 noise with all three (RMSNorm sums in another
    order)."""
    import functools

    import agspec_gpu.runners.paged as paged
    from agspec_gpu.kernels import rms_norm, rope_append, silu_mul

    model = tiny_model(kind)

    def run(triton: set[str]):
        for module, name in ((rope_append, "rope_append"), (rms_norm, "rms_norm"),
                             (silu_mul, "silu_mul")):
            monkeypatch.setattr(paged, name, functools.partial(getattr(module, name),
                                                               use_triton=name in triton))
        runner = PagedLlamaRunner.from_hf_model(model, num_pages=32, page_size=4, max_seqs=4,
                                                max_pages_per_seq=16)
        last = runner.prefill(["a", "b"], [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]])
        draft = DraftBatch.from_lists([[(5, -1), (6, 0), (7, -1)], [(1, -1)]])
        meta = runner.plan(["a", "b"], draft, torch.tensor([3, 4], dtype=torch.int32),
                           torch.tensor([7, 3], dtype=torch.int32), prefix_lens_host=[7, 3])
        return last, runner.forward(meta), runner.kv_cache.data[:, :-1].clone()

    want = run(set())
    for got, ref in zip(run({"rope_append"}), want):
        assert torch.equal(got, ref)
    for got, ref in zip(run({"rope_append", "rms_norm", "silu_mul"}), want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_a_split_runner_prefills_with_the_custom_mask_and_verifies_split():
    """``split_attention``: tree steps plan the prefix pages (the split), prefill chunks of
    any length do not (the tree kernel has no tensor cores); a step whose trees exceed
    ``SPLIT_MAX_QO_LEN`` rows per request keeps the custom mask too."""
    from agspec_gpu.attention import SPLIT_MAX_QO_LEN

    runner = PagedLlamaRunner.from_hf_model(tiny_model("llama"), num_pages=96, page_size=4,
                                            max_seqs=4)
    seen = []
    forward = runner.forward
    runner.forward = lambda meta, **kw: (seen.append(meta.maybe_prefix), forward(meta, **kw))[1]
    last = runner.prefill(["a"], [list(range(1, 8))], chunk_size=3)
    assert len(seen) == 3 and all(p is None for p in seen)
    draft = DraftBatch.from_lists([[(5, -1), (6, 0)]])
    meta = runner.plan(["a"], draft, last.argmax(-1).to(torch.int32),
                       torch.tensor([7], dtype=torch.int32))
    assert meta.maybe_prefix is not None and meta.maybe_prefix.prefix_lens.tolist() == [7]
    assert runner.splits(SPLIT_MAX_QO_LEN - 1) and not runner.splits(SPLIT_MAX_QO_LEN)
    custom = PagedLlamaRunner.from_hf_model(tiny_model("llama"), num_pages=96, page_size=4,
                                            max_seqs=4, split_attention=False)
    assert not custom.splits(1)
