"""Tree verification through any Hugging Face causal LM's own forward (CPU or GPU reference).

:class:`HFRunner` keeps one batch of requests: ``prefill`` the prompts, then per step
``verify`` a :class:`~agspec_gpu.draft_batch.DraftBatch` rooted at each request's last
committed token, accept (:mod:`agspec_gpu.accept`), and ``commit`` the accepted path.

Tree attention goes through the model's forward as an explicit 4-D float mask
``[B, 1, q, past + q]`` (0 = attend, -inf = masked; float, not bool, because eager
attention adds the mask to the scores) with ``position_ids = prefix length + depth``, so the
model's own attention code (eager, sdpa, ...) runs unchanged.

Cache layout: one padded :class:`transformers.DynamicCache` for the batch, request ``b``'s
committed tokens in slots ``[0, seq_lens[b])`` and junk above. Its layers append in place
into spare capacity (not ``torch.cat``) and ``commit`` moves only the accepted slots, so a
step does not copy the cache: its cost is the forward's own. Why one padded cache rather
than a list of per-request caches: the batch stays one forward (the clean batched path), and
junk slots get a -inf mask entry, so their softmax weight is exactly 0.0 and they add exact
zeros to the attention sums: the result equals an unpadded run up to the floating-point
summation order of the kernels, which also differs between a one-token decode step and a
tree step and is therefore no extra source of mismatch. Every real query row sees at least
itself, so no row is fully masked (that would give NaN).

The root (last committed token) is not in the cache until it is verified: ``prefill`` caches
the whole prompt and returns its last logits, the caller picks the first token, and that
token is the first root.

Between batches a request's committed KV can be kept (:meth:`HFRunner.session_kv`, a
:class:`SessionKV` of its own, unpadded) and handed to a later ``prefill``, which then
computes only the tokens after it (a multi-turn session's new tool output, not its whole
context again).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch

from agspec_gpu.accept import AcceptResult, flatten_tree_logits
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import to_device
from agspec_gpu.runners.common import (check_lengths_settled, check_verify_call,
                                       has_non_full_attention, model_vocab_sizes,
                                       rope_type)


def _cache_kwarg(model: torch.nn.Module) -> str:
    # later transformers 5.x releases renamed `past_key_values` to `cache` (the old name is
    # deprecated; 5.25 has `cache`, 5.17 only `past_key_values`, as 4.x)
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _growing_cache():
    """A ``DynamicCache`` whose layers append in place (:func:`_growing_layer_class`); a
    plain one where this ``transformers`` has no ``layer_class_to_replicate`` hook."""
    cache = _new_cache()
    if getattr(cache, "layer_class_to_replicate", None) is not None and not cache.layers:
        cache.layer_class_to_replicate = _growing_layer_class()
    return cache


@functools.cache  # one class, made on first use (transformers is imported lazily)
def _growing_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` that appends into spare capacity instead of concatenating.

        ``keys`` / ``values`` are views ``[B, H_kv, length, head_dim]`` of a buffer with
        room for more slots; ``update`` writes the new states behind them (no copy of the
        cache) and grows the buffer by ``max(256, need // 8)`` slots when it is full. A
        caller that assigns other tensors to ``keys`` / ``values`` (a gather, a row
        selection) or narrows them (a view) keeps working: the next ``update`` appends in
        place to a prefix view of the buffer, and copies anything else into a new one.
        """

        _buffers: tuple[torch.Tensor, torch.Tensor] | None = None

        def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
            """Takes ``keys`` / ``values`` ``[B, H_kv, capacity, head_dim]`` (contiguous,
            their first ``length`` slots the cache) as the layer's buffers, without a copy."""
            if not getattr(self, "is_initialized", True):
                self.lazy_initialization(keys, values)
            self._buffers = (keys, values)
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not getattr(self, "is_initialized", True):
                self.lazy_initialization(key_states, value_states)
            new = key_states.shape[-2]
            held = (self.keys, self.values)
            length = self.keys.shape[2] if self.keys is not None and self.keys.dim() == 4 else 0
            if self._buffers is None or not length or not all(
                    x.data_ptr() == b.data_ptr() and x.stride() == b.stride()
                    and x.shape[:2] == b.shape[:2] and x.shape[3] == b.shape[3]
                    for x, b in zip(held, self._buffers)):
                self._buffers = None  # first call, or tensors set from outside: adopt them
            need = length + new
            if self._buffers is None or need > self._buffers[0].shape[2]:
                cap = need + max(256, need // 8)
                grown = []
                for x, s in zip(held, (key_states, value_states)):
                    buf = s.new_empty(s.shape[0], s.shape[1], cap, s.shape[3])
                    if length:
                        buf[:, :, :length] = x
                    grown.append(buf)
                self._buffers = (grown[0], grown[1])
            kb, vb = self._buffers
            kb[:, :, length:need] = key_states
            vb[:, :, length:need] = value_states
            self.keys, self.values = kb[:, :, :need], vb[:, :, :need]
            return self.keys, self.values

    return GrowingLayer


@dataclass(frozen=True)
class SessionKV:
    """One request's committed keys / values, kept between batches.

    Attributes:
        keys, values: per layer ``[H_kv, length, head_dim]`` (None for a layer that caches
            nothing), the request's first ``length`` tokens.
    """

    keys: tuple[torch.Tensor | None, ...]
    values: tuple[torch.Tensor | None, ...]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.keys + self.values
                   if x is not None)


