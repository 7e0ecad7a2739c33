"""HFRunner on tiny random Llama / Qwen2 models, eager and sdpa attention (fp32, CPU).

Two checks: tree-verification logits equal the model's own forward over prefix + each
root-to-node path (before and after a commit), and the loop propose -> verify ->
greedy_accept -> commit reproduces plain greedy decoding token for token."""

import pytest
import torch

from agspec_gpu.accept import greedy_accept, pad_tree_logits, tree_qo_indptr
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.runners.hf import HFRunner, greedy_generate
from tiny_models import VARIANTS, tiny_model

transformers = pytest.importorskip("transformers")

VOCAB = 1000
PROMPTS = [[11, 42, 7, 300, 5, 9, 18], [600, 2], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87],
           [999, 0, 500, 3]]
NEW_TOKENS = 40
MAX_TREE_DEPTH = 3


def _tiny(arch: str, attn: str) -> torch.nn.Module:
    return tiny_model(arch, attn, VOCAB, max_positions=256)


_MODELS: dict = {}
_REFS: dict = {}


def model_for(variant) -> torch.nn.Module:
    if variant not in _MODELS:
        _MODELS[variant] = _tiny(*variant)
    return _MODELS[variant]


def reference(variant, b: int) -> list[int]:
    """Greedy continuation of PROMPTS[b], long enough to build trees from at every step."""
    if (variant, b) not in _REFS:
        _REFS[variant, b] = greedy_generate(model_for(variant), PROMPTS[b],
                                            NEW_TOKENS + MAX_TREE_DEPTH + 1)
    return _REFS[variant, b]


