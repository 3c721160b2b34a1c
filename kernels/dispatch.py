"""Which kernel runs each CPU op: ONE table from (CPU capability, dtype, op) to the kernel that runs
and what takes over where it cannot.

    python -m orcaserve.kernels.dispatch        # this machine's choices, and what is available
    python -m orcaserve.kernels.dispatch --all  # every capability (docs/architecture.md, "Dispatch")

A kernel is named as the table names it:
- `orcaserve.<op>.<variant>`: the project's C++ op, one overload per ISA variant built into the
  library (`kernels/cpu/build.py`: generic, avx2, avx512, avx512_bf16, amx);
- `onednn`, `mkl`: the linear layers on a weight packed for that library (`kernels/linear.py`);
- `torch`: the PyTorch ops the C++ op fuses or replaces (`kernels/pytorch/`, the decoder's and the
  sampler's own code): always there, and the oracle the tests hold the others to.

The capability is the highest variant this CPU executes (`build.machine_variants()`), capped by
`ORCASERVE_CPU_ISA` (e.g. `avx2` on an AVX-512 machine, for an A/B run). The choice is made once,
when a layer or backend is built: nothing here runs per step.

Why each cell is what it is (measurements in docs/performance-log.md):
- attention, fp32 and fp16: the widest vector variant; the bf16 instructions change nothing there.
- attention, bf16: vdpbf16ps where the CPU has it (avx512_bf16), AMX prefill tiles on amx
  (docs/performance-log.md#2026-12-04-amx-prefill-attention-one-pass-element-wise-ops-first-tokens-first-sapphire-rapids).
- fused element-wise ops and argmax: the widest variant; bf16 rounds through vcvtneps2bf16 on
  avx512_bf16 and amx.
- linear, fp32: the project's GEMM on every x86 kind measured (Zen 3, Zen 4, Ice Lake, Sapphire
  Rapids), else MKL's packed sgemm on Intel CPUs, else oneDNN's pre-packed inner product (MKL takes
  slow paths on other vendors' CPUs).
- linear, bf16: without native bf16 (avx2, avx512) the project's fp32 GEMM widening bf16 panels
  (oneDNN cannot pack bf16 on AVX2 and emulates it on AVX-512, slower on Ice Lake); with
  AVX-512 BF16 and no AMX (Zen 4) the vdpbf16ps GEMM; with AMX oneDNN's tiles.
- linear_gemv, bf16 (1-4 rows): the project's GEMMs, whose GEMV-shaped calls stream each thread's
  share of the panels with a prefetch ahead (gemm/panels.h); on AMX the vdpbf16ps GEMM on a second
  copy of the weight, oneDNN's tiles keeping the larger steps (docs/architecture.md, "Dispatch").
  fp32 and the GGUF formats take their GEMV shape inside the op their row names (same layout).
- linear_quant, per GGUF block format (q8_0, q4_0, q4_1, q4_k, q6_k; `kernels/quant.py`): the
  project's GEMM over packed codes (gemm_quant.cpp), bit for bit its fp32 GEMM on the dequantized weight. torch's
  `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` beat bf16 only at a few rows and lost to
  this kernel at 1-2; they take bf16 activations, other formats than GGUF's, and are not bitwise:
  no cell names them
  (docs/performance-log.md#2026-12-05-gguf-codes-served-quantized-the-cpu-gemm-over-packed-q8_0q4_0q4_1-amd-epyc-zen-2).
- lora_sgmv and lora_batched (LoRA adapters' update, docs/lora.md): the C++ operators
  (gemm/lora.cpp) from avx2 on, faster than the PyTorch twins (kernels/pytorch/lora.py) at SmolLM2's
  widths: on avx2 on a Zen 3 (4-7x in bf16, 1.3-3x in fp32; docs/performance-log.md, "2026-12-07:
  the C++ LoRA operators"), on avx512 and avx512_bf16 on a Zen 5 once they read B stored transposed
  (2.5-3.9x less time in bf16, 3.9x with vdpbf16ps, 4.4-4.9x in fp32; "2026-12-07 (morning): the
  C++ LoRA operators on AVX-512, B stored transposed"). amx runs avx512_bf16's code, not measured
  on an AMX CPU; generic keeps the twins.
  On a CUDA device both are the Triton shrink and expand (kernels/triton/lora.py; kernels/cpu/lora.py's
  `sgmv_for` and `batched_for` take the device, as BitNet's layer does for `linear_ternary`).
- linear_ternary (BitNet): the project's GEMM over two-bit codes (gemm_ternary.cpp), exact integer
  sums, so bit for bit torch._int_mm over the same values; the variant chosen also runs a float or
  bf16 layer whole (`bitlinear_ternary`, bit for bit the PyTorch path: kernels/ternary.py).
- linear_int8, per format (opt-in, `activations="int8"`): the int8-activation GEMM over the same
  codes (gemm_int8.cpp), vpdpbusd on the VNNI variants, vpmaddubsw on avx2 and avx512, bit for bit
  its PyTorch twin (docs/int8-activations.md).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from orcaserve.kernels.cpu import build

CAPABILITIES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")


def _o(op: str, *variants: str) -> tuple[str, ...]:
    return tuple(v if v in ("torch", "onednn", "mkl") else f"orcaserve.{op}.{v}" for v in variants)


_QUANT = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")  # kernels/quant.py's FORMATS
_WIDEST = ("generic", "avx2", "avx512", "avx512", "avx512")
_BF16 = ("generic", "avx2", "avx512", "avx512_bf16", "avx512_bf16")

# (op, dtype) -> (what runs per capability, in CAPABILITIES' order; fallbacks, tried in order)
TABLE: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("paged_attention", "float32"): (_o("paged_attention", *_WIDEST), ("torch",)),
    ("paged_attention", "float16"): (_o("paged_attention", *_WIDEST), ("torch",)),
    ("paged_attention", "bfloat16"): (
        _o("paged_attention", "generic", "avx2", "avx512", "avx512_bf16", "amx"),
        ("torch",),
    ),
    ("add_rms_norm", "float32"): (_o("add_rms_norm", *_WIDEST), ("torch",)),
    ("add_rms_norm", "bfloat16"): (_o("add_rms_norm", *_BF16), ("torch",)),
    ("silu_mul", "float32"): (_o("silu_mul", *_WIDEST), ("torch",)),
    ("silu_mul", "bfloat16"): (_o("silu_mul", *_BF16), ("torch",)),
    ("rope_store_kv", "float32"): (_o("rope_store_kv", *_WIDEST), ("torch",)),
    ("rope_store_kv", "bfloat16"): (_o("rope_store_kv", *_BF16), ("torch",)),
    ("argmax_rows", "float32"): (_o("argmax_rows", *_WIDEST), ("torch",)),
    ("argmax_rows", "bfloat16"): (_o("argmax_rows", *_WIDEST), ("torch",)),
    ("linear", "float32"): (
        ("mkl", *_o("linear_packed", "avx2", "avx512", "avx512", "avx512")),
        ("mkl", "onednn", "torch"),
    ),
    ("linear", "bfloat16"): (
        (
            "torch",
            *_o("linear_packed", "avx2", "avx512"),
            "orcaserve.linear_packed_bf16.avx512_bf16",
            "onednn",
        ),
        ("onednn", "torch"),
    ),
    # The same layers' GEMV-shaped calls (a decode step of 1-4 streams, linear.GEMV_ROWS): the
    # project's GEMMs stream their panels there; where the row above names another library (AMX:
    # oneDNN), the layer keeps a second copy packed for this one.
    ("linear_gemv", "bfloat16"): (
        (
            "torch",
            *_o("linear_packed", "avx2", "avx512"),
            *_o("linear_packed_bf16", "avx512_bf16", "amx"),
        ),
        ("torch",),
    ),
    # LoRA adapters' update (docs/lora.md "The segmented update in the dispatch table"): the C++
    # operators (gemm/lora.cpp: shrink and expand fused per row, each row against its own adapter's
    # columns only; vdpbf16ps for the bf16 shrink on avx512_bf16 and amx), measured faster than the
    # PyTorch twins (kernels/pytorch/lora.py) on avx2 (Zen 3), avx512 and avx512_bf16 (Zen 5); amx
    # runs avx512_bf16's code, not measured there.
    **{
        (op, dt): (("torch", *_o(op, "avx2", "avx512", "avx512_bf16", "amx")), ("torch",))
        for op in ("lora_sgmv", "lora_batched")
        for dt in ("float32", "bfloat16")
    },
    # GGUF block formats (kernels/quant.py), the "dtype" a format name: the project's GEMM over codes.
    ("linear_quant", "q8_0"): (("torch", *_o("linear_quant", "avx2", "avx512", "avx512", "avx512")), ("torch",)),
    ("linear_quant", "q4_0"): (("torch", *_o("linear_quant", "avx2", "avx512", "avx512", "avx512")), ("torch",)),
    ("linear_quant", "q4_1"): (("torch", *_o("linear_quant", "avx2", "avx512", "avx512", "avx512")), ("torch",)),
    ("linear_quant", "q4_k"): (("torch", *_o("linear_quant", "avx2", "avx512", "avx512", "avx512")), ("torch",)),
    ("linear_quant", "q6_k"): (("torch", *_o("linear_quant", "avx2", "avx512", "avx512", "avx512")), ("torch",)),
    # The same codes against int8 activations (docs/int8-activations.md), opt-in: vpdpbusd where the
    # CPU has AVX-512 VNNI (avx512_bf16 and amx: every such CPU has it), vpmaddubsw below.
    **{
        ("linear_int8", f): (_o("linear_int8", "torch", "avx2", "avx512", "avx512_bf16", "amx"), ("torch",))
        for f in _QUANT
    },
    # BitNet's ternary weights against int8 activations (docs/bitnet.md): two bits a weight,
    # vpdpbusd where the CPU has AVX-512 VNNI, vpmaddubsw on avx2 and avx512; int32 sums, so any
    # kernel is bit for bit the torch twin (torch._int_mm over the same int8 values).
    ("linear_ternary", "int8"): (_o("linear_ternary", "torch", "avx2", "avx512", "avx512_bf16", "amx"), ("torch",)),
}


@dataclass(frozen=True)
class Choice:
    op: str
    dtype: str
    capability: str
    runs: str  # the table's kernel for this capability
    fallbacks: tuple[str, ...]  # in order, where `runs` is not available


def capability() -> str:
    """The highest variant this CPU executes, capped by ORCASERVE_CPU_ISA."""
    have = build.machine_variants()
    best = have[-1]
    cap = os.environ.get("ORCASERVE_CPU_ISA", "").strip().lower()
    if cap:
        if cap not in CAPABILITIES:
            raise ValueError(f"ORCASERVE_CPU_ISA={cap!r}: expected one of {', '.join(CAPABILITIES)}")
        if CAPABILITIES.index(cap) < CAPABILITIES.index(best):
            best = cap
    return best


def aten_variant() -> str:
    """The variant whose vector code is ATen's own on this CPU (torch's CPU capability): only that
    variant's SiLU is bit for bit ATen's, and only there does the decoder fuse it in fp32."""
    return {"AVX2": "avx2", "AVX512": "avx512"}.get(torch.backends.cpu.get_cpu_capability(), "generic")


def native_bf16() -> bool:
    """bf16 dot products in hardware (AVX-512 BF16 or AMX): there bf16 GEMMs run ~2-3.5x faster
    than fp32; elsewhere bf16 is emulated and slower (the engine's default CPU dtype follows)."""
    return capability() in ("avx512_bf16", "amx")


@functools.cache
def vnni() -> bool:
    """AVX-512 VNNI (vpdpbusd): what the int8 GEMM's avx512_bf16 and amx variants are built with."""
    return bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def choice(op: str, dtype: torch.dtype | str, cap: str | None = None) -> Choice | None:
    """The table's row for `op` in `dtype` on capability `cap` (this machine's by default); None
    where the table has no row (the caller's PyTorch path runs)."""
    name = _dtype_name(dtype)
    row = TABLE.get((op, name))
    if row is None:
        return None
    cap = cap or capability()
    return Choice(op, name, cap, row[0][CAPABILITIES.index(cap)], row[1])


def orcaserve_op(kernel: str) -> Any | None:
    """`torch.ops.orcaserve.<op>.<variant>` for a kernel named `orcaserve.<op>.<variant>`, if the
    library is loaded with it (loading it if built; never building)."""
    _, op, variant = kernel.split(".")
    if variant not in build.built_variants():
        return None
    packet = getattr(torch.ops.orcaserve, op, None)
    return getattr(packet, variant, None) if packet is not None else None


def available(kernel: str) -> bool:
    """Whether `kernel` can run in this process (for `mkl`/`onednn`: the library is there; whether it
    takes a given weight is `kernels/linear.py`'s question)."""
    if kernel.startswith("orcaserve."):
        return orcaserve_op(kernel) is not None
    if kernel == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear") and intel_cpu()
    if kernel == "onednn":
        return torch.backends.mkldnn.is_available()
    return kernel == "torch"


@functools.cache
def intel_cpu() -> bool:
    """MKL's sgemm takes slower code paths on other vendors' CPUs: on an AMD Zen 3 oneDNN's
    pre-packed inner product ran SmolLM2's fp32 GEMMs faster than MKL (`orcaserve-bench kernels
    gemm --dtype float32`; docs/performance-log.md#on-an-amd-epyc-zen-3-avx2-no-avx-512-no-native-bf16-2026-12-01)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return True  # not Linux: as measured on Intel


def resolve(op: str, dtype: torch.dtype | str, usable: Callable[[str], bool] = available) -> str:
    """The kernel that runs `op` in `dtype` here: the table's, else its first usable fallback, else
    `torch`. `usable` lets a caller add its own conditions (a weight's shape, its device)."""
    row = choice(op, dtype)
    if row is None:
        return "torch"
    for kernel in (row.runs, *row.fallbacks):
        if usable(kernel):
            return kernel
    return "torch"


def kernel(op: str, dtype: torch.dtype | str) -> Any | None:
    """The C++ op overload that runs `op` in `dtype` here, or None where the PyTorch path runs."""
    k = resolve(op, dtype)
    return orcaserve_op(k) if k.startswith("orcaserve.") else None


def render(caps: tuple[str, ...]) -> str:
    """The table as Markdown, one column per capability in `caps`."""
    head = ["op", "dtype", *caps, "fallback"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (op, dtype), (runs, fallbacks) in TABLE.items():
        cells = [runs[CAPABILITIES.index(c)].removeprefix(f"orcaserve.{op}.").removeprefix("orcaserve.") for c in caps]
        lines.append("| " + " | ".join([op, dtype, *cells, ", ".join(fallbacks)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="orcaserve's CPU dispatch table.")
    ap.add_argument("--all", action="store_true", help="every capability, not only this machine's")
    args = ap.parse_args(argv)
    loaded, why = build.load(build=False)
    if args.all:
        print(render(CAPABILITIES))
        print("\nA variant name is torch.ops.orcaserve.<op>.<variant>; linear's C++ cells name their op.")
        return 0
    cap = capability()
    print(f"capability: {cap} (this CPU executes {', '.join(build.machine_variants())})")
    print(f"library:    {why}")
    print(render((cap,)))
    print("\nresolved here:")
    for op, dtype in TABLE:
        print(f"  {op:16s} {dtype:9s} -> {resolve(op, dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