def greedy_generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    eos_id: int | None = None) -> list[int]:
    """Plain greedy decoding of one request, one token per forward, with the model's own cache.

    The reference the speculative loop must reproduce. Argmax ties go to the lower token id.

    Returns:
        The ``max_new_tokens`` generated ids (prompt excluded), cut after ``eos_id`` if emitted.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    cache, kw = _new_cache(), _cache_kwarg(model)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1]
            tok = int(logits.argmax())  # reference loop: one host read per token is the point
            out.append(tok)
            if tok == eos_id:
                break
            ids = torch.tensor([[tok]], dtype=torch.long, device=device)
    return out


def _float_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bool [B, q, k]`` -> ``dtype [B, 1, q, k]``: 0 where allowed, -inf elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


# model types whose forward does not place tokens by the given position_ids and cache
# (audits ran ~80 architectures, then all 200 of transformers 5.25's causal LMs; these
# decode wrongly or crash; check_hf_probe catches all but doge, whose window reaches past
# its 9 tokens): what each does instead
_BY_INPUT_IDS = "positions from the input ids (after padding_idx), not position_ids"
_BY_LENGTH = "positions by cache length, not position_ids"
_UNSUPPORTED_TYPES = {
    "rwkv": "a recurrent model whose forward ignores the KV cache",
    "openai-gpt": "no KV cache", "xlstm": "a recurrent model (no KV cache)",
    "cpmant": "its own cache and logits layout",
    **dict.fromkeys(("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm",
                     "data2vec-text", "xlm-roberta-xl", "xmod"), _BY_INPUT_IDS),
    "marian": "sinusoidal positions by cache length, not position_ids",
    "pegasus": "sinusoidal positions by cache length, not position_ids",
    "blenderbot": "learned positions by cache length, not position_ids",
    **dict.fromkeys(("bart", "mbart", "mvp", "trocr", "plbart", "blenderbot-small",
                     "bigbird_pegasus", "roformer"), _BY_LENGTH),
    **dict.fromkeys(("prophetnet", "reformer", "xlm", "xlnet"),
                    "its own cache or attention layout (its forward fails on a draft tree)"),
    "llama4_text": "attention temperature by cache length, not position_ids",
    "doge": "past keep_window_size keys, a dynamic mask keeps the top keys by score, so "
            "what a token attends to depends on the cache and the tree",
}


_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
             torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def check_hf_model(model: torch.nn.Module) -> None:
    """Raises ValueError naming ``model`` unless :class:`HFRunner` verifies it exactly: its
    forward must place each token by the ``position_ids`` it is given and mask by the 4-D
    mask, in every layer. A sliding window, or another non-full layer, masks by cache slot;
    ALiBi (Bloom, MPT, Falcon with ``alibi``) and GPT-Neo's local layers read distances
    from cache slots, which a padded batch and a draft tree shift; the architectures of
    ``_UNSUPPORTED_TYPES`` place tokens by something else; a length-dependent RoPE
    (``longrope``, ``dynamic``) picks its frequencies by the forward's longest position;
    an attention implementation other than ``sdpa`` / ``eager`` cannot take the 4-D float
    mask. A model in training mode whose dropout is on (a module's, or its config's
    ``*dropout*`` / ``*pdrop*``) is refused too: its logits are random, so no output could
    equal greedy decoding's."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("model: expected a Hugging Face model with a .config")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if has_non_full_attention(text_config):
        raise ValueError("model: layers that do not attend to every earlier token (a sliding "
                         "window, local, linear or state-space layers) are not supported")
    model_type = getattr(text_config, "model_type", None)
    if model_type in _UNSUPPORTED_TYPES:
        raise ValueError(f"model: {model_type}: {_UNSUPPORTED_TYPES[model_type]}; not supported")
    if rope_type(text_config) in ("dynamic", "longrope"):
        raise ValueError(f"model: rope_type {rope_type(text_config)!r} picks its frequencies "
                         f"by the forward's longest position (a batch's other requests and a "
                         f"draft change them): not supported")
    attn = getattr(config, "_attn_implementation", None)
    if attn is not None and attn not in ("eager", "sdpa"):
        raise ValueError(f"model: attn_implementation={attn!r} cannot take the 4-D float "
                         f"mask a draft tree needs; load it with 'sdpa' or 'eager'")
    if model_type in ("bloom", "mpt") or getattr(text_config, "alibi", False):
        raise ValueError(f"model: {model_type} uses ALiBi (distances by cache slot), which "
                         f"padded batches and draft trees shift: not supported")
    if "local" in (getattr(text_config, "attention_layers", None) or ()):
        raise ValueError(f"model: {model_type} has local-attention layers (a window by "
                         f"cache slot): not supported")
    if model.training:  # dropout would make the target's logits random: no greedy to equal
        active = [f"{type(m).__name__}(p={m.p})" for m in model.modules()
                  if isinstance(m, _DROPOUTS) and m.p > 0]
        active += [f"config.{k}={v}" for k, v in vars(text_config).items()
                   if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0]
        if active:
            raise ValueError(f"model: in training mode, where its dropout ({active[0]}) "
                             f"makes every forward random; call model.eval() first")


