"""int8 activations against GGUF block codes: GEMM time and GFLOP/s at Llama-3.2-1B's shapes, beside
the dense bf16 GEMM, the bitwise quantized GEMM, and this CPU's nominal peaks.

    orcaserve-bench kernels int8 [--rows 1,4,8,16,32,64,512] [--shapes qkv,o,gate_up,down]
                                   [--formats q4_0,q8_0,q4_1,q4_k,q6_k]

Per shape and row count, each on the same random weight (x bf16, as the engine runs on a bf16 CPU):
- bf16: `kernels/linear.py`'s Linear on the dispatch table's kernel (vdpbf16ps with AVX-512 BF16);
- <fmt>: `kernels/quant.py`'s QuantLinear, the bitwise path (codes widened to fp32);
- <fmt>+a8: the same codes with activations="int8" (docs/int8-activations.md).
The K-quants' codes are made from q4_1's and q8_0's (speed does not depend on the values). Each
kernel cycles over copies of its weight (at least 48 MB a round) so the weight streams from DRAM as
in a decode step. `--clock cpu --threads 1` times the thread's CPU time instead of the wall clock:
on a machine shared with other work, the time this GEMM computed rather than waited. Peaks are
nominal: cores x GHz x FLOP per cycle from the CPU's flags (bf16:
vdpbf16ps 64, AMX 1024; int8: vpdpbusd 128, AMX-INT8 2048 operations per cycle and core).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orcaserve.kernels.cpu import build
from orcaserve.kernels.linear import Linear
from orcaserve.kernels.quant import BlockCodes, QuantLinear, quantize

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # (out, in)
FORMATS = ("q4_0", "q8_0", "q4_1", "q4_k", "q6_k")
MIN_BYTES = 48 << 20


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def nominal_ghz() -> float:
    """The highest frequency the OS reports (cpufreq's maximum, else /proc/cpuinfo's current)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6
    except (OSError, ValueError):
        mhz = [
            float(x.split(":")[1]) for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("cpu MHz")
        ]
        return max(mhz) / 1e3 if mhz else 0.0


def peaks(cores: int, ghz: float) -> dict[str, float]:
    """Nominal GFLOP/s (GOP/s for int8) from the flags: FLOP per cycle and core times cores and GHz."""
    f = cpu_flags()
    bf16 = 1024 if "amx_bf16" in f else 64 if "avx512_bf16" in f else 64 if "avx512f" in f else 32
    int8 = 2048 if "amx_int8" in f else 128 if "avx512_vnni" in f else 128 if "avx512bw" in f else 64
    return {"bf16_flop_per_cycle": bf16, "int8_op_per_cycle": int8, "bf16_gflops": cores * ghz * bf16,
            "int8_gops": cores * ghz * int8}  # fmt: skip


def codes_for(w: torch.Tensor, fmt: str) -> BlockCodes:
    if fmt == "q4_k":
        c = quantize(w, "q4_1")
        return BlockCodes(fmt, c.q, c.scale, c.offset)
    if fmt == "q6_k":
        c = quantize(w, "q8_0")
        return BlockCodes(fmt, c.q >> 2, c.scale.repeat_interleave(2, dim=1) * 4, None)
    return quantize(w, fmt)


def make(kernel: str, w: torch.Tensor, isa: str = "") -> tuple[Callable[[torch.Tensor], torch.Tensor], int, str]:
    """(call, weight bytes, what runs) for one copy of `w`; `isa` forces the quantized GEMMs' variant."""
    if kernel == "bf16":
        lin = Linear(w.bfloat16(), None, pack=True)
        return lin, lin.weight.numel() * lin.weight.element_size(), lin.kernel
    fmt, _, act = kernel.partition("+")
    forced = f"orcaserve.{'linear_int8' if act else 'linear_quant'}.{isa}" if isa else None
    q = QuantLinear(codes_for(w, fmt), None, kernel=forced, activations="int8" if act else None)
    return q, q.nbytes(), q.kernel


def bench_shape(name: str, n: int, k: int, args: Any, kernels: list[str]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    built = {}
    for kern in kernels:
        first = make(kern, w, args.isa)
        built[kern] = [first] + [make(kern, w, args.isa) for _ in range(max(0, math.ceil(MIN_BYTES / first[1]) - 1))]
    print(f"\n{name} [{n} x {k}]: " + ", ".join(f"{kn}={built[kn][0][2]}" for kn in kernels))
    print("| rows | " + " | ".join(f"{kn} ms (GFLOP/s)" for kn in kernels) + " |")
    print("|" + " --- |" * (len(kernels) + 1))
    out = []
    for m in args.rows:
        x = torch.randn(m, k).bfloat16()
        for kern in kernels:  # warm-up
            for fn, _, _ in built[kern]:
                fn(x)
        times: dict[str, list[float]] = {kern: [] for kern in kernels}
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        n_calls = max(1, args.calls * 32 // max(m, 32))
        for _ in range(args.rounds):
            for kern in kernels:  # alternated round by round
                copies = built[kern]
                t = clock()
                for i in range(n_calls):
                    copies[i % len(copies)][0](x)
                times[kern].append((clock() - t) / n_calls * 1e3)
        cells = []
        for kern in kernels:
            ms = min(times[kern]) if args.stat == "min" else statistics.median(times[kern])
            gflops = 2 * m * n * k / ms / 1e6
            cells.append(f"{ms:.3f} ({gflops:.0f})")
            out.append(
                {"shape": name, "rows": m, "kernel": kern, "runs": built[kern][0][2], "ms": ms, "gflops": gflops}
            )
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 4, 8, 16, 32, 64, 512])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--no-bitwise", action="store_true", help="skip the bitwise quantized path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--isa", default="", help="force the quantized GEMMs' variant (avx2: the fallback)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--ghz", type=float, default=0.0, help="the clock for the nominal peak (default: the OS's)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time (with --threads 1), for a loaded machine",
    )
    parser.add_argument("--stat", choices=("median", "min"), default="median", help="min: on a loaded machine")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu times the calling thread: run it with --threads 1")
    ok, why = build.load(build=False)
    cores, ghz = torch.get_num_threads(), args.ghz or nominal_ghz()
    peak = peaks(cores, ghz)
    print(f"threads {cores} (cpus {os.cpu_count()}), {ghz:.2f} GHz, library: {why}")
    bf16, int8 = peak["bf16_flop_per_cycle"], peak["int8_op_per_cycle"]
    print(f"nominal peaks: bf16 {peak['bf16_gflops']:.0f} GFLOP/s ({cores} x {ghz:.2f} GHz x {bf16}), ", end="")
    print(f"int8 {peak['int8_gops']:.0f} GOP/s (x {int8})")
    kernels = ["bf16"]
    for fmt in args.formats.split(","):
        kernels += ([] if args.no_bitwise else [fmt]) + [f"{fmt}+a8"]
    cells = []
    for name in args.shapes.split(","):
        cells += bench_shape(name, *SHAPES[name], args, kernels)
    result = {"threads": cores, "ghz": ghz, "peaks": peak, "library": why if ok else None, "cells": cells}
    return result


if __name__ == "__main__":
    import sys

    from orcaserve.bench import cli

    sys.exit(cli.main(["kernels", "int8", *sys.argv[1:]]))
