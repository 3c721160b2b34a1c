"""The lean decoder's layer as one C++ call (`torch.ops.orcaserve.decoder_layer`,
kernels/cpu/csrc/fused/decoder_layer.cpp), where every op of the layer is a C++ op the decoder
would otherwise call one by one from Python.

The C++ function calls the same functions, each in the variant the dispatch table picked for it,
so its result is bit for bit the op-by-op path's; it saves the Python, argument parsing and
dispatch of nine calls a layer (docs/one-stream.md, "The layer as one call"). It applies where the
model's projections are GGUF codes against int8 activations through the C++ GEMM (the defaults of
a GGUF file on a CPU with integer dot products), the add + RMSNorm, SiLU * up and rotary + K/V write
are the C++ ops, and the layer has nothing else (no Qwen3 q/k norm, no BitNet sub-norms or ReLU^2);
per step, where the attention is the CPU backend's C++ operator and no LoRA adapter runs.
"""

from __future__ import annotations

from typing import Any

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.attention_backend import AttentionBackend
from orcaserve.kernels.cpu import build
from orcaserve.kernels.cpu.attention import SUPPORTED_HEAD_DIMS, CpuAttentionPlan, CpuBackend
from orcaserve.kernels.quant import BITS, OFFSET, WIDE, QuantLinear

# The layer's ops in the order the C++ op takes their variants.
OPS = ("add_rms_norm", "rope_store_kv", "paged_attention", "silu_mul")


def _variant(kernel: str, op: str) -> int | None:
    """The index in dispatch.CAPABILITIES of `orcaserve.<op>.<variant>`; None for another kernel."""
    prefix = f"orcaserve.{op}."
    return dispatch.CAPABILITIES.index(kernel.removeprefix(prefix)) if kernel.startswith(prefix) else None


def _gemm_variant(p: Any) -> int | None:
    """The variant of `p`'s GEMM where `p` is a QuantLinear on the C++ int8-activation GEMM."""
    if type(p) is not QuantLinear or p._op is None:  # a group of formats, a wrapper, the twin
        return None
    return _variant(p.kernel, "linear_int8")


class LayerCall:
    """Runs layer `i` of a decoder in one call: (x + delta + o, the MLP's output), as the loop in
    `Decoder.forward` computes them from x [T, hidden] and the last layer's MLP output `delta`."""

    def __init__(self, op: Any, decoder: Any, variants: list[int]) -> None:
        self.op = op
        self.variants = variants
        self.scale, self.eps = float(decoder.scale), float(decoder.eps)
        self.num_heads, self.num_kv_heads = decoder.num_heads, decoder.num_kv_heads
        self.layers = []  # per layer: norms, [weights], [biases], meta
        for layer in decoder.layers:
            projs = (layer.qkv, layer.o, layer.gate_up, layer.down)
            meta = [m for p in projs for m in (p.out_features, BITS[p.fmt], p.fmt in OFFSET, p.fmt in WIDE)]
            self.layers.append(
                (layer.in_norm, layer.post_norm, [p.weight for p in projs], [p._bias32 for p in projs], meta)
            )

    @staticmethod
    def applies(backend: AttentionBackend, plan: object, cache: torch.Tensor) -> bool:
        """Whether a step's attention is the C++ operator this call runs."""
        return (
            isinstance(backend, CpuBackend)
            and isinstance(plan, CpuAttentionPlan)
            and backend.op_for(cache.dtype) is not None
        )

    def __call__(
        self,
        i: int,
        x: torch.Tensor,  # [T, hidden]
        delta: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
        plan: CpuAttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        in_norm, post_norm, weights, biases, meta = self.layers[i]
        return self.op(
            x, delta, in_norm, post_norm, weights, biases, meta, cos, sin, k_cache, v_cache, slot_mapping,
            plan.cu_seqlens_q, plan.seq_lens, plan.block_tables, self.scale, self.eps,
            self.num_heads, self.num_kv_heads, self.variants,
        )  # fmt: skip


def layer_call(decoder: Any, op: Any = None) -> LayerCall | None:
    """A `LayerCall` for `decoder` where it applies (the module docstring), else None. `op`: the
    C++ op to call (the library's by default)."""
    dtype = decoder.embed.dtype
    if decoder.embed.device.type != "cpu" or decoder.triton_ops is not None or not decoder.fused:
        return None
    if decoder.rope_store_op is None or not decoder.rope_store or decoder.head_dim not in SUPPORTED_HEAD_DIMS:
        return None
    if op is None:
        if not build.load(build=False)[0]:
            return None
        op = getattr(getattr(torch.ops.orcaserve, "decoder_layer", None), "default", None)
        if op is None:
            return None
    for layer in decoder.layers:
        extra = (layer.q_norm, layer.k_norm, layer.attn_sub_norm, layer.ffn_sub_norm)
        if layer.relu2 or any(t is not None for t in extra):
            return None
    gemms = {_gemm_variant(p) for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    if not decoder.layers or len(gemms) != 1 or None in gemms:
        return None
    variants = [_variant(dispatch.resolve(name, dtype), name) for name in OPS] + list(gemms)
    if None in variants:
        return None
    return LayerCall(op, decoder, [v for v in variants if v is not None])
