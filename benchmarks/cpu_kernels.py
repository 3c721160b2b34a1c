"""CPU kernels, one step each: `gemm` (the decoder's bf16/fp32 GEMM shapes: oneDNN, MKL, the
project's own, optionally inductor) and `quant` (GGUF block formats served quantized against the
project's fp32/bf16 GEMMs and torch's int8/int4 ops). Each prints its table and returns it.

    orcaserve-bench kernels gemm --dtype bfloat16 --rows 1,32,128
    orcaserve-bench kernels quant --rows 1,8,32 --shapes qkv,down --out quant.json
"""

from __future__ import annotations

import argparse

from orcaserve.bench import steps

STEPS = {
    "gemm": ("orcaserve.bench.gemm", "bf16/fp32 GEMMs at SmolLM2's shapes, ms per call"),
    "quant": ("orcaserve.bench.gemm_quant", "GGUF block-format GEMMs at Llama-3.2-1B's shapes, ms and GB/s"),
    "int8": (
        "orcaserve.bench.gemm_int8",
        "int8-activation GEMMs vs bitwise quantized and bf16, GFLOP/s and peak",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    steps.add(parser, STEPS)


def run(args: argparse.Namespace) -> dict:
    return steps.run(args, STEPS)
