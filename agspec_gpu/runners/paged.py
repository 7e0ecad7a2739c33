"""A compact Llama / Qwen2 forward over the paged KV cache with tree attention.

One forward handles any planned step (:func:`agspec_gpu.tree.plan_tree`): prefill chunks (a
chain draft: causal), plain decode (no draft) and tree verification, for a ragged batch. Per
step: embed ``meta.input_ids``; per layer ``RMSNorm -> fused QKV (+ Qwen2 bias) -> RoPE at
meta.position_ids and K/V append at meta.kv_slots (one kernel) -> paged tree attention ->
o_proj``, then
``RMSNorm -> fused gate/up -> SiLU * up -> down``; final norm and LM head. The attention
backend is planned once per step and run per layer.

Weights come from a Hugging Face checkpoint folder (``config.json`` + safetensors) or an
instantiated ``transformers`` model; names follow ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``.

CUDA graphs: the step's inputs are the planner's fixed-capacity buffers
(:meth:`TreeMetadata.empty`), so a decode step is capturable:
:class:`agspec_gpu.runners.graphs.DecodeGraphs` captures the one-token decode step per batch
size (FlashInfer's decode kernel) and replays it.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from agspec_gpu.attention import SPLIT_MAX_QO_LEN, make_attention_backend
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.host import canonical_device
from agspec_gpu.kernels.rms_norm import rms_norm
from agspec_gpu.kernels.rope_append import rope_append
from agspec_gpu.kernels.silu_mul import silu_mul
from agspec_gpu.kv_cache import PagedKVCache
from agspec_gpu.runners.common import has_non_full_attention, rope_type
from agspec_gpu.tree import TreeMetadata, host_sizes, plan_tree


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Architecture numbers of a Llama-family decoder (read from a ``transformers`` config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_qo_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @staticmethod
    def from_hf_config(config) -> "ModelShape":
        """Raises ValueError for a config that is not a Llama-family decoder's."""
        check_architecture(config)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads", "rms_norm_eps")
                   if getattr(config, k, None) is None]
        if missing:
            raise ValueError(f"config ({getattr(config, 'model_type', type(config).__name__)}) "
                             f"is not a Llama/Qwen2-family decoder's: no {', '.join(missing)}")
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        return ModelShape(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_qo_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or
            config.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps)


# the model types whose forward the paged runner computes: Llama's (Qwen2's adds q/k/v
# biases, Mistral's a sliding window, refused below). Others that share Llama's weight names
# compute something else (Qwen3's q/k norms, Gemma's scaled embeddings and (1 + w) norms,
# Granite's multipliers), so a name check alone would run them, wrongly.
PAGED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def check_architecture(config) -> None:
    """Raises ValueError unless the paged runner computes ``config``'s model exactly: a
    Llama / Qwen2 / Mistral decoder with SiLU MLPs and full attention in every layer."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PAGED_MODEL_TYPES:
        raise ValueError(f"config: model_type {model_type!r}, the paged runner computes "
                         f"{', '.join(PAGED_MODEL_TYPES)} only (the hf runner takes others)")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config: hidden_act {act!r}, the paged runner's MLP is SiLU's")
    if has_non_full_attention(config):
        raise ValueError("config: sliding-window attention layers are not supported")


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [head_dim // 2], attention_scaling)`` for a config's RoPE.

    ``default`` is computed here; the static scalings (``llama3``, ``linear``, ``yarn``) use
    ``transformers``' own parameter functions, so they match the reference model exactly.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x names
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = rope_type(config)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if kind == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {kind!r} depends on the sequence length; unsupported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


@dataclass(slots=True)
class _Layer:
    """One decoder layer's weights (QKV and gate/up fused into one matmul each)."""

    input_norm: torch.Tensor  # [hidden]
    qkv_weight: torch.Tensor  # [(H_qo + 2 H_kv) D, hidden]
    qkv_bias: torch.Tensor | None  # [(H_qo + 2 H_kv) D] (Qwen2)
    o_weight: torch.Tensor  # [hidden, H_qo D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up_weight: torch.Tensor  # [2 I, hidden]
    down_weight: torch.Tensor  # [hidden, I]


