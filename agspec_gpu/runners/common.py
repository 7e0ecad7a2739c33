"""What every verifier checks before a tree step (HF runner and paged batch alike)."""

from __future__ import annotations

import torch

from agspec_gpu.draft_batch import DraftBatch


def check_verify_call(draft: DraftBatch, root_ids: torch.Tensor, *, batch_size: int,
                      has_batch: bool, pending: bool) -> tuple[int, int]:
    """Raises ValueError naming the argument for a verify call that cannot run; ``(B, N)``.

    ``has_batch``: a prefill started the batch; ``pending``: a verify awaits its commit.
    """
    if not has_batch:
        raise ValueError("no batch: call prefill() first")
    if pending:
        raise ValueError("verify() called twice without commit()")
    B, N = draft.token_ids.shape
    if B != batch_size:
        raise ValueError(f"draft: batch {B} != prefilled batch {batch_size}")
    if root_ids.shape != (B,):
        raise ValueError(f"root_ids: expected [{B}], got {list(root_ids.shape)}")
    return B, N


def check_lengths_settled(owed: bool, name: str) -> None:
    """Raises ValueError for ``name()`` between a runner's ``commit_kv()`` and its
    ``commit_lengths()``: the host lengths that size the next step are not known yet."""
    if owed:
        raise ValueError(f"{name}() between commit_kv() and commit_lengths()")


def rope_type(config) -> str:
    """The RoPE scaling type of a ``transformers`` (text) config (``"default"`` without
    one), under transformers 5's ``rope_parameters`` or 4.x's ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {}) or \
        dict(getattr(config, "rope_scaling", None) or {})
    return params.get("rope_type", params.get("type", "default"))


def has_non_full_attention(config) -> bool:
    """Whether a ``transformers`` (text) config has a layer that does not attend to every
    earlier token: a non-``full_attention`` layer type, or a sliding window in use."""
    layer_types = getattr(config, "layer_types", None) or []
    if layer_types:
        return any(t != "full_attention" for t in layer_types)
    return getattr(config, "use_sliding_window", True) and \
        getattr(config, "sliding_window", None) is not None


def model_vocab_sizes(model) -> tuple[int, int | None]:
    """``(scored, embedded)``: the ids a causal LM scores (its output layer's rows, the
    logits' width; else its text config's ``vocab_size``) and the ids its input embedding
    holds (None: not known). A composite config (Fuyu, GotOcr2, Gemma-3's conditional
    generation) keeps ``vocab_size`` in its text config only; Mllama's embedding holds 8
    ids more than its head scores."""
    try:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") \
            else None
    except NotImplementedError:
        head = None
    rows = getattr(head, "out_features", None)  # (a packed 4-bit head's weight is not [V, H])
    weight = getattr(head, "weight", None)
    if isinstance(rows, int) and rows > 0:
        scored = rows
    elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
        scored = int(weight.shape[0])
    else:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        scored = int(getattr(config, "vocab_size", 0) or 0)
    try:  # (transformers' base raises for an embedding under a name it does not know)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:
        emb = None
    embedded = getattr(emb, "num_embeddings", None)
    return scored, embedded if isinstance(embedded, int) else None


def model_max_length(model) -> int | None:
    """The most tokens a sequence of ``model`` may hold (its positions ``0 .. n - 1``), as a
    serving engine derives it: the text config's ``max_position_embeddings`` (GPT-2's
    ``n_positions``), times the factor of a ``yarn`` or ``linear`` RoPE scaling (``yarn``
    from its ``original_max_position_embeddings``); ``llama3`` and ``longrope`` configs give
    the extended length already (a ``dynamic`` one, whose frequencies move with the length,
    both runners refuse). None: the config names no limit."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
        if kind in ("yarn", "linear") and isinstance(factor, (int, float)) and \
                factor > 1:
            base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
            n = max(n, int((base if isinstance(base, int) and base > 0 else n) * factor))
    return n
