"""Tiny random Llama / Qwen2 models from transformers, and a recorder, shared by the runner and
decoder tests."""

import torch
import transformers

# (architecture, attention implementation) pairs every lossless test covers
VARIANTS = [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "eager"), ("qwen2", "sdpa")]


def tiny_model(arch: str, attn: str, vocab: int, max_positions: int = 1 << 15) -> torch.nn.Module:
    """A 2-layer, 64-wide model with GQA (4 heads, 2 KV heads), seeded.

    ``initializer_range=0.1`` (larger than the default) so argmax gaps dwarf fp32 noise and
    greedy comparisons are not decided by summation order.
    """
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=max_positions, initializer_range=0.1)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation=attn).eval()


def record_fit_width(monkeypatch) -> list[tuple[int, int]]:
    """``(width asked, width given)`` of every ``PagedBatch.fit_width`` call from now on
    (given: None when not even the roots fit)."""
    from agspec_gpu.runners.paged_batch import PagedBatch

    fits, fit_width = [], PagedBatch.fit_width

    def recorded(self, width, make_room=None, num_draft=None):
        fits.append((width, fit_width(self, width, make_room, num_draft)))
        return fits[-1][1]

    monkeypatch.setattr(PagedBatch, "fit_width", recorded)
    return fits