class HFRunner:
    """Runs draft-tree verification for a batch of requests through a HF causal LM.

    Parameters:
        model: any ``*ForCausalLM`` whose forward takes ``input_ids``, a 4-D
            ``attention_mask``, ``position_ids`` and a cache, in eval mode, with full
            attention in every layer (sliding-window layers would need their own mask).

    Example::

        runner = HFRunner(model)
        root = runner.prefill([[1, 2, 3], [4, 5]]).argmax(-1)   # first new tokens
        while ...:
            draft = ...                                          # DraftBatch rooted at `root`
            logits = runner.verify(draft, root)                  # [total_q, V]
            res = greedy_accept(draft, logits, tree_qo_indptr(draft))
            runner.commit(res)
            root = res.bonus_ids()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        check_hf_model(model)
        if model.training:
            raise ValueError("model: call model.eval() first (dropout makes verification random)")
        self.model = model
        self._cache_kw = _cache_kwarg(model)
        self._keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._cache = None
        self._seq_lens: torch.Tensor | None = None   # int64 [B] committed tokens in the cache
        self._lens_host: list[int] = []              # the same on the host
        self._width = 0                              # cache slots (a shape, host-known)
        self._pending: tuple[int, int] | None = None  # (width before verify, q) until commit
        self._lengths_owed = False  # commit_kv() ran, commit_lengths() not yet

    @property
    def batch_size(self) -> int:
        return 0 if self._seq_lens is None else self._seq_lens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """``int64 [B]``: tokens of each request in the KV cache (prefix, excluding the root)."""
        if self._seq_lens is None:
            raise ValueError("no batch: call prefill() first")
        return self._seq_lens.clone()

    @property
    def seq_lens_host(self) -> list[int]:
        """:attr:`seq_lens` as a host list (kept beside it: no device read)."""
        return list(self._lens_host)

    def _forward(self, ids: torch.Tensor, allowed: torch.Tensor, pos: torch.Tensor,
                 **extra) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=_float_mask(allowed, self.dtype),
                         position_ids=pos, use_cache=True, **{self._cache_kw: self._cache},
                         **extra)
        return out.logits

    @torch.no_grad()
    def prefill(self, input_ids: list[list[int]],
                past: Sequence[SessionKV | None] | None = None) -> torch.Tensor:
        """Starts a new batch: caches every prompt, returns each prompt's last logits.

        The tokens past each request's kept KV are left-padded into one forward so that
        every last token is the last column (only ``[B, 1, V]`` logits are materialised),
        after the kept KV (left-aligned, zero padded, masked); then the cache is shifted
        into the left-aligned layout. A padding query row attends only to itself.

        Parameters:
            input_ids: ``B`` non-empty token lists (ragged).
            past: per request None or the KV of ``input_ids[b]``'s first ``past[b].length``
                tokens (``< len(input_ids[b])``, from :meth:`session_kv` of an earlier batch
                of this model): only the rest is computed.

        Returns:
            ``[B, V]`` logits after each full prompt (the first generated token's distribution).
        """
        if not input_ids or any(len(p) == 0 for p in input_ids):
            raise ValueError("input_ids: expected a non-empty list of non-empty prompts")
        B = len(input_ids)
        past = list(past) if past is not None else [None] * B
        if len(past) != B or any(kv is not None and not 0 < kv.length < len(p)
                                 for kv, p in zip(past, input_ids)):
            raise ValueError("past: one SessionKV or None per prompt, shorter than it")
        cached = [0 if kv is None else kv.length for kv in past]
        self._seq_lens, self._lens_host = None, []  # no batch until this one is cached
        new = [p[c:] for p, c in zip(input_ids, cached)]
        S, C = max(map(len, new)), max(cached)
        ids = torch.zeros(B, S, dtype=torch.long)
        for b, p in enumerate(new):  # host-side packing of host lists, once per batch
            ids[b, S - len(p):] = torch.tensor(p, dtype=torch.long)
        dev = self.device
        ids = ids.to(dev)
        n_new = torch.tensor(list(map(len, new)), dtype=torch.long, device=dev)   # [B]
        n_past = torch.tensor(cached, dtype=torch.long, device=dev)               # [B]
        pad = S - n_new
        t = torch.arange(S, device=dev)
        causal = t[None, :, None] >= t[None, None, :]                    # [1, q, k]
        real_key = t[None, None, :] >= pad[:, None, None]                # [B, 1, k]
        real_row = t[None, :, None] >= pad[:, None, None]                # [B, q, 1]
        old_key = torch.arange(C, device=dev)[None, None, :] < n_past[:, None, None]
        allowed = torch.cat([old_key & real_row, (causal & real_key) |
                             torch.eye(S, dtype=torch.bool, device=dev)], 2)
        pos = (n_past[:, None] + t[None, :] - pad[:, None]).clamp(min=0)
        self._cache, self._pending = self._cache_from(past, C, room=S), None
        extra = {"logits_to_keep": 1} if self._keep_kw else {}
        logits = self._forward(ids, allowed, pos, **extra)[:, -1]
        # left-align: new token w of request b moves from slot C + pad + w to n_past + w
        # (only the new tokens move); slots past the prompt are junk
        self._lens_host = [c + len(p) for c, p in zip(cached, new)]
        dst = n_past[:, None] + t[None, :]
        src = torch.where(t[None, :] < n_new[:, None], C + pad[:, None] + t[None, :], dst)
        self._move_slots(src, dst)
        self._narrow(max(self._lens_host))
        self._seq_lens, self._lengths_owed = n_past + n_new, False
        return logits

    def _cache_from(self, past: list[SessionKV | None], width: int, room: int):
        """A fresh cache holding each request's kept KV in slots ``[0, length)``, zeros up
        to ``width`` (masked), with ``room`` more slots (and the growth margin) before its
        layers grow."""
        cache = _growing_cache()
        kept = [(b, kv) for b, kv in enumerate(past) if kv is not None]
        if not kept:
            return cache
        grows = hasattr(getattr(cache, "layer_class_to_replicate", None), "adopt")
        for layer, (k0, v0) in enumerate(zip(kept[0][1].keys, kept[0][1].values)):
            if k0 is None:
                continue  # a layer that caches nothing
            cap = width + room + max(256, (width + room) // 8) if grows else width
            # slots past a request's KV up to width are read (masked: they must be finite);
            # those past width are written before anything reads them
            keys = k0.new_empty(len(past), k0.shape[0], cap, k0.shape[2])
            values = v0.new_empty(len(past), v0.shape[0], cap, v0.shape[2])
            for b, kv in enumerate(past):
                n = 0 if kv is None else kv.length
                if n:
                    keys[b, :, :n] = kv.keys[layer]
                    values[b, :, :n] = kv.values[layer]
                keys[b, :, n:width] = 0
                values[b, :, n:width] = 0
            if grows:  # the buffers become the layer's: no second copy
                while len(cache.layers) <= layer:
                    cache.layers.append(cache.layer_class_to_replicate())
                cache.layers[layer].adopt(keys, values, width)
            else:
                cache.update(keys, values, layer)
        return cache

    def session_kv(self, b: int, length: int, *, copy: bool = True) -> SessionKV:
        """Request ``b``'s first ``length`` committed KV slots (``length <= seq_lens[b]``;
        between :meth:`commit_kv` and :meth:`commit_lengths`, ``<= seq_lens_host[b]``,
        the lengths before that commit), to pass to a later :meth:`prefill` of the same
        model: a copy, or with ``copy=False`` views of this batch's cache (no copy, but
        they keep the whole cache alive: for a prefill that follows at once, after which
        this batch is done)."""
        if self._seq_lens is None:
            raise ValueError("session_kv: no batch: call prefill() first")
        # a pending verify appended its tree after the committed slots, a commit whose
        # lengths are owed its path after the host lengths: the slots below are intact
        if self._lengths_owed:  # (a call interrupted between the halves keeps these)
            committed = self._lens_host[b]
        else:
            committed = self._width if self._pending is None else self._pending[0]
        if not 0 < length <= committed:
            raise ValueError(f"length: {length} outside (0, {committed}]")

        def cut(x):
            if x is None or x.numel() == 0:
                return None
            return x[b, :, :length].clone() if copy else x[b, :, :length]

        layers = self._cache.layers
        return SessionKV(tuple(cut(getattr(la, "keys", None)) for la in layers),
                         tuple(cut(getattr(la, "values", None)) for la in layers), length)

    def select_rows(self, rows: list[int]) -> None:
        """Keeps requests ``rows`` (in that order) and drops the rest from the batch: a
        request that finished stops costing a padded row of every step's forward. All or
        nothing: every layer's kept rows are copied before any is replaced (for a moment
        the cache's memory and the kept rows' again), so a copy that runs out of memory
        leaves the batch as it was, and the KV a failed leave keeps for its sessions is
        theirs."""
        if self._seq_lens is None or self._pending is not None:
            raise ValueError("select_rows() needs a batch and no verify() pending")
        check_lengths_settled(self._lengths_owed, "select_rows")
        idx = to_device(rows, torch.int64, self.device)
        lens = [self._lens_host[b] for b in rows]
        width = max(lens)  # the slots past every kept request's length: unused
        layers = self._cached_layers()  # (every copy made before any is kept: one out of
        kv = [(la.keys[idx, :, :width], la.values[idx, :, :width]) for la in layers]  # memory
        seq_lens = self._seq_lens[idx]  # leaves the batch as it was)
        for layer, (keys, values) in zip(layers, kv):
            layer.keys, layer.values = keys, values
        self._lens_host, self._seq_lens, self._width = lens, seq_lens, width

    def _cached_layers(self) -> list:
        """The cache's layers that hold KV (a layer may cache nothing: KV sharing)."""
        return [la for la in self._cache.layers
                if getattr(la, "keys", None) is not None and la.keys.numel()]

    def _move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot ``dst[b, k]`` of request ``b`` <- slot ``src[b, k]`` (``int64 [B, K]``, all
        sources read before any write), in place."""
        B, K = src.shape
        for layer in self._cached_layers():  # keys/values: [B, H_kv, slots, head_dim]
            for t in (layer.keys, layer.values):  # (their head sizes may differ: MLA's)
                shape = (B, t.shape[1], K, t.shape[3])
                s, d = src[:, None, :, None].expand(shape), dst[:, None, :, None].expand(shape)
                t.scatter_(2, d, t.gather(2, s))

    def _narrow(self, width: int) -> None:
        """Keeps the first ``width`` slots of every layer (views)."""
        for layer in self._cached_layers():
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        self._width = width

    @torch.no_grad()
    def verify_padded(self, draft: DraftBatch, root_ids: torch.Tensor,
                      num_draft_host: int | None = None) -> torch.Tensor:
        """Runs ``[root, node_0, ..., node_{N-1}]`` per request in one forward (no host sync).

        Node ``j`` sits at position ``seq_lens[b] + depth(j)`` and attends to the cached
        prefix, the root, its ancestors and itself. The new keys/values are appended to the
        cache; :meth:`commit` keeps the accepted ones.

        Parameters:
            draft: ``B`` trees (``B`` = the prefilled batch).
            root_ids: ``int [B]`` last committed token per request (not yet in the cache).
            num_draft_host: unused (the paged batch's bucket choice; same interface).

        Returns:
            ``[B, 1+N, V]`` logits: row 0 the root's, row ``1+j`` node ``j``'s; rows of
            padding nodes are unspecified.
        """
        check_lengths_settled(self._lengths_owed, "verify")
        B, N = check_verify_call(draft, root_ids, batch_size=self.batch_size,
                                 has_batch=self._seq_lens is not None,
                                 pending=self._pending is not None)
        if draft.token_ids.device != self.device:
            raise ValueError(f"draft: on {draft.token_ids.device}, model on {self.device}")
        dev, T, q = self.device, self._width, 1 + N
        inp = draft.tree_inputs(root_ids, self._seq_lens)
        past = torch.arange(T, device=dev)[None, :] < self._seq_lens[:, None]      # [B, T]
        allowed = torch.cat([past[:, None, :].expand(B, q, T), inp.tree_mask], 2)
        logits = self._forward(inp.input_ids, allowed, inp.position_ids)
        self._pending, self._width = (T, q), T + q
        return logits

    def verify_rows(self, draft: DraftBatch, root_ids: torch.Tensor,
                    num_draft_host: int | None = None) -> tuple[torch.Tensor, None]:
        """:meth:`verify_padded` in the shape of ``PagedBatch.verify_rows``: ``(logits
        [B, 1+N, V], None)`` (the padded layout needs no ``qo_indptr``)."""
        return self.verify_padded(draft, root_ids, num_draft_host), None

    def verify(self, draft: DraftBatch, root_ids: torch.Tensor) -> torch.Tensor:
        """As :meth:`verify_padded`, flattened to ``[total_q, V]`` in request order.

        ``qo_indptr`` is :func:`agspec_gpu.accept.tree_qo_indptr` of ``draft``. The flat size
        is data-dependent, so this syncs once; ``verify_padded`` does not.
        """
        return flatten_tree_logits(self.verify_padded(draft, root_ids), draft.num_draft_tokens)

    def commit(self, result: AcceptResult, num_accepted_host: list[int] | None = None) -> None:
        """Keeps prefix + root + accepted path of the last verify in each request's cache
        (``num_accepted_host``: ``result.num_accepted`` if the caller read it already):
        :meth:`commit_kv` then :meth:`commit_lengths`."""
        self.commit_kv(result)
        self.commit_lengths(num_accepted_host)

    @torch.no_grad()
    def commit_kv(self, result: AcceptResult) -> None:
        """The commit's device half, reading nothing on the host (a loop queues it behind
        its read of the accepted tokens). The bonus token is not cached: it is the next
        root. In place: per layer one gather of the root's and the accepted nodes' slots
        (``[B, H_kv, 1 + D, head_dim]``, D the deepest path) and one scatter of them behind
        each request's prefix; the committed prefix is not copied. :meth:`commit_lengths`
        must follow before the batch verifies or drops rows again."""
        if self._pending is None:
            raise ValueError("commit() without a preceding verify()")
        T, q = self._pending
        B = self.batch_size
        if result.num_accepted.shape != (B,) or result.max_depth > q - 1:
            raise ValueError(f"result: expected batch {B} and depth <= {q - 1}, got "
                             f"{list(result.num_accepted.shape)} and {result.max_depth}")
        dev = self.device
        n_acc = result.num_accepted.long().to(dev)
        # column 0 the root (slot T), column k the k-th accepted node (slot T + 1 + node);
        # it goes to slot seq_len + k (distinct per request). Every source is read (one
        # gather) before any write (one scatter), so a write onto another column's source
        # is harmless; columns past a request's path copy a slot onto itself.
        k = torch.arange(1 + result.max_depth, device=dev)[None, :]
        nodes = result.accepted_nodes.long().to(dev).clamp(min=0)
        dst = self._seq_lens[:, None] + k
        src = torch.cat([torch.full((B, 1), T, dtype=torch.long, device=dev), T + 1 + nodes], 1)
        src = torch.where(k <= n_acc[:, None], src, dst)
        self._move_slots(src, dst)
        self._seq_lens, self._pending = self._seq_lens + 1 + n_acc, None
        self._lengths_owed = True

    def commit_lengths(self, num_accepted_host: list[int] | None = None) -> None:
        """The commit's host half: the committed lengths from ``num_accepted_host``
        (``result.num_accepted`` as host ints) or read from the device, and the cache
        narrowed (a view) to the longest."""
        if not self._lengths_owed:
            raise ValueError("commit_lengths() without a preceding commit_kv()")
        if num_accepted_host is None:
            lens_host = self._seq_lens.tolist()
        elif len(num_accepted_host) != self.batch_size:
            raise ValueError(f"num_accepted_host: {len(num_accepted_host)} counts for "
                             f"{self.batch_size} requests")
        else:
            lens_host = [n + 1 + a for n, a in zip(self._lens_host, num_accepted_host)]
        self._narrow(max(lens_host))
        self._lens_host, self._lengths_owed = lens_host, False



# the probe's bounds, relative to the largest logit: its difference from the model's own
# forward may be _PROBE_NOISE_FACTOR times the difference the model's own forward shows
# between two mask forms that must agree (other kernels' summation order: ~0 on a CPU),
# and at least _PROBE_EPS_FLOOR of the precision's rounding step (float32 runs on a CPU
# agree to ~2e-7; a half-precision GPU forward of another shape rounds anew) and
# _PROBE_FLOOR (a GPU's float32 kernels of other shapes: margin for them; a tiny random
# Llama that ignores the position ids differs by 5e-4); that noise itself at most
# _PROBE_EPS_CEILING steps and _PROBE_NOISE_CEILING: a forward whose logits move by more
# under the mask form (RoBERTa: 1.2, its positions come from the input ids) does not take
# what a tree is given
_PROBE_NOISE_FACTOR = 10.0
_PROBE_FLOOR, _PROBE_EPS_FLOOR = 1e-4, 4.0
_PROBE_NOISE_CEILING, _PROBE_EPS_CEILING = 5e-2, 8.0


def _tf32_matmuls() -> bool:
    """Whether CUDA float32 matmuls may round to TF32: the precision setting (``"none"``
    defers to the global one), or the legacy flag on a torch without it; True when torch
    cannot say (it refuses to read the legacy flag once the new setting was used)."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = getattr(matmul, "fp32_precision", None)
        if precision is None:
            return bool(matmul.allow_tf32)
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", "none")
        return precision == "tf32"
    except RuntimeError:
        return True  # (the looser bound: a refusal must mean a wrong placement)


