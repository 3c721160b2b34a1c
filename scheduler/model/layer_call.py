"""The lean decoder's layer as one C++ call (`torch.ops.orcaserve.decoder_layer`,
kernels/cpu/csrc/fused/decoder_layer.cpp), where every op of the layer is a C++ op the decoder
would otherwise call one by one from Python.

The C++ function calls the same functions, each in the variant the dispatch table picked for it,
so its result is bit for bit the op-by-op path's; it saves the Python, argument parsing and
dispatch of nine calls a layer (docs/one-stream.md, "The layer as one call"). It applies where the
model's projections all run one C++ GEMM: GGUF codes against int8 activations (the defaults of a
GGUF file on a CPU with integer dot products), or dense fp32/bf16 weights on the project's packed
GEMMs (a safetensors checkpoint's dense path; where the layers keep a second copy for GEMV-shaped
calls, on AMX, only steps of up to GEMV_ROWS rows, the larger ones being oneDNN's); where the add +
RMSNorm, SiLU * up and rotary + K/V write are the C++ ops, and the layer has nothing else (no Qwen3
q/k norm, no BitNet sub-norms or ReLU^2); per step, where the attention is the CPU backend's C++
operator and the step holds no LoRA adapter, or adapters whose update is the C++ operator: then
`decoder_layers_lora` (several adapters, `lora_batched`) or `decoder_layers_sgmv` (one, `lora_sgmv`)
calls that operator after each projection, as `LoraStep.apply` would (docs/lora.md "The layer call
with adapters").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.attention_backend import AttentionBackend
from orcaserve.kernels.cpu import build
from orcaserve.kernels.cpu.attention import SUPPORTED_HEAD_DIMS, CpuAttentionPlan, CpuBackend
from orcaserve.kernels.cpu.lora import PartsCell, SgmvCell, row_indices
from orcaserve.kernels.linear import GEMV_ROWS, Linear
from orcaserve.kernels.pytorch.fused import rms_norm
from orcaserve.kernels.quant import BITS, OFFSET, WIDE, QuantLinear
from orcaserve.scheduler.lora.resident import LoraStep

# The layer's ops in the order the C++ op takes their variants.
OPS = ("add_rms_norm", "rope_store_kv", "paged_attention", "silu_mul")
# The C++ op's GEMM families, by the index it takes them at (fused/decoder_layer.cpp's Gemm).
GEMMS = ("linear_int8", "linear_packed", "linear_packed_bf16")
UNLIMITED = 1 << 62


def _variant(kernel: str, op: str) -> int | None:
    """The index in dispatch.CAPABILITIES of `orcaserve.<op>.<variant>`; None for another kernel."""
    prefix = f"orcaserve.{op}."
    return dispatch.CAPABILITIES.index(kernel.removeprefix(prefix)) if kernel.startswith(prefix) else None


@dataclass(frozen=True)
class _Gemm:
    """How the C++ op runs one projection: the same GEMM, weight and bias its own call would."""

    family: int  # index in GEMMS
    variant: int  # index in dispatch.CAPABILITIES
    weight: torch.Tensor
    bias: torch.Tensor | None
    meta: tuple[int, int, int, int]  # (out_features, bits, has_offset, wide); zeros past out for dense
    rows: int  # the most rows a call of it runs this GEMM


def _gemm(p: Any) -> _Gemm | None:
    """`p`'s C++ GEMM; None where it has none (a group of formats, a wrapper, a library's GEMM, the
    twin)."""
    if type(p) is QuantLinear and p._op is not None:
        v = _variant(p.kernel, "linear_int8")
        meta = (p.out_features, BITS[p.fmt], int(p.fmt in OFFSET), int(p.fmt in WIDE))
        return None if v is None else _Gemm(0, v, p.weight, p._bias32, meta, UNLIMITED)
    if type(p) is not Linear:
        return None
    if p._gemv_op is not None and p.gemv_weight is not None:  # linear.Linear's choice at GEMV_ROWS or fewer
        kernel, weight, rows = p.gemv_kernel, p.gemv_weight, GEMV_ROWS
    elif p._op is not None:
        kernel, weight, rows = p.kernel, p.weight, UNLIMITED
    else:
        return None
    for family, op in enumerate(GEMMS[1:], start=1):
        v = _variant(kernel, op)
        if v is not None:
            return _Gemm(family, v, weight, p.bias, (p.out_features, 0, 0, 0), rows)
    return None


class LayerCall:
    """Runs layer `i` of a decoder in one call: (x + delta + o, the MLP's output), as the loop in
    `Decoder.forward` computes them from x [T, hidden] and the last layer's MLP output `delta`."""

    def __init__(
        self, op: Any, decoder: Any, variants: list[int], gemms: list[list[_Gemm]], stack_op: Any = None
    ) -> None:
        self.op = op
        self.stack_op = stack_op  # decoder_layers: every layer in one call (`all`), where the library has it
        self.norm_op: Any = None  # final_norm: the last add, the sampled rows and the final norm (`last_rows`)
        self.lora_op: Any = None  # decoder_layers_lora: `all` with a step's adapters, where the library has it
        self.sgmv_op: Any = None  # decoder_layers_sgmv: `all` with one adapter's rows
        self.with_lora = True  # False: steps with adapters take the op-by-op loop (the bench's A/B)
        self.variants = variants
        self.scale, self.eps = float(decoder.scale), float(decoder.eps)
        self.num_heads, self.num_kv_heads = decoder.num_heads, decoder.num_kv_heads
        # The most rows a step may have: where a projection runs another GEMM above GEMV_ROWS.
        self.max_rows = min(g.rows for projs in gemms for g in projs)
        self.layers = []  # per layer: norms, [weights], [biases], meta
        for layer, projs in zip(decoder.layers, gemms):
            meta = [m for g in projs for m in g.meta]
            self.layers.append(
                (layer.in_norm, layer.post_norm, [g.weight for g in projs], [g.bias for g in projs], meta)
            )
        # The same, flat over the layers in order, for stack_op: norms, weights, biases, meta
        self.stack = (
            [n for n, _, _, _, _ in self.layers],
            [n for _, n, _, _, _ in self.layers],
            [w for _, _, ws, _, _ in self.layers for w in ws],
            [b for _, _, _, bs, _ in self.layers for b in bs],
            [m for _, _, _, _, ms in self.layers for m in ms],
        )

    @staticmethod
    def applies(backend: AttentionBackend, plan: object, cache: torch.Tensor) -> bool:
        """Whether a step's attention is the C++ operator this call runs."""
        return (
            isinstance(backend, CpuBackend)
            and isinstance(plan, CpuAttentionPlan)
            and backend.op_for(cache.dtype) is not None
        )

    def takes(self, lora: LoraStep | None) -> bool:
        """Whether a step with `lora` runs in `all`: none, or adapters whose update is the C++ operator
        (the dispatch table's cell, in any variant: `lora_batched` for several, `lora_sgmv` for one);
        the twins keep the loop."""
        if lora is None:
            return True
        if not self.with_lora:
            return False
        if lora.batch is not None:
            return self.lora_op is not None and isinstance(lora.loras.batched_op, PartsCell)
        return self.sgmv_op is not None and len(lora.rows) == 1 and isinstance(lora.loras.op, SgmvCell)

    def __call__(
        self,
        i: int,
        x: torch.Tensor,  # [T, hidden]
        delta: torch.Tensor | None,  # [T, hidden]; None at the first layer
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

    def all(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        slot_mapping: torch.Tensor,  # [T] int64
        plan: CpuAttentionPlan,
        lora: LoraStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer in turn from the embedding x: (x + all but the last MLP output, the last), in
        one call where the library has `decoder_layers` (the per-call cost once a step), else one a layer;
        with `lora` (where `takes` it) its update after each projection, in one call."""
        if lora is not None:
            return self._all_lora(x, cos, sin, kv_caches, slot_mapping, plan, lora)
        if self.stack_op is None:
            x, delta = self(0, x, None, cos, sin, *kv_caches[0], slot_mapping, plan)
            for i in range(1, len(self.layers)):
                x, delta = self(i, x, delta, cos, sin, *kv_caches[i], slot_mapping, plan)
            return x, delta
        in_norms, post_norms, weights, biases, meta = self.stack
        return self.stack_op(
            x, in_norms, post_norms, weights, biases, meta, cos, sin, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], slot_mapping, plan.cu_seqlens_q, plan.seq_lens, plan.block_tables,
            self.scale, self.eps, self.num_heads, self.num_kv_heads, self.variants,
        )  # fmt: skip

    def _all_lora(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,
        plan: CpuAttentionPlan,
        lora: LoraStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`all` with the step's adapters: the same `lora_batched` op, stacks and per-step tensors
        LoraStep.apply passes it (kernels/cpu/lora.py's PartsCell), after each projection."""
        batch, cell, one = lora.batch, lora.loras.batched_op, lora.loras.op
        args = (
            x, *self.stack, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches], slot_mapping,
            plan.cu_seqlens_q, plan.seq_lens, plan.block_tables, self.scale, self.eps, self.num_heads,
            self.num_kv_heads, self.variants,
        )  # fmt: skip
        if batch is not None:
            assert isinstance(cell, PartsCell), "takes(lora) first"
            a, b, cols, parts = lora.loras.flat()
            variant = dispatch.CAPABILITIES.index(cell.op._overloadname)
            return self.lora_op(*args, batch.row_slot, batch.slot_scale, batch.rank, a, b, cols, parts, variant)
        assert isinstance(one, SgmvCell), "takes(lora) first"
        ((name, rows),) = lora.rows.items()
        (a, b, cols, parts), scales = lora.loras.flat_one(name)
        variant = dispatch.CAPABILITIES.index(one.op._overloadname)
        return self.sgmv_op(*args, row_indices(rows), a, b, cols, scales, parts, variant)

    def last_rows(
        self, x: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:  # x, delta [T, hidden], rows [S] -> [S, hidden]
        """rms_norm((x + delta)[rows]): the forward's PyTorch ops after the last layer, in one C++
        call of the same ATen ops where the library has `final_norm`."""
        if self.norm_op is not None:
            return self.norm_op(x, delta, rows, weight, self.eps)
        return rms_norm((x + delta).index_select(0, rows), weight, self.eps)


def layer_call(decoder: Any, op: Any = None) -> LayerCall | None:
    """A `LayerCall` for `decoder` where it applies (the module docstring), else None. `op`: the
    C++ op to call (the library's by default, with its `decoder_layers`; a given op runs a call a layer)."""
    dtype = decoder.embed.dtype
    if decoder.embed.device.type != "cpu" or decoder.triton_ops is not None or not decoder.fused:
        return None
    if decoder.rope_store_op is None or not decoder.rope_store or decoder.head_dim not in SUPPORTED_HEAD_DIMS:
        return None
    stack_op = None
    if op is None:
        if not build.load(build=False)[0]:
            return None
        op = getattr(getattr(torch.ops.orcaserve, "decoder_layer", None), "default", None)
        stack_op = getattr(getattr(torch.ops.orcaserve, "decoder_layers", None), "default", None)
        if op is None:
            return None
    for layer in decoder.layers:
        extra = (layer.q_norm, layer.k_norm, layer.attn_sub_norm, layer.ffn_sub_norm)
        if layer.relu2 or any(t is not None for t in extra):
            return None
    gemms = [[_gemm(p) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] for layer in decoder.layers]
    found = [[g for g in projs if g is not None] for projs in gemms]
    kinds = {(g.family, g.variant) for projs in found for g in projs}
    if not decoder.layers or len(kinds) != 1 or any(len(projs) != 4 for projs in found):
        return None
    ((family, gemm_variant),) = kinds
    variants = [_variant(dispatch.resolve(name, dtype), name) for name in OPS]
    if None in variants:
        return None
    call = LayerCall(op, decoder, [v for v in variants if v is not None] + [gemm_variant, family], found, stack_op)
    if stack_op is not None:
        call.norm_op = getattr(getattr(torch.ops.orcaserve, "final_norm", None), "default", None)
        call.lora_op = getattr(getattr(torch.ops.orcaserve, "decoder_layers_lora", None), "default", None)
        call.sgmv_op = getattr(getattr(torch.ops.orcaserve, "decoder_layers_sgmv", None), "default", None)
    return call