def full_forward_last(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def path_tokens(tree: list[tuple[int, int]], j: int) -> list[int]:
    out = []
    while j >= 0:
        out.append(tree[j][0])
        j = tree[j][1]
    return out[::-1]


def check_verify_rows(model, padded, prefixes, roots, trees) -> None:
    for b, tree in enumerate(trees):
        ctx = prefixes[b] + [roots[b]]
        torch.testing.assert_close(padded[b, 0], full_forward_last(model, ctx), atol=1e-4, rtol=0)
        for j in range(len(tree)):
            torch.testing.assert_close(padded[b, 1 + j],
                                       full_forward_last(model, ctx + path_tokens(tree, j)),
                                       atol=1e-4, rtol=0,
                                       msg=lambda m: f"request {b} node {j}: {m}")


def test_tree_inputs_layout():
    d = DraftBatch.from_lists([[(5, -1), (6, -1), (7, 1)], [], [(9, -1)]])
    inp = d.tree_inputs(torch.tensor([11, 12, 13]), torch.tensor([4, 0, 7]))
    a = inp.tree_mask.int()
    assert a[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert torch.equal(a[1], torch.eye(4, dtype=torch.int32))  # padding sees only itself
    assert a[2].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert inp.input_ids.tolist() == [[11, 5, 6, 7], [12, 0, 0, 0], [13, 9, 0, 0]]
    assert inp.position_ids.tolist() == [[4, 5, 5, 6], [0, 0, 0, 0], [7, 8, 7, 7]]
    assert inp.input_ids.dtype == inp.position_ids.dtype == torch.int64
    with pytest.raises(ValueError, match="root_ids"):
        d.tree_inputs(torch.tensor([1, 2]), torch.tensor([0, 0, 0]))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_verify_logits_equal_full_forward(variant):
    model = model_for(variant)
    runner = HFRunner(model)
    prompts = PROMPTS[:3]
    first = runner.prefill(prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(first[b], full_forward_last(model, p), atol=1e-4, rtol=0)
    roots = first.argmax(-1).tolist()
    g = [reference(variant, b) for b in range(3)]
    # request 0: a branchy tree whose second branch is the greedy path (accepts 2);
    # request 1: empty; request 2: a wrong chain (accepts 0)
    trees = [[(3, -1), (g[0][1], -1), (4, 0), (g[0][2], 1), (8, 1)], [], [(1, -1), (2, 0)]]
    d = DraftBatch.from_lists(trees)
    padded = runner.verify_padded(d, torch.tensor(roots))
    check_verify_rows(model, padded, prompts, roots, trees)

    res = greedy_accept(d, padded)
    assert res.num_accepted.tolist() == [2, 0, 0]
    runner.commit(res)
    prefixes = [p + [r] + res.output_ids[b, :res.num_accepted[b]].tolist()
                for b, (p, r) in enumerate(zip(prompts, roots))]
    assert runner.seq_lens.tolist() == [len(p) for p in prefixes]
    roots = res.bonus_ids().tolist()
    trees = [[(9, -1)], [(10, -1), (11, -1), (12, 1), (13, 2)], [(14, -1), (15, 0), (16, 1)]]
    d = DraftBatch.from_lists(trees)
    flat = runner.verify(d, torch.tensor(roots))
    assert flat.shape == (int(tree_qo_indptr(d)[-1]), VOCAB)
    padded = pad_tree_logits(flat, tree_qo_indptr(d), d.max_nodes)
    check_verify_rows(model, padded, prefixes, roots, trees)


def propose(kind: str, ref: list[int], c: int, step: int) -> tuple[list[tuple[int, int]], int]:
    """A tree for a request that has generated ``c`` tokens, and how many tokens it accepts."""
    nxt = ref[c:c + MAX_TREE_DEPTH]
    wrong = [(t + 1) % VOCAB for t in nxt]
    if kind == "full":
        k = 1 + step % MAX_TREE_DEPTH
        return [(t, j - 1) for j, t in enumerate(nxt[:k])], k
    if kind == "wrong":
        return [(wrong[0], -1), (nxt[1], 0)], 0
    if kind == "branch":
        # root children: wrong, wrong, right (node 2); under node 2 a wrong then the right
        # token (node 4); the right second token also under a wrong parent (node 5)
        return [(wrong[0], -1), ((nxt[0] + 2) % VOCAB, -1), (nxt[0], -1), (wrong[1], 2),
                (nxt[1], 2), (nxt[1], 0), (nxt[2], 4)], 3
    return [], 0


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("B", [1, 2, 3, 4])
def test_spec_loop_reproduces_greedy(variant, B):
    runner = HFRunner(model_for(variant))
    refs = [reference(variant, b) for b in range(B)]
    roots = runner.prefill(PROMPTS[:B]).argmax(-1)
    outs = [[r] for r in roots.tolist()]
    kinds = ["full", "wrong", "branch", "empty"]
    step = 0
    while min(len(o) for o in outs) < NEW_TOKENS:
        trees, expected = [], []
        for b in range(B):
            # requests that are done keep decoding with empty drafts
            kind = kinds[(step + b) % 4] if len(outs[b]) < NEW_TOKENS else "empty"
            tree, n = propose(kind, refs[b], len(outs[b]), step)
            trees.append(tree)
            expected.append(n)
        d = DraftBatch.from_lists(trees)
        res = greedy_accept(d, runner.verify(d, roots), tree_qo_indptr(d))
        runner.commit(res)
        assert res.num_accepted.tolist() == expected, f"step {step}"
        for b in range(B):
            outs[b] += res.output_ids[b, :res.num_output[b]].tolist()
        roots = res.bonus_ids()
        step += 1
    for b in range(B):
        assert outs[b][:NEW_TOKENS] == refs[b][:NEW_TOKENS], f"request {b}"
    assert runner.seq_lens.tolist() == [len(p) + len(o) - 1 for p, o in zip(PROMPTS, outs)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_commit_moves_only_the_accepted_slots(variant):
    """``commit`` writes the root's and the accepted nodes' KV behind each prefix in place,
    and the next ``verify`` appends its tree in place too (the cache is not copied: a step
    costs no pass over the whole context); the kept slots equal those of a fresh prefill of
    the same tokens."""
    model = model_for(variant)
    runner = HFRunner(model)
    roots = runner.prefill(PROMPTS[:3]).argmax(-1)
    g = [reference(variant, b) for b in range(3)]
    wrong = [(g[b][1] + 1) % VOCAB for b in range(3)]
    trees = [[(wrong[0], -1), (g[0][1], -1), (wrong[0], 1), (g[0][2], 1), (g[0][3], 3)],
             [(wrong[1], -1)],                       # rejected at the first token
             [(g[2][1], -1), (g[2][2], 0)]]          # accepted whole
    d = DraftBatch.from_lists(trees)
    logits = runner.verify_padded(d, roots)
    storage = [layer.keys.data_ptr() for layer in runner._cache.layers]
    res = greedy_accept(d, logits)
    runner.commit(res)
    assert res.num_accepted.tolist() == [3, 0, 2]
    assert [layer.keys.data_ptr() for layer in runner._cache.layers] == storage
    committed = [PROMPTS[b] + g[b][:1 + n] for b, n in enumerate(res.num_accepted.tolist())]
    assert runner.seq_lens.tolist() == list(map(len, committed))
    fresh = HFRunner(model)
    fresh.prefill(committed)
    for b, ctx in enumerate(committed):
        got, want = runner.session_kv(b, len(ctx)), fresh.session_kv(b, len(ctx))
        for x, y in zip(got.keys + got.values, want.keys + want.values):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
    roots = res.bonus_ids()
    trees = [[(7 + b, -1)] for b in range(3)]  # any tokens: the logits are checked
    check_verify_rows(model, runner.verify_padded(DraftBatch.from_lists(trees), roots),
                      committed, roots.tolist(), trees)
    assert [layer.keys.data_ptr() for layer in runner._cache.layers] == storage


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_kept_session_kv_continues_in_a_later_batch(variant):
    """A batch's committed KV, kept per request (``session_kv``), seeds a later batch of
    another composition and width: its prefill computes only the new tokens, and the
    logits (prefill's and a tree step's) equal the model's full forward."""
    model = model_for(variant)
    first = HFRunner(model)
    first.prefill(PROMPTS[:3])
    roots = first.prefill(PROMPTS[:3]).argmax(-1)  # a second prefill starts afresh
    g = [reference(variant, b) for b in range(3)]
    d = DraftBatch.from_lists([[(g[0][1], -1), (g[0][2], 0)], [], [(5, -1)]])
    res = greedy_accept(d, first.verify_padded(d, roots))
    first.commit(res)
    lens = first.seq_lens.tolist()
    assert lens == [len(PROMPTS[0]) + 3, len(PROMPTS[1]) + 1, len(PROMPTS[2]) + 1]
    kept = [first.session_kv(0, lens[0]), first.session_kv(2, lens[2] - 1)]
    assert kept[0].length == lens[0] and kept[0].nbytes > 0
    ctx0 = PROMPTS[0] + g[0][:3] + [17, 4, 250]          # the kept KV, then new tokens
    ctx2 = PROMPTS[2] + [g[2][0]]                        # its last token was not cached
    ctxs = [PROMPTS[3], ctx0, ctx2]                      # and a fresh request in front
    second = HFRunner(model)
    logits = second.prefill(ctxs, past=[None, kept[0], kept[1]])
    for b, ctx in enumerate(ctxs):
        torch.testing.assert_close(logits[b], full_forward_last(model, ctx), atol=1e-4, rtol=0)
    assert second.seq_lens.tolist() == list(map(len, ctxs))
    roots = logits.argmax(-1).tolist()
    trees = [[(9, -1), (3, 0)], [(10, -1), (11, -1), (12, 1)], [(14, -1)]]
    check_verify_rows(model, second.verify_padded(DraftBatch.from_lists(trees),
                                                  torch.tensor(roots)), ctxs, roots, trees)
    with pytest.raises(ValueError, match="past"):
        second.prefill([PROMPTS[0]], past=[kept[0]])  # as long as the prompt: nothing new
    with pytest.raises(ValueError, match="past"):
        second.prefill([ctx0, ctx2], past=[kept[0]])
    with pytest.raises(ValueError, match="length"):
        first.session_kv(0, 0)


def test_runner_misuse_raises():
    model = model_for(("llama", "eager"))
    runner = HFRunner(model)
    d = DraftBatch.from_lists([[(1, -1)]])
    with pytest.raises(ValueError, match="prefill"):
        runner.verify(d, torch.tensor([1]))
    with pytest.raises(ValueError, match="input_ids"):
        runner.prefill([[1], []])
    runner.prefill([[1, 2]])
    with pytest.raises(ValueError, match="commit"):
        runner.commit(greedy_accept(d, torch.zeros(1, 2, VOCAB)))
    with pytest.raises(ValueError, match="root_ids"):
        runner.verify(d, torch.tensor([1, 2]))
    runner.verify(d, torch.tensor([3]))
    with pytest.raises(ValueError, match="twice"):
        runner.verify(d, torch.tensor([3]))
    # the commit in two halves: between them the host lengths are not known yet
    before = runner.session_kv(0, 2)
    runner.commit_kv(greedy_accept(d, torch.zeros(1, 2, VOCAB)))
    for call in (lambda: runner.verify(d, torch.tensor([3])),
                 lambda: runner.select_rows([0])):
        with pytest.raises(ValueError, match="between commit_kv"):
            call()
    # the slots committed before stay readable (a call interrupted here keeps them)
    during = runner.session_kv(0, 2)
    assert during.length == 2 and all(torch.equal(a, b) for a, b in
                                      zip(before.keys + before.values, during.keys + during.values))
    with pytest.raises(ValueError, match=r"length: 3 outside \(0, 2\]"):
        runner.session_kv(0, 3)
    with pytest.raises(ValueError, match="num_accepted_host: 2 counts for 1"):
        runner.commit_lengths([0, 0])
    runner.commit_lengths([0])
    assert runner.seq_lens_host == [3]
    with pytest.raises(ValueError, match="without a preceding commit_kv"):
        runner.commit_lengths([0])
    runner.verify(d, torch.tensor([3]))
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            HFRunner(model)
    finally:
        model.eval()
    sliding = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, use_sliding_window=True,
                                       sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding"):
        HFRunner(transformers.Qwen2ForCausalLM(sliding).eval())


def test_models_it_cannot_verify_exactly_are_refused_when_the_decoder_is_built():
    """Models whose forward reads distances or windows by cache slot, which a padded batch
    and a draft tree shift (ALiBi: Bloom, MPT, Falcon with alibi; GPT-Neo's local layers; a
    sliding window): refused naming the model, by the runner and by SpecDecoder's
    constructor (not at the first generate)."""
    from agspec_gpu import SpecDecoder

    small = dict(vocab_size=64, hidden_size=16, num_attention_heads=2)
    configs = {"ALiBi": [transformers.BloomConfig(n_layer=1, **small),
                         transformers.MptConfig(n_layers=1, d_model=16, n_heads=2,
                                                vocab_size=64),
                         transformers.FalconConfig(alibi=True, num_hidden_layers=1, **small)],
               "local-attention": [transformers.GPTNeoConfig(
                   num_layers=2, attention_types=[[["global", "local"], 1]], **small)],
               "sliding": [transformers.MistralConfig(num_hidden_layers=1,
                                                      intermediate_size=32, **small)],
               # (an audit of ~80 architectures: these decoded wrongly or crashed)
               "rope_type 'longrope'": [transformers.Phi3Config(
                   num_hidden_layers=1, intermediate_size=32, max_position_embeddings=1024,
                   original_max_position_embeddings=32, sliding_window=None, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2,
                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                 "long_factor": [4.0] * 4,
                                 "original_max_position_embeddings": 32}, **small)],
               "rope_type 'dynamic'": [transformers.LlamaConfig(
                   num_hidden_layers=1, intermediate_size=32, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                   **small)],
               "rwkv: a recurrent model": [transformers.RwkvConfig(
                   vocab_size=64, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
                   intermediate_size=32)],
               "roberta: positions from the input ids": [transformers.RobertaConfig(
                   is_decoder=True, num_hidden_layers=1, intermediate_size=32, **small)],
               "state-space": [transformers.MambaConfig(vocab_size=64, hidden_size=16,
                                                        num_hidden_layers=1)],
               # (all of transformers 5.25's causal LMs: what the probe alone had caught,
               # and Doge, whose 2,048-key window the probe's 9 tokens never reach)
               "bart: positions by cache length": [transformers.BartConfig(
                   vocab_size=64, d_model=16, decoder_layers=1, encoder_layers=1,
                   decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=32,
                   encoder_ffn_dim=32)],
               "doge: past keep_window_size keys": [transformers.DogeConfig(
                   num_hidden_layers=1, intermediate_size=32, **small)]}
    for match, cfgs in configs.items():
        for cfg in cfgs:
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            for build in (HFRunner, lambda m: SpecDecoder(m, "cl100k")):
                with pytest.raises(ValueError, match=f"model: .*{match}"):
                    build(model)


class _LlamaByCacheLength(transformers.LlamaForCausalLM):
    """A "new architecture" no list names: it places tokens by the cache's length, as
    Marian or Pegasus do, not by the position ids it is given."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


class _LlamaWithout4dMasks(transformers.LlamaForCausalLM):
    def forward(self, *args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            raise RuntimeError("expected a 2-D padding mask")
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_the_probe_detects_what_no_list_names(monkeypatch):
    """``check_hf_probe`` runs a ragged batch, a tree with a decoy branch, a commit and a
    second step, against the model's own forward: the supported models agree to summation
    order (float32 and bfloat16), a model that ignores the position ids (not in the list of
    architectures) is refused by the probe alone, by ``SpecDecoder``'s constructor too, as
    are the listed architectures once the list is emptied; a forward that cannot take the
    tree's inputs is refused naming the model."""
    from agspec_gpu import SpecDecoder
    import agspec_gpu.runners.hf as hf

    for variant in VARIANTS:
        diff, noise = hf.probe_hf_model(model_for(variant))
        assert diff < 1e-5 and noise < 1e-5, (variant, diff, noise)
        hf.check_hf_probe(model_for(variant))
    hf.check_hf_probe(_tiny("llama", "sdpa").to(torch.bfloat16))
    # bounds: the precision's rounding (bfloat16: 4 and 8 steps of 2**-7), float32's floor,
    # TF32's step where a GPU's float32 matmuls take it, ten times the model's own noise
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert hf._probe_bounds(torch.bfloat16, cpu, 0.0) == (2 ** -5, 2 ** -4)
    assert hf._probe_bounds(torch.float32, cpu, 0.0) == (1e-4, 0.05)
    assert hf._probe_bounds(torch.float32, cpu, 1e-4) == (1e-3, 0.05)
    assert hf._tf32_matmuls() in (True, False)  # (reads this torch's setting, whichever)
    monkeypatch.setattr(hf, "_tf32_matmuls", lambda: True)
    assert hf._probe_bounds(torch.float32, gpu, 0.0) == (2 ** -8, 0.05)
    assert hf._probe_bounds(torch.float32, cpu, 0.0) == (1e-4, 0.05)
    monkeypatch.undo()
    small = dict(vocab_size=64, hidden_size=16, num_attention_heads=2)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, intermediate_size=32,
                                   **{**small, "vocab_size": 100_277})  # cl100k's, for the decoder
    torch.manual_seed(0)
    model = _LlamaByCacheLength(cfg).eval()
    hf.check_hf_model(model)  # nothing in the model's config tells
    diff, noise = hf.probe_hf_model(model)  # (a tiny random model: positions matter little)
    assert diff > 1e-4 and noise < 1e-6, (diff, noise)
    for build in (hf.check_hf_probe, lambda m: SpecDecoder(m, "cl100k")):
        with pytest.raises(ValueError, match="model: _LlamaByCacheLength does not place tokens "
                                             "by the position ids"):
            build(model)
    with pytest.raises(ValueError, match="model: _LlamaWithout4dMasks's forward failed on a "
                                         "draft tree .*RuntimeError: expected a 2-D"):
        hf.check_hf_probe(_LlamaWithout4dMasks(cfg).eval())
    full = _LlamaByCacheLength(cfg).eval()  # a device out of memory is no model fault

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room (simulated)")

    full.forward = out_of_memory
    with pytest.raises(torch.OutOfMemoryError, match="no room"):
        hf.check_hf_probe(full)
    monkeypatch.setattr(hf, "_UNSUPPORTED_TYPES", {})
    sizes = dict(vocab_size=64, d_model=16, decoder_layers=1, encoder_layers=1,
                 decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=32,
                 encoder_ffn_dim=32)
    # (RoBERTa: positions from the input ids, noise 1.2)
    for cfg in (transformers.RobertaConfig(is_decoder=True, num_hidden_layers=1,
                                           intermediate_size=32, **small),
                transformers.PegasusConfig(**sizes), transformers.BlenderbotConfig(**sizes)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with pytest.raises(ValueError, match="does not place tokens by the position ids"):
            hf.check_hf_probe(model)


def test_an_attention_implementation_without_4d_float_masks_is_refused():
    """flex_attention (the process died on the tree's mask) and the flash kernels cannot
    take a 4-D float mask: refused naming the setting."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_attention_heads=2,
                                   num_hidden_layers=1, intermediate_size=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        HFRunner(model)
    model.config._attn_implementation = "sdpa"
    HFRunner(model)


def test_growing_cache_layer_equals_concatenation():
    """The runner's cache layer appends in place, grows when full, and adopts tensors set
    from outside (a gather, a row selection) or narrowed views: its keys / values always
    equal a plain concatenation of what it was given."""
    from agspec_gpu.runners.hf import _growing_cache

    gen = torch.Generator().manual_seed(0)
    cache = _growing_cache()
    ref_k = ref_v = torch.zeros(2, 3, 0, 4)
    ptrs = []
    for step, (n, cut, select) in enumerate([(5, None, False), (300, None, False), (7, 250, False),
                                             (1, None, True), (400, 100, False), (0, None, False),
                                             (9, None, False)]):
        k, v = torch.randn(2, 3, n, 4, generator=gen), torch.randn(2, 3, n, 4, generator=gen)
        keys, values = cache.update(k, v, 0)
        ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v), f"step {step}"
        layer = cache.layers[0]
        ptrs.append(layer.keys.data_ptr())
        if cut is not None:  # narrowed, as commit does
            layer.keys, layer.values = layer.keys[:, :, :cut], layer.values[:, :, :cut]
            ref_k, ref_v = ref_k[:, :, :cut], ref_v[:, :, :cut]
        if select:  # a new tensor, as a row selection makes
            idx = torch.tensor([1, 0])
            layer.keys, layer.values = layer.keys[idx], layer.values[idx]
            ref_k, ref_v = ref_k[idx], ref_v[idx]
    # 5 tokens (capacity 261), +300 (grown), cut to 250 and +7, +1 (kept), rows selected
    # then +400 (adopted, grown), cut to 100 and +0, +9 (kept)
    assert ptrs[1] != ptrs[0] and ptrs[3] == ptrs[2] == ptrs[1]
    assert ptrs[4] != ptrs[3] and ptrs[6] == ptrs[5] == ptrs[4]


def test_plain_dynamic_cache_still_works(monkeypatch):
    """Where ``transformers`` has no ``layer_class_to_replicate`` hook the runner keeps a
    plain ``DynamicCache`` (its appends copy): prefill with kept KV, verify and commit give
    the model's own logits all the same."""
    import agspec_gpu.runners.hf as hf

    monkeypatch.setattr(hf, "_growing_cache", hf._new_cache)
    model = model_for(VARIANTS[0])
    first = HFRunner(model)
    roots = first.prefill(PROMPTS[:2]).argmax(-1).tolist()
    d = DraftBatch.from_lists([[(3, -1)], [(4, -1), (5, 0)]])
    res = greedy_accept(d, first.verify_padded(d, torch.tensor(roots)))
    first.commit(res)
    n_acc = res.num_accepted.tolist()
    ctxs = [PROMPTS[b] + [roots[b]] + res.output_ids[b, :n_acc[b]].tolist() for b in range(2)]
    assert first.seq_lens.tolist() == list(map(len, ctxs))
    kept = [first.session_kv(b, len(ctxs[b])) for b in range(2)]
    second = HFRunner(model)
    ctxs = [ctxs[0] + [7, 8], PROMPTS[2], ctxs[1] + [9]]
    logits = second.prefill(ctxs, past=[kept[0], None, kept[1]])
    for b, ctx in enumerate(ctxs):
        torch.testing.assert_close(logits[b], full_forward_last(model, ctx), atol=1e-4, rtol=0)
    roots = logits.argmax(-1).tolist()
    trees = [[(9, -1), (3, 0)], [(10, -1), (11, -1)], [(14, -1)]]
    check_verify_rows(model, second.verify_padded(DraftBatch.from_lists(trees),
                                                  torch.tensor(roots)), ctxs, roots, trees)
