"""The GPU check's steps, one at a time; benchmarks/gpu_check.sh runs them all on a CUDA machine
within a time budget (or, GPU_CHECK_DRY_RUN=1, on the CPU under TRITON_INTERPRET=1) and writes
summary.json (docs/kernels.md "GPU check").

    orcaserve-bench gpu engine exact --smoke --out exact.json
    orcaserve-bench gpu kernels --dtype bf16 --shapes 32x8x128 --out kernels.json
    orcaserve-bench gpu fused --smoke
"""

from __future__ import annotations

import argparse

from orcaserve.bench import steps

STEPS = {
    "preflight": ("orcaserve.bench.gpu_preflight", "versions, GPU, API probes; whether the steps can run"),
    "engine": ("orcaserve.bench.gpu_engine", "engine on the GPU: exact (vs transformers), throughput, real model"),
    "kernels": ("orcaserve.bench.kernel_bench", "Triton attention: decode bandwidth, prefill TFLOP/s, split-K"),
    "graphs": ("orcaserve.bench.gpu_graphs", "CUDA graphs on vs off: decode step times, end to end, exactness"),
    "fused": ("orcaserve.bench.gpu_fused", "the decoder's fused Triton kernels vs the PyTorch ops they replace"),
    "startup": ("orcaserve.bench.startup_cost", "import, custom-op registration and engine start-up times"),
    "summary": ("orcaserve.bench.gpu_summary", "summary.json from the steps' results (gpu_check.sh)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    steps.add(parser, STEPS)


def run(args: argparse.Namespace) -> dict:
    return steps.run(args, STEPS)