def _probe_bounds(dtype: torch.dtype, device: torch.device, noise: float
                  ) -> tuple[float, float]:
    """``(difference bound, noise bound)`` of :func:`check_hf_probe` for a model of
    ``dtype`` on ``device``: float32 matmuls on a GPU that allows TF32 round at its step."""
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32 and device.type == "cuda" and _tf32_matmuls():
        eps = 2.0 ** -10
    return (max(_PROBE_FLOOR, _PROBE_EPS_FLOOR * eps, _PROBE_NOISE_FACTOR * noise),
            max(_PROBE_NOISE_CEILING, _PROBE_EPS_CEILING * eps))


def probe_hf_model(model: torch.nn.Module) -> tuple[float, float]:
    """``(difference, noise)``: how far :class:`HFRunner`'s logits are from the model's own
    forward over whole sequences on a fixed probe, and how far the model's own forward is
    from itself under the runner's mask form; both relative to the largest logit.

    Two requests of ragged prompts (4 and 2 tokens: one is left-padded) are prefilled, then
    a tree with a decoy branch before the true one (so the true path's cache slots are not
    its positions) is verified, a path committed and one more step verified: the prefill's
    last logits and every true-path row are compared with a plain forward of that request's
    tokens. ``noise`` compares that plain forward with the same forward given an explicit
    4-D float causal mask and position ids (the kernels a tree takes; no tree, no cache).
    A model whose forward places tokens by something other than ``position_ids`` and the
    mask (cache slots, input ids, the cache's length), or whose cache the runner lays out
    wrongly, differs by far more than ``noise``; see :func:`check_hf_probe`. Costs six
    forwards of at most 9 tokens.
    """
    return _probe(HFRunner(model))


