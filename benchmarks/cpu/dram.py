"""The DRAM roof of a decode step: the machine's measured read bandwidth over the bytes one token
reads (the weights as served: codes for a quantized projection, `dtype` for a dense one; the
embedding is read by row, so left out). `orcaserve-bench latency` prints it beside each figure."""

from __future__ import annotations

import time
from typing import Any

import torch

# Bytes per 32 weights as the int8-activation GEMM reads them (pack_int8_weight: fp32 scale per
# span, fp32 min where the format has one, 4- or 8-bit codes; docs/int8-activations.md "Kernels
# per ISA"). The bitwise GEMM reads quantized.BLOCK_BYTES.
INT8_PACKED_BYTES = {"q8_0": 36, "q4_0": 20, "q4_1": 24, "q4_k": 24, "q6_k": 40}


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s with torch's threads, over a buffer far larger than the last-level
    cache: with the C++ library, the fastest of `repeats` rounds of 128 chunks of 4 MiB, each chunk
    read by all the threads of one OpenMP region and timed alone (`read_sweep`); without it, the
    best of 3 x `repeats` torch sums of the whole buffer (`sum_bandwidth`)."""
    from orcaserve.kernels.cpu.build import load

    if not load(build=False)[0] or not hasattr(torch.ops.orcaserve, "read_sweep"):
        return sum_bandwidth(mib, 3 * repeats)
    buf = torch.ones(mib << 20, dtype=torch.uint8)  # touched: its pages exist
    chunk = min(4 << 20, (mib << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        # The first chunks start the threads and bring the clocks up; a pause between rounds lets a
        # neighbour's burst that preempted one round pass.
        best = min(best, torch.ops.orcaserve.read_sweep(buf, chunk, 128)[4:].min().item())
        time.sleep(0.02)
    return chunk / best / 1e9


def sum_bandwidth(mib: int = 512, repeats: int = 15) -> float:
    """Read bandwidth in GB/s from torch's sum over a float32 buffer: the best of `repeats` after two
    unmeasured ones. Each sum takes ~10 ms, so on a shared machine it is often preempted, and torch's
    reduction itself falls short of a plain read loop (on an AMD Zen 5 with 2 vCPUs under load: 17-28
    GB/s where read_sweep read 61-66, docs/performance-log.md "2026-12-07 (afternoon): a steadier DRAM
    probe")."""
    x = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB of fp32
    for _ in range(2):  # pages touched, threads started, clocks up
        x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def bytes_per_token(model: Any, dtype: torch.dtype, decoder: Any = None) -> int:
    """The weight bytes one decode step reads: every projection and the lm_head, as served. With
    the lean `decoder` (`runner.decoder`), from its own GEMMs: it took the codes off the modules."""
    from orcaserve.scheduler.model.quantized import ACTIVATIONS, BLOCK_BYTES, CODES, linears

    if decoder is not None:
        gemms = [
            decoder.lm_head,
            *(g for layer in decoder.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)),
        ]
        # a quantized GEMM's bytes in its kernel's layout; a dense one reads one copy in dtype
        dense = torch.finfo(dtype).bits // 8
        return sum(g.nbytes() if hasattr(g, "nbytes") else g.in_features * g.out_features * dense for g in gemms)

    total = 0
    for _, module in linears(model):
        codes = getattr(module, CODES, None)
        if codes is None:
            # in_features/out_features: the decoder may have moved the weight into its packed GEMM
            total += module.in_features * module.out_features * torch.finfo(dtype).bits // 8
            continue
        table = INT8_PACKED_BYTES if getattr(module, ACTIVATIONS, None) == "int8" else BLOCK_BYTES
        n, k = codes.q.shape
        total += n * (k // 32) * table[codes.fmt]
    return total
