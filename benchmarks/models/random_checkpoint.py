"""Build (once) and cache a random-weight Llama checkpoint of a real model's shapes, in bf16.

    checkpoint_path("1b", out)   # Llama-3.2-1B's shapes; `orcaserve-bench peers --models 1b` calls it

The 1B shape is Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied
embeddings, vocab 128256; 1.24 B parameters with the embedding). Weights are N(0, 0.02), so answers
are noise: throughput runs ignore EOS, and then weights do not change the work. The tokenizer is
SmolLM2's (the default model's), enough to encode prompts; ids past its 49,152 decode to nothing.
The smollm2-draft shape is SmolLM2-135M's width (hidden 576, 9 / 3 heads of 64, MLP 1536, its
vocabulary and tied embeddings) with 4 layers instead of 30: a draft for SmolLM2 in
`orcaserve-bench spec --agreement` (benchmarks/engine/spec_draft.py), 49 M parameters, 28 M of
them the embedding its lm_head reads. The 1b-draft shape is a draft for the 1B shape: its
vocabulary (128256, tied) at width 384 (6 heads of 64, 2 KV heads, MLP 1024) with 4 layers, 55.5 M
parameters, 49.3 M of them the embedding: 4.5 % of what a 1B forward reads (why this size:
docs/speculative-decoding.md "Benchmark"). `DRAFTS` names each target vocabulary's draft.
Cached under ~/.cache/orcaserve/random-<shape>/ and reused when its config is there.
"""

from __future__ import annotations

import os
from typing import Any

LLAMA_1B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
SHAPES: dict[str, dict[str, Any]] = {
    "1b": LLAMA_1B,
    "smollm2-draft": dict(
        hidden_size=576,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    # The 1B's vocabulary, positions and norms, narrower and 4 layers deep.
    "1b-draft": dict(
        LLAMA_1B,
        hidden_size=384,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
    ),
}
DRAFTS = {49152: "smollm2-draft", 128256: "1b-draft"}  # a target's vocabulary -> its draft's shape


def checkpoint_path(shape: str = "1b", out: str | None = None) -> str:
    """The cached checkpoint's directory, built first if missing."""
    out = out or os.path.join(os.path.expanduser("~/.cache/orcaserve"), f"random-{shape}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from orcaserve.scheduler import default_model_path

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], initializer_range=0.02, bos_token_id=1, eos_token_id=2)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).bfloat16().eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
    return out


def with_tokenizer(path: str, tokenizer: Any, name: str) -> str:
    """`path`'s weights and config (linked) beside `tokenizer` (saved), cached as random-<name>: a
    draft for a GGUF target, whose tokenizer as read from the file (llama.cpp's converter pads the
    vocabulary with [PAD] tokens) is not the checkpoint's."""
    out = os.path.join(os.path.dirname(path), f"random-{name}")
    if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
        os.makedirs(out, exist_ok=True)
        for f in ("config.json", "generation_config.json", "model.safetensors"):
            if not os.path.exists(os.path.join(out, f)):
                os.symlink(os.path.join(path, f), os.path.join(out, f))
        tokenizer.save_pretrained(out)
    return out
