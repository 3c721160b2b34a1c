"""One LoRA adapter in PEFT's format, read and checked against the base model at load.

A directory holds `adapter_config.json` and `adapter_model.safetensors` (what PEFT's
`save_pretrained` writes). What is served (docs/lora.md "What an adapter may be"): plain LoRA
(`peft_type` LORA) on the decoder layers' q/k/v/o and gate/up/down projections, one rank `r` up to
`max_lora_rank`, scale `lora_alpha / r` or with rsLoRA `lora_alpha / sqrt(r)`. Anything else
PEFT can express (DoRA, biases, per-module ranks, embeddings, modules to save, ...) changes the
answer in a way this engine does not compute: such an adapter is refused with an `AdapterError`
naming what is wrong, never served approximately.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# The projections an adapter may target, and the decoder block each sits in.
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: the adapter's name is stripped, the wrapped model's prefix kept.
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config entries that change the computation; each must be absent or hold its neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "trainable_token_indices": (None, {}, []),
    "alora_invocation_tokens": (None, []),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "use_bdlora": (None, False),
    "arrow_config": (None,),
    "kasa_config": (None,),
    "monteclora_config": (None,),
    "velora_config": (None,),
}


class AdapterError(ValueError):
    """An adapter that cannot be served exactly (malformed, mismatched or oversized); raised at load."""


@dataclass(frozen=True)
class ModuleShapes:
    """What an adapter must fit: the base model's layer count and each target's (in, out) width."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # module name -> (in_features, out_features)

    @classmethod
    def of(cls, model: Any) -> ModuleShapes:
        """From a transformers decoder, before the lean decoder takes its projections over."""
        layers = model.model.layers
        shapes = {}
        for name, block in TARGETS.items():
            lin = getattr(getattr(layers[0], block), name)
            shapes[name] = (lin.in_features, lin.out_features)
        return cls(len(layers), shapes)


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: its rank, its scale and per (layer, module) PEFT's two weights."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # -> (A [r, in], B [out, r])

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def digest(self) -> str:
        """What the adapter computes, as a hash (its rank, scale and weights): an adapter read again
        from disk must be the one first read (runtime.py)."""
        h = hashlib.sha256(f"{self.rank} {self.scale!r}".encode())
        for key, pair in sorted(self.weights.items()):
            h.update(repr(key).encode())
            for t in pair:
                h.update(t.detach().cpu().flatten().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def load_adapter(
    name: str, path: str, base: ModuleShapes, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoraAdapter:
    """Read the adapter at `path` (a directory), check it against `base` and `max_rank`, and keep its
    weights in `dtype` on `device`. Raises AdapterError naming the adapter and what is wrong."""

    def refuse(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {why}")

    config = _read_config(path, refuse)
    rank, scale = _rank_and_scale(config, max_rank, refuse)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise refuse(f"no {WEIGHTS_FILE} (PEFT's save_pretrained writes it; .bin adapters are not read)")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise refuse(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise refuse(f"tensor {key!r} is not a LoRA weight of a decoder projection ({', '.join(TARGETS)})")
        layer, block, module, half = int(m[1]), m[2], m[3], m[4]
        if TARGETS.get(module) != block:
            raise refuse(f"tensor {key!r} targets {block}.{module}; supported: {', '.join(TARGETS)}")
        if layer >= base.num_layers:
            raise refuse(f"tensor {key!r} is for layer {layer}, the base model has {base.num_layers} layers")
        in_f, out_f = base.shapes[module]
        want = (rank, in_f) if half == "A" else (out_f, rank)
        if tuple(tensor.shape) != want:
            raise refuse(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {want} (rank {rank})")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise refuse(f"tensor {key!r} is not finite floating point")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    _check_targets(config, {module for _, module in halves}, refuse)
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"layer {layer} {module} has lora_{''.join(pair)} without its other half")
        a, b = (pair[h].to(device=device, dtype=dtype).contiguous() for h in "AB")
        weights[layer, module] = (a, b)
    return LoraAdapter(name, path, rank, scale, weights)


def _read_config(path: str, refuse) -> dict:
    if not os.path.isdir(path):
        raise refuse("not a directory (an adapter is a directory with adapter_config.json)")
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise refuse(f"no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise refuse(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config['peft_type']!r}: only LORA adapters are served")
    for key, neutral in _NEUTRAL.items():
        if key in config and config[key] not in neutral:
            raise refuse(f"{key}={config[key]!r} is not supported (docs/lora.md)")
    return config


def _rank_and_scale(config: dict, max_rank: int, refuse) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is above max_lora_rank={max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise refuse(f"use_rslora must be true or false, got {rslora!r}")
    return rank, (alpha / math.sqrt(rank) if rslora else alpha / rank)


def _check_targets(config: dict, found: set[str], refuse) -> None:
    """`target_modules` as a list must name supported projections and cover what the file holds;
    as a string (PEFT's regex form) the file's tensors, checked above, decide."""
    targets = config.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise refuse(f"target_modules must be module names, got {targets!r}")
        names = {t.rsplit(".", 1)[-1] for t in targets}  # a full path's last part is the module
        unsupported = sorted(names - set(TARGETS))
        if unsupported:
            raise refuse(f"target_modules {unsupported} not supported; supported: {', '.join(TARGETS)}")
        if not found <= names:
            raise refuse(f"weights for {sorted(found - names)} not named in target_modules {sorted(names)}")
    elif not isinstance(targets, str):
        raise refuse(f"target_modules must be a list of module names, got {targets!r}")
