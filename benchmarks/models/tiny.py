"""Tiny random-weight models built from configs, and transformers' greedy answer as the reference."""

from __future__ import annotations

from typing import Any

import torch

TINY_VOCAB = 512  # ids below 512 are real SmolLM2 tokens, so the real tokenizer decodes them
# 2 layers, 4 query heads over 2 KV heads; a larger init spreads logits so greedy ties are rare.
TINY_CONFIG: dict[str, Any] = dict(
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

    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**TINY_CONFIG)).eval()
    model.generation_config.eos_token_id = None
    return model


def bitnet_checkpoint(out: str, seed: int = 0, linear_class: str = "bitlinear", **overrides: Any) -> str:
    """A tiny random BitNet b1.58 checkpoint in `out`, as transformers packs one (linear_class
    bitlinear): each projection's float weight quantized to {-1, 0, +1} by its mean magnitude,
    packed four to a byte, with its `weight_scale`; untied lm_head and embeddings stay floats."""
    import json
    import os

    from safetensors.torch import save_file
    from transformers import BitNetConfig, BitNetForCausalLM
    from transformers.integrations.bitnet import pack_weights

    config = BitNetConfig(**{**TINY_CONFIG, "tie_word_embeddings": False, **overrides})
    torch.manual_seed(seed)
    state = {}
    for name, w in BitNetForCausalLM(config).state_dict().items():
        if name.endswith("_proj.weight"):
            scale = 1.0 / w.abs().mean().clamp(min=1e-5)
            state[name] = pack_weights((w * scale).round().clamp(-1, 1).to(torch.int8))
            state[name.replace(".weight", ".weight_scale")] = scale.reshape(1).float()
        else:
            state[name] = w.contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["architectures"] = ["BitNetForCausalLM"]
    raw["quantization_config"] = {
        "quant_method": "bitnet",
        "linear_class": linear_class,
        "quantization_mode": "offline",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return out


def stub_model(vocab_size: int, max_position_embeddings: int = 1024) -> torch.nn.Module:
    """A one-layer Llama of width 32 over a real tokenizer's vocabulary: for runs that exercise the
    engine's host side (protocol, scheduler, detokenizer), where the model's answer does not matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
    )
    return LlamaForCausalLM(config).eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, **generate_args: Any) -> list[int]:
    """transformers generate() for one request on the model's device, the reference every engine
    output is held to; `generate_args` go to generate() (e.g. `sequence_bias`)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **generate_args,
        )
    return out[0, len(prompt) :].tolist()


# The families served (scheduler/model/families.py PROVEN) and two refused: a config
# class and what a 2-layer GQA model of each needs beyond `tiny_model`'s common settings. Gemma
# needs head_dim (its default is 256); Granite's multipliers are set away from 1 so a forward
# that dropped one would show.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # The lean decoder's (scheduler/model/decoder.py):
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": 16}),
    # Unpacked (float projections, no quantization config): sub-layer norms and ReLU^2 only;
    # its packed ternary checkpoints: bitnet_checkpoint, tests/model/test_bitnet.py.
    "BitNetForCausalLM": ("BitNetConfig", {}),
    # transformers' forward:
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16}),
    "GemmaForCausalLM": ("GemmaConfig", {"head_dim": 16}),
    "Glm4ForCausalLM": ("Glm4Config", {}),
    "GraniteForCausalLM": (
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 4.0},
    ),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "Olmo3ForCausalLM": ("Olmo3Config", {}),
    "Phi3ForCausalLM": ("Phi3Config", {}),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {}),
    # Not served (tests/model/test_families.py checks the refusals):
    "Gemma2ForCausalLM": ("Gemma2Config", {"head_dim": 16}),
    "StableLmForCausalLM": ("StableLmConfig", {}),
}


def tiny_family(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A 2-layer GQA model of architecture `name` (a FAMILY_CONFIGS key) with random weights."""
    import transformers

    config_name, extra = FAMILY_CONFIGS[name]
    config = getattr(transformers, config_name)(**{**TINY_CONFIG, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config).eval()
    model.generation_config.eos_token_id = None
    return model
