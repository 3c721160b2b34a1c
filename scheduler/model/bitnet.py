"""BitNet b1.58 in the lean decoder: which projections are ternary, and the checks at load
(docs/bitnet.md).

transformers loads a BitNet checkpoint whose `quantization_config` names `linear_class:
bitlinear` with each projection a `BitLinear`: its weight packed four to a byte, one
`weight_scale`, activations quantized per token to int8 inside the layer. The decoder serves
those through `kernels.ternary.TernaryLinear`, bit for bit transformers' fp32 forward. A BitNet
model without a quantization config has plain `nn.Linear` projections and is served like any
lean model. `AutoBitLinear` (`linear_class: autobitlinear`) quantizes its activations in floats
with another order of operations; it is refused at load rather than served approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.kernels.pytorch.fused import rms_norm
from orcaserve.kernels.ternary import TernaryLinear

ARCHITECTURE = "BitNetForCausalLM"


def is_ternary(module: Any) -> bool:
    return type(module).__name__ == "BitLinear"


def check_bitnet(model: Any, device: Any) -> None:
    """Raise ValueError, at load, for a BitNet model the decoder cannot serve exactly, or on a
    device without a ternary kernel (the CPU has its C++ kernel and the PyTorch twin, a CUDA GPU
    the Triton kernel)."""
    for name, module in model.named_modules():
        if is_ternary(module) and getattr(device, "type", "cpu") not in ("cpu", "cuda"):
            raise ValueError(f"ternary (BitNet) projections are served on the CPU and CUDA GPUs, not {device}")
        kind = type(module).__name__
        if kind == "AutoBitLinear":
            raise ValueError(
                f"{name} is an AutoBitLinear (linear_class: autobitlinear), whose float activation "
                "quantization orcaserve does not reproduce; serve a checkpoint packed for BitLinear"
            )
        if is_ternary(module) and getattr(module, "rms_norm", None) is not None:
            raise ValueError(f"{name}: BitLinear with its own RMSNorm (use_rms_norm) is not served")
        if is_ternary(module) and getattr(module, "bias", None) is not None:
            raise ValueError(f"{name}: BitLinear with a bias is not served")


def projection(build: Callable[..., Any], *modules: Any, **kwargs: Any) -> Any:
    """The fused layer over `modules`: ternary where they are BitLinear, else `build(*modules, **kwargs)`."""
    ternary = [is_ternary(m) for m in modules]
    if not any(ternary):
        return build(*modules, **kwargs)
    if not all(ternary):
        raise ValueError("a fused projection mixes ternary and dense weights")
    fused = TernaryLinear.fuse([(m.weight, m.weight_scale) for m in modules])
    for m in modules:  # the packed copy is no longer read: the decoder holds the weights now
        m.weight = m.weight.new_empty(0)
    return fused


def relu2_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """BitNet's MLP activation: relu(gate)^2 * up, as transformers computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.square(F.relu(gate)) * up


def sub_normed(
    linear: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float, relu2: bool = False
) -> torch.Tensor:
    """linear(rms_norm(a, weight, eps)), a being x, or relu2_mul(x) where relu2 (no weight: no
    norm): BitNet's sub-layer norm before o_proj and down_proj. In the ternary layer's own call
    where it has one (`TernaryLinear.normed`), else op by op: the same bits either way."""
    if weight is not None and isinstance(linear, TernaryLinear):
        y = linear.normed(x, weight, eps, relu2)
        if y is not None:
            return y
    a = relu2_mul(x) if relu2 else x
    return linear(rms_norm(a, weight, eps) if weight is not None else a)