@torch.no_grad()
def _probe(runner: HFRunner) -> tuple[float, float]:
    model, dev = runner.model, runner.device
    vocab = min((v for v in model_vocab_sizes(model) if v), default=None)
    if vocab is None:
        raise ValueError("model: no vocabulary size (no output layer, no config vocab_size)")
    ids = [(7 * i + 3) % vocab for i in range(1, 13)]
    a, b = ids[:9], ids[3:9]  # request 0: 4 prompt tokens; request 1: 2
    decoy = (a[5] + 1) % vocab

    def forward(x: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([x], device=dev)).logits[0].float()

    ref_a, ref_b = forward(a), forward(b)
    n = len(a)
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None]
    as_tree = model(input_ids=torch.tensor([a], device=dev),
                    attention_mask=_float_mask(causal, runner.dtype),
                    position_ids=torch.arange(n, device=dev)[None]).logits[0].float()
    got, want = [], []
    last = runner.prefill([a[:4], b[:2]])
    got += [last[0], last[1]]
    want += [ref_a[3], ref_b[1]]
    # request 0: root a[4], nodes decoy, a[5], a[6] (child of node 1), decoy's child;
    # request 1: root b[2], chain b[3], b[4]
    draft = DraftBatch.from_lists([[(decoy, -1), (a[5], -1), (a[6], 1), (a[7], 0)],
                                   [(b[3], -1), (b[4], 0)]], dev)
    rows = runner.verify_padded(draft, torch.tensor([a[4], b[2]], device=dev))
    got += [rows[0, 0], rows[0, 2], rows[0, 3], rows[1, 0], rows[1, 1], rows[1, 2]]
    want += [ref_a[4], ref_a[5], ref_a[6], ref_b[2], ref_b[3], ref_b[4]]
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=dev)
    runner.commit(AcceptResult(num_accepted=i32([2, 1]), accepted_nodes=i32([[1, 2], [0, -1]]),
                               output_ids=i32([[a[5], a[6], a[7]], [b[3], b[4], -1]]),
                               num_output=i32([3, 2])))
    # committed: request 0 a[:7], request 1 b[:4]; roots a[7], b[4]
    draft = DraftBatch.from_lists([[(a[8], -1)], [(b[5], -1)]], dev)
    rows = runner.verify_padded(draft, torch.tensor([a[7], b[4]], device=dev))
    got += [rows[0, 0], rows[0, 1], rows[1, 0], rows[1, 1]]
    want += [ref_a[7], ref_a[8], ref_b[4], ref_b[5]]
    g, w = torch.stack([x.float() for x in got]), torch.stack(want)
    scale = w.abs().amax().clamp(min=1e-30)
    return (float((g - w).abs().amax() / scale),
            float((as_tree - ref_a).abs().amax() / scale))


