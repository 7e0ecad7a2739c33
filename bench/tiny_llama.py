"""The tiny random Llama the CPU decoder benchmarks run: 2 layers, 64 wide, GQA 4:2, seeded,
with a real tokenizer's vocabulary (the time is then mostly its LM head over the rows a
forward carries: those benchmarks measure rows and forwards, not a GPU's speed)."""

from __future__ import annotations

import torch
import transformers


def tiny_llama(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1 << 17, initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()
