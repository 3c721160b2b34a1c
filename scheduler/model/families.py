"""The architectures orcaserve serves, each proven token-exact against transformers, and the check
at load that refuses the others (docs/serving.md "Supported architectures").

A model outside these lists may well run through the transformers fallback and answer fluent,
wrong text: a real Gemma 3 did, until its prompts got their BOS token back. So what has no
token-exact test (tests/model/test_families.py) is refused when the model loads, never mid-request;
`allow_unverified_architecture` lets a user try one at their own risk, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from orcaserve.scheduler.model.bitnet import ARCHITECTURE as BITNET
from orcaserve.scheduler.model.quantized import QUANTIZED

log = logging.getLogger(__name__)

# Served by the lean decoder (decoder.py), which reproduces these (SiLU MLP, no extra multipliers;
# BitNet's sub-layer norms, ReLU^2 and ternary projections: bitnet.py).
LEAN = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", BITNET)
_ACTIVATIONS = {BITNET: "relu2"}  # the MLP activation the decoder computes; else SiLU

# Served by transformers' own forward, attention routed through the paged cache (model_runner.py);
# each has a tiny random-weight model in benchmarks/models/tiny.py and passes tests/model/test_families.py.
FALLBACK = (
    "Gemma3ForCausalLM",
    "GemmaForCausalLM",
    "Glm4ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM",
)
PROVEN = LEAN + FALLBACK


def lean_supports(model: Any) -> bool:
    """True for the models the lean decoder (decoder.py) serves: its architectures, each with its
    MLP activation."""
    name = type(model).__name__
    return name in LEAN and getattr(model.config, "hidden_act", "silu") == _ACTIVATIONS.get(name, "silu")


class UnsupportedArchitecture(ValueError):
    """The model cannot be served exactly; raised at load."""


def check_architecture(model: Any, allow_unverified: bool = False) -> None:
    """Refuse, at load, a model whose answers orcaserve has not proven exact, or whose attention
    needs something the paged attention does not compute (a tiny random model cannot show those:
    its logits are too small for a soft cap to change a greedy token)."""
    name = type(model).__name__
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        # Gemma 2: tanh-capped attention scores; the paged kernels compute plain softmax(QK^T).
        raise UnsupportedArchitecture(
            f"{name} caps attention scores (attn_logit_softcapping={cfg.attn_logit_softcapping}), "
            "which orcaserve's paged attention does not compute"
        )
    if name in PROVEN:
        return
    message = (
        f"architecture {name} has not been proven token-exact in orcaserve; supported: {', '.join(sorted(PROVEN))}"
    )
    if not allow_unverified:
        raise UnsupportedArchitecture(message + " (allow_unverified_architecture: true serves it at your own risk)")
    log.warning("%s; serving it anyway because allow_unverified_architecture is set", message)


def check_quantization(model: Any, quantization: str | None) -> None:
    """Refuse, at load, quantized weights for a model served through transformers' forward: only
    the lean decoder runs the packed low-bit GEMMs (docs/serving.md "Quantized weights")."""
    bitnet_gguf = quantization == "gguf" and getattr(model, QUANTIZED, None) == "gguf"
    if quantization is not None and type(model).__name__ == BITNET and not bitnet_gguf:
        raise UnsupportedArchitecture(
            f"quantization={quantization!r} on a BitNet model: its projections are served from their own "
            "ternary weights, only the lm_head of a BitNet GGUF from its blocks (quantization: gguf, "
            'docs/bitnet.md "A quantized lm_head"); set quantization to null'
        )
    if quantization is not None and not lean_supports(model):
        raise UnsupportedArchitecture(
            f"quantization={quantization!r} is served by the lean decoder only ({', '.join(LEAN)}); "
            f"{type(model).__name__} runs through transformers' forward: set quantization to none"
        )


def length_cap(model: Any) -> int | None:
    """The max_model_len a model is held to because its path cannot apply its sliding window:
    the lean decoder attends to whole sequences, the same computation only while a sequence fits
    the window (Mistral v0.1, Qwen2 with use_sliding_window). transformers' forward passes each
    layer's window to the attention hook, which applies it (model_runner.py): no cap there."""
    return attention_window(model.config) if lean_supports(model) else None


def attention_window(cfg: Any) -> int | None:
    """The sliding window of a model whose layers (some or all) attend only to the last
    `sliding_window` positions, else None. `layer_types` says which layers slide (Gemma 3,
    Qwen2's use_sliding_window); configs without it slide everywhere when a window is set
    (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
