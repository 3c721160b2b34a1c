"""`orcaserve-bench offline` prints the projections' rate beside a nominal peak: threads x GHz x the
operations per cycle of the GEMM the cell runs (int8 activations: vpdpbusd's; bf16 weights: bf16's)."""

from __future__ import annotations

import argparse

import torch

from orcaserve.bench.cpu.gemm import peaks
from orcaserve.bench.engine import offline


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"ghz": 3.5, "quantization": None, "activations": None, **kw})


def test_int8_activations_run_against_the_int8_peak():
    p = offline.projection_peak("torch.float32", _args(quantization="gguf", activations="int8"))
    cores = torch.get_num_threads()
    assert p is not None and p["kind"] == "int8"
    assert p["gflop_s"] == peaks(cores, 3.5)["int8_gops"]
    assert p["formula"] == f"{cores} x 3.50 GHz x {peaks(cores, 3.5)['int8_op_per_cycle']:g}"


def test_bf16_weights_run_against_the_bf16_peak_and_fp32_against_none():
    p = offline.projection_peak("torch.bfloat16", _args())
    assert p is not None and p["kind"] == "bf16"
    assert p["gflop_s"] == peaks(torch.get_num_threads(), 3.5)["bf16_gflops"]
    assert offline.projection_peak("torch.float32", _args()) is None
    assert offline.projection_peak("torch.float32", _args(quantization="gguf")) is None