def check_hf_probe(model: torch.nn.Module) -> None:
    """Raises ValueError naming ``model`` when :func:`probe_hf_model` shows that its
    speculative output could not equal its greedy decoding: the difference exceeds the
    largest of ten times the noise, four rounding steps of the model's precision and
    ``1e-4`` (of the largest logit; bfloat16: 0.031), or the noise exceeds 0.05 (bfloat16:
    0.0625). Detects what :func:`check_hf_model`'s list of architectures cannot name (a
    new one); that check runs first, as :class:`HFRunner`'s refusal of a model in
    training mode. A model whose logits barely depend on where a token sits (a tiny random
    one in half precision) can pass with a wrong placement: the probe bounds the error,
    the list and the checks name the known causes."""
    runner = HFRunner(model)  # check_hf_model's refusals, and eval mode
    try:
        diff, noise = _probe(runner)
    except torch.OutOfMemoryError:  # the device's state, not the model's forms
        raise
    except Exception as e:  # its forward cannot take what verification passes it
        raise ValueError(f"model: {type(model).__name__}'s forward failed on a draft tree "
                         f"(4-D float mask, position ids, a cache): {type(e).__name__}: "
                         f"{e}") from e
    bound, noise_bound = _probe_bounds(runner.dtype, runner.device, noise)
    if not (diff <= bound and noise <= noise_bound):  # (NaN too)
        raise ValueError(f"model: {type(model).__name__} does not place tokens by the "
                         f"position ids and mask it is given: its logits on a draft tree "
                         f"differ from its own forward by {diff:.3g} of their range (bound "
                         f"{bound:.3g}), under a 4-D mask alone by {noise:.3g} (bound "
                         f"{noise_bound:.3g}); speculative output would not equal "
                         f"greedy decoding")