def _add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + delta), x + delta)``; ``delta=None``: ``(rms_norm(x), x)``."""
    if delta is None:
        return rms_norm(x, weight, eps), x
    return rms_norm(delta, weight, eps, residual=x)


class PagedLlamaRunner:
    """Llama/Qwen2 decoder over a :class:`PagedKVCache` with tree attention.

    Parameters
    ----------
    config
        The ``transformers`` config (``LlamaConfig``, ``Qwen2Config``, ...).
    weights : Mapping[str, Tensor]
        A ``LlamaForCausalLM``-style state dict (``model.layers.{i}.self_attn.q_proj.weight``,
        ...); ``lm_head.weight`` falls back to the embeddings when tied.
    num_pages, page_size : int
        KV pool size; ``max_seqs`` / ``max_pages_per_seq`` bound the page tables.
    device, dtype
        Where and in which dtype weights, activations and KV live.
    split_attention : bool
        Verify trees with a split attention (:mod:`agspec_gpu.attention`): the prefix
        unmasked, the tree apart, merged. Prefill chunks (:meth:`prefill`) and steps of
        more than ``SPLIT_MAX_QO_LEN`` rows per request keep the custom mask: the tree
        kernel has no tensor cores.

    Example
    -------
    From a local checkpoint folder (HF config and safetensors; nothing is downloaded)::

        runner = PagedLlamaRunner.from_pretrained("/models/Qwen2.5-0.5B", num_pages=4096,
                                                  device="cuda")
        last_logits = runner.prefill(["s0"], [prompt_ids])               # [1, vocab]
        meta = runner.plan(["s0"], draft, root_ids, prefix_lens)         # a tree step
        logits = runner.forward(meta)                                    # [meta.capacity_q, V]
    """

    def __init__(self, config, weights: Mapping[str, torch.Tensor], *, num_pages: int,
                 page_size: int = 16, max_seqs: int = 256, max_pages_per_seq: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 split_attention: bool = True) -> None:
        self.shape = s = ModelShape.from_hf_config(config)
        self.device, self.dtype = canonical_device(device), dtype
        self.page_size = page_size

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weights: missing {name!r}")
            return weights[name].to(self.device, dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = maybe("lm_head.weight")
        if self.lm_head is None or getattr(config, "tie_word_embeddings", False):
            self.lm_head = self.embed
        self.final_norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            if maybe(p + "mlp.gate_proj.bias") is not None:
                raise ValueError("MLP biases are not supported")
            biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            if any(b is None for b in biases) and any(b is not None for b in biases):
                raise ValueError(f"layer {i}: some of q/k/v have a bias, others not")
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv_weight=torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                qkv_bias=None if biases[0] is None else torch.cat(biases),
                o_weight=w(p + "self_attn.o_proj.weight"),
                o_bias=maybe(p + "self_attn.o_proj.bias"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up_weight=torch.cat([w(p + "mlp.gate_proj.weight"),
                                          w(p + "mlp.up_proj.weight")]),
                down_weight=w(p + "mlp.down_proj.weight")))
        inv_freq, self.rope_scaling = rope_inv_freq(config, s.head_dim)
        self.inv_freq = inv_freq.to(self.device)  # fp32 [D / 2]
        self.kv_cache = PagedKVCache(s.num_layers, num_pages, page_size, s.num_kv_heads,
                                     s.head_dim, dtype, self.device, max_seqs=max_seqs,
                                     max_pages_per_seq=max_pages_per_seq)
        self.attention = make_attention_backend(self.device, s.num_qo_heads, s.num_kv_heads,
                                                s.head_dim, page_size, dtype=dtype,
                                                sm_scale=s.head_dim ** -0.5,
                                                split=split_attention)

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module, **kwargs) -> "PagedLlamaRunner":
        """Takes config and weights from an instantiated ``transformers`` causal LM."""
        param = next(model.parameters())
        kwargs.setdefault("device", param.device)
        kwargs.setdefault("dtype", param.dtype)
        return cls(model.config, model.state_dict(), **kwargs)

    @classmethod
    def from_pretrained(cls, folder: str | Path, **kwargs) -> "PagedLlamaRunner":
        """Loads ``config.json`` and the ``*.safetensors`` shards of a checkpoint folder."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder = Path(folder)
        config = AutoConfig.from_pretrained(folder)
        index = folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
            if index.exists() else ["model.safetensors"]
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(folder / f))
        return cls(config, weights, **kwargs)

    # ------------------------------------------------------------------ forward

    def plan(self, seq_ids: Sequence[Hashable], draft: DraftBatch, root_ids: torch.Tensor,
             prefix_lens: torch.Tensor, *, prefix_lens_host: Sequence[int] | None = None,
             num_slots_host: Sequence[int] | None = None,
             num_draft_host: Sequence[int] | None = None,
             out: TreeMetadata | None = None,
             max_total_q: int | None = None, split: bool = True) -> TreeMetadata:
        """Allocates pages for a step of ``seq_ids`` and plans it (:func:`plan_tree`).

        Each sequence gets room for ``num_slots_host[b]`` slots (at least ``prefix_len + 1 +
        num_draft_tokens[b]``; default that, from ``num_draft_host``, else ``prefix_len + 1 +
        draft.max_nodes``, which needs no read of the draft); the host lengths come from
        ``prefix_lens_host`` (or, with a sync, from ``prefix_lens``). ``max_total_q``: the
        step's query rows when the caller knows them (the forward then runs on those rows,
        not on ``B * (1 + max_nodes)``).
        ``num_draft_host``: ``draft.num_draft_tokens`` as host ints, if the caller holds them:
        FlashInfer then plans without reading the device (``TreeMetadata.maybe_host``).
        ``split=False``: the custom mask even where the runner splits (a prefill chunk).
        """
        if prefix_lens_host is None:
            prefix_lens_host = prefix_lens.tolist()
        if num_slots_host is None:
            nodes = [draft.max_nodes] * len(prefix_lens_host) if num_draft_host is None \
                else num_draft_host
            num_slots_host = [p + 1 + int(n) for p, n in zip(prefix_lens_host, nodes)]
        self.kv_cache.allocate_many(seq_ids, num_slots_host)
        # only the pages this step can touch: the width bounds the mask buffer and the grid
        width = -(-(max(prefix_lens_host) + 1 + draft.max_nodes) // self.page_size)
        page_table = self.kv_cache.page_table(seq_ids)[:, :width].contiguous()
        host = None if num_draft_host is None else \
            host_sizes(num_draft_host, prefix_lens_host, self.page_size)
        return plan_tree(draft, root_ids.to(self.device, torch.int32),
                         prefix_lens.to(self.device, torch.int32), page_table, self.page_size,
                         out=out, max_total_q=max_total_q, host=host,
                         prefix_pages=split and self.splits(draft.max_nodes))

    def splits(self, max_nodes: int) -> bool:
        """Whether steps of trees of up to ``max_nodes`` nodes attend split (the backend was
        built so, and the trees are small)."""
        return self.attention.split and 1 + max_nodes <= SPLIT_MAX_QO_LEN

    @torch.inference_mode()
    def forward(self, meta: TreeMetadata, *, logit_rows: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Runs every query row of a planned step and writes their KV.

        Parameters
        ----------
        meta : TreeMetadata
        logit_rows : ``int [K]``, optional
            Only these query rows go through the LM head (prefill needs the last row only).
        out : ``[meta.capacity_q, vocab]`` (or ``[K, vocab]``) in ``dtype``, optional
            Where the LM head writes (a graph's buffer that several graphs share).

        Returns
        -------
        ``[meta.capacity_q, vocab]`` logits in ``dtype`` (or ``[K, vocab]``); row
        ``meta.qo_indptr[b] + r`` is tree row ``r`` of request ``b`` (padding rows: junk).
        """
        s = self.shape
        Q, H, Hkv, D = meta.capacity_q, s.num_qo_heads, s.num_kv_heads, s.head_dim
        self.attention.plan(meta)
        # RoPE tables for this step: [Q, D], fp32 angles then the compute dtype (as HF does)
        angles = meta.position_ids.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos = (angles.cos() * self.rope_scaling).to(self.dtype)
        sin = (angles.sin() * self.rope_scaling).to(self.dtype)
        slots = self.kv_cache.slots_of(meta)  # the same KV slots in every layer
        eps = s.rms_norm_eps

        # one kernel each on a GPU: RMSNorm fused with the residual add before it, RoPE with
        # the KV append, SiLU * up (kernels/rms_norm.py, rope_append.py, silu_mul.py). The
        # residual stream is x; each sublayer's output joins it inside the next norm.
        x = self.embed[meta.input_ids.long()]  # [Q, hidden]
        delta = None  # the last sublayer's output, not yet added to x
        for i, layer in enumerate(self.layers):
            h, x = _add_norm(x, delta, layer.input_norm, eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            # RoPE of q and k, k and v into the step's cache slots; q contiguous for attention
            q = rope_append(qkv, cos, sin, *slots, self.kv_cache.layer(i), H, Hkv)
            o = self.attention.run(q, self.kv_cache.layer(i))
            delta = F.linear(o.view(Q, H * D), layer.o_weight, layer.o_bias)
            h, x = _add_norm(x, delta, layer.post_norm, eps)
            delta = F.linear(silu_mul(F.linear(h, layer.gate_up_weight)), layer.down_weight)
        h, _ = _add_norm(x, delta, self.final_norm, eps)
        if logit_rows is not None:
            h = h[logit_rows.long()]
        if out is None:
            return F.linear(h, self.lm_head)
        return torch.mm(h, self.lm_head.t(), out=out)  # F.linear's product, into out

    @torch.inference_mode()
    def prefill(self, seq_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]],
                prefix_lens: Sequence[int] | None = None, *,
                chunk_size: int = 512) -> torch.Tensor:
        """Writes the KV of ``token_lists`` after each sequence's ``prefix_lens`` tokens.

        Runs through :meth:`forward` as chain drafts (a chain's tree mask is causal), at most
        ``chunk_size`` tokens per sequence per forward, which bounds the packed mask
        (``chunk_size * kv_len / 8`` bytes per sequence).

        Returns
        -------
        ``[B, vocab]`` logits after each sequence's last token.
        """
        B = len(seq_ids)
        if B == 0 or len(token_lists) != B or any(len(t) == 0 for t in token_lists):
            raise ValueError("token_lists: one non-empty list per sequence expected")
        V = self.shape.vocab_size
        if any(min(t) < 0 or max(t) >= V for t in token_lists):
            raise ValueError(f"token_lists: token ids must be in [0, {V})")
        if prefix_lens is not None and len(prefix_lens) != B:
            raise ValueError(f"prefix_lens: {len(prefix_lens)} lengths for {B} sequences")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        done = list(prefix_lens) if prefix_lens is not None else [0] * B
        last = torch.empty(B, self.shape.vocab_size, dtype=self.dtype, device=self.device)
        for start in range(0, max(len(t) for t in token_lists), chunk_size):
            active = [b for b in range(B) if start < len(token_lists[b])]
            chunks = [list(token_lists[b][start:start + chunk_size]) for b in active]
            n = max(len(c) for c in chunks)
            tokens = torch.full((len(active), n), PAD_ID, dtype=torch.int32)
            parents = torch.full((len(active), n), PAD_ID, dtype=torch.int32)
            for row, c in enumerate(chunks):  # a chain: node j's parent is node j - 1
                tokens[row, :len(c) - 1] = torch.tensor(c[1:], dtype=torch.int32)
                parents[row, :len(c) - 1] = torch.arange(-1, len(c) - 2, dtype=torch.int32)
            width = max(n - 1, 1)
            draft = DraftBatch(tokens[:, :width].contiguous().to(self.device),
                               parents[:, :width].contiguous().to(self.device),
                               torch.tensor([len(c) - 1 for c in chunks], dtype=torch.int32,
                                            device=self.device))
            roots = torch.tensor([c[0] for c in chunks], dtype=torch.int32)
            pre = [done[b] for b in active]
            # each sequence's own chunk, not the widest one's: a short prompt next to a long
            # one holds only its pages, and the forward runs on the chunks' rows only (a
            # continuation's one token next to a 500-token tool output: 501 rows, not 1,000)
            meta = self.plan([seq_ids[b] for b in active], draft, roots,
                             torch.tensor(pre, dtype=torch.int32), prefix_lens_host=pre,
                             num_slots_host=[p + len(c) for p, c in zip(pre, chunks)],
                             num_draft_host=[len(c) - 1 for c in chunks],
                             max_total_q=sum(map(len, chunks)), split=False)
            last[torch.tensor(active, device=self.device)] = self.forward(
                meta, logit_rows=meta.qo_indptr[1:] - 1)
            for b, c in zip(active, chunks):
                done[b] += len(c)
        return last
