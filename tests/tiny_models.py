"""Tiny random-weight models built from configs, and transformers' greedy answer as the reference."""

from __future__ import annotations

from typing import Any

import torch

TINY_VOCAB = 512  # ids below 512 are real SmolLM2 tokens, so the real tokenizer decodes them


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer GQA model with random weights; larger init spreads logits so greedy ties are rare."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**common)).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, **generate_args: Any) -> list[int]:
    """transformers generate() for one request, the reference every engine output is held to;
    `generate_args` go to generate() (e.g. `sequence_bias`)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **generate_args,
        )
    return out[0, len(prompt) :].tolist()
