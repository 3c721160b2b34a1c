"""Ternary linear layers (BitNet b1.58): weights in {-1, 0, +1} with one scale per tensor, times
activations quantized per token to int8, with integer accumulation (docs/bitnet.md).

transformers' `BitLinear` computes, in the model's dtype,

    s   = 127 / max(|x|, over the row).clamp(min=1e-5)        # per token
    x_q = (x * s).round().clamp(-128, 127)
    y   = linear(x_q, w) / (weight_scale * s)

Its products and sums are of integers: in fp32 every partial sum is an integer below 2^24 (128 x
the input width, up to 131072 columns), so ATen's fp32 GEMM computes them exactly, in any order.
An int32 accumulation therefore gives the same `linear(x_q, w)` bit for bit, and this layer's
output equals transformers' fp32 forward bit for bit, the contract its tests hold it to.

Several projections that read the same input (q/k/v, gate/up) are fused into one GEMM: each keeps
its own weight scale, applied to its own columns (`col_scale`), the same fp32 product per element.

The integer GEMM is the dispatch table's `linear_ternary` row on the CPU: the C++ kernel over the
weights packed two bits a weight (csrc/gemm/gemm_ternary.cpp) where the library has it, else the
PyTorch twin; on a GPU the Triton kernel (kernels/triton/ternary.py). The twin is the oracle
every kernel is held to, bit for bit: the weight as int8 values (a byte a weight, never floats)
and `torch._int_mm`. With the C++ kernel, a float or bf16 layer runs in one call
(`bitlinear_ternary`: the quantization, the GEMM and the scaling, each rounding as the PyTorch ops
below do; docs/bitnet.md, "The kernel").
"""

from __future__ import annotations

from typing import Any

import torch

from orcaserve.kernels import dispatch

VALUES_PER_BYTE = 4  # transformers' packing: 2 bits a weight, along the output dimension
_MAX_K = 1 << 17  # 128 * K < 2^24: fp32 sums of the products exact (see the module docstring)


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:  # [N/4, K] uint8 -> [N, K] int8
    """transformers' packed BitNet weight: value + 1 in 2 bits, the i-th quarter of the output
    rows in bits 2i..2i+1 of each byte. Raises on a code of 3 (no ternary value)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"a packed ternary weight is a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    quarters = [(packed >> (2 * i)) & 3 for i in range(VALUES_PER_BYTE)]
    codes = torch.cat(quarters, dim=0)  # [N, K] in {0, 1, 2}
    if bool((codes == 3).any()):
        raise ValueError("a packed ternary weight holds the code 3, which is no value of {-1, 0, +1}")
    return (codes.to(torch.int8) - 1).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, K] int8, [T, 1] scale) as transformers' `BitLinear.activation_quant`, in x's dtype."""
    scale = 127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)  # [T, 1]
    return (x * scale).round().clamp(-128, 127).to(torch.int8), scale


class TernaryLinear:
    """y = (x_q @ w.T) / (col_scale * s): one or more BitLinear projections over the same input."""

    def __init__(self, weight: torch.Tensor, col_scale: torch.Tensor, kernel: str | None = None) -> None:
        # weight [N, K] int8 in {-1, 0, 1}; col_scale [N], each column's weight_scale; kernel: the
        # dispatch table's choice unless named ("torch": the twin, for an A/B)
        if weight.dtype != torch.int8 or col_scale.shape != (weight.shape[0],):
            raise ValueError(f"ternary weight [N, K] int8 with [N] scales, got {weight.dtype} {tuple(weight.shape)}")
        if weight.shape[1] >= _MAX_K:
            raise ValueError(f"input width {weight.shape[1]} >= {_MAX_K}: int8 sums could leave fp32's exact range")
        self.col_scale = col_scale  # [N], fp32 or the model's dtype, as transformers holds it
        self.out_features, self.in_features = weight.shape
        cpu = weight.device.type == "cpu"
        self.kernel = kernel or (dispatch.resolve("linear_ternary", "int8") if cpu else "triton")
        self._op: Any = None
        self._whole: Any = None  # the C++ BitLinear in one call, for float and bf16 x
        self._scales: dict[torch.dtype, torch.Tensor] = {}  # col_scale in x's dtype, per dtype
        self.weight: torch.Tensor
        if self.kernel == "triton":  # the GPU's (kernels/triton/ternary.py); the interpreter runs it on a CPU
            from orcaserve.kernels.triton.ternary import pack_ternary, ternary_int_mm

            self._op = ternary_int_mm
            self.weight = pack_ternary(weight)  # four columns' codes a byte
        elif self.kernel != "torch":
            self._op = dispatch.orcaserve_op(self.kernel)
            pack = dispatch.orcaserve_op(self.kernel.replace(".linear_ternary", ".pack_ternary_weight", 1))
            self.weight = pack(weight)  # two bits a weight, the kernel's panels
            self._whole = dispatch.orcaserve_op(self.kernel.replace(".linear_ternary", ".bitlinear_ternary", 1))
        else:
            self.weight = weight.t().contiguous()  # [K, N] int8: _int_mm's layout

    @classmethod
    def fuse(cls, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> TernaryLinear:
        """One layer from (packed [N_i/4, K] uint8, weight_scale [1]) parts, outputs concatenated."""
        weights = [unpack_ternary(p) for p, _ in parts]
        scales = [s.reshape(1).expand(w.shape[0]) for w, (_, s) in zip(weights, parts)]
        return cls(torch.cat(weights), torch.cat(scales))

    def nbytes(self) -> int:  # a method, as QuantLinear's: what dram.bytes_per_token sums
        return self.weight.numel() + self.col_scale.numel() * self.col_scale.element_size()

    def int_sums(self, x_q: torch.Tensor) -> torch.Tensor:  # [T, K] int8 -> [T, N] int32
        if self._op is not None:
            return self._op(x_q, self.weight, self.out_features)
        if x_q.shape[0] == 0:
            return x_q.new_zeros(0, self.out_features, dtype=torch.int32)
        return torch._int_mm(x_q, self.weight)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:  # col_scale in dtype, converted once
        scale = self._scales.get(dtype)
        if scale is None:
            scale = self._scales[dtype] = self.col_scale.to(dtype).contiguous()
        return scale

    def normed(self, x: torch.Tensor, weight: torch.Tensor, eps: float, relu2: bool = False) -> torch.Tensor | None:
        """self(rms_norm(a, weight, eps)) in one C++ call, a being x [T, K], or relu(gate)^2 * up of
        x = [gate | up] [T, 2 K] where relu2: BitNet's sub-layer norms (docs/bitnet.md, "The sub-layer
        norms in the call"), the PyTorch ops' output bit for bit. None where the call does not apply
        (no C++ kernel, another dtype): the caller runs those ops (scheduler/model/bitnet.py)."""
        if self._whole is None or x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
            return None
        return self._whole(x, self.weight, self.out_features, self._scale(x.dtype), weight, eps, relu2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N], x's dtype
        if self._whole is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self._whole(x, self.weight, self.out_features, self._scale(x.dtype))
        x_q, s = quantize_activations(x)
        acc = self.int_sums(x_q)
        return (acc.to(x.dtype) / (self.col_scale.to(x.dtype) * s)).to(x.dtype)  # [T, N]
