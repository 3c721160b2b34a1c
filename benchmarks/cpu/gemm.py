"""The CPU GEMMs the decoder runs, against each other and torch's, in one timing loop.

    orcaserve-bench kernels gemm  [--dtype bfloat16] [--rows 1,32,128,256,384,512]
    orcaserve-bench kernels quant [--kernels fp32,bf16,q8_0,q4_0,q4_1,q4_k,q6_k,t_int8,t_int4,t_w8a8]
    orcaserve-bench kernels int8  [--formats q4_0,q8_0,q4_1,q4_k,q6_k] [--no-bitwise] [--isa avx2]
    orcaserve-bench kernels ternary [--kernels bf16,ternary,t_ternary]
    ... [--rows 1,4,8,16,32,64,512] [--shapes qkv,o,gate_up,down,lm_head] [--model smollm2]
        [--threads N] [--clock cpu] [--stat min]

The steps differ in shapes, kernels and figure (docs/kernels.md, docs/int8-activations.md):
- gemm: SmolLM2-135M's shapes, the dense GEMMs the lean decoder may pick (`kernels/linear.py`):
  oneDNN on a pre-packed weight (`pre`), `F.linear` (`plain`), in fp32 MKL's packed GEMM (`mkl`),
  the project's packed GEMM (`orca`) and in bf16 its `vdpbf16ps` GEMM (`dot`); GFLOP/s.
- quant: Llama-3.2-1B's shapes, the dense GEMMs (`fp32`, `bf16`: `Linear`), the GGUF block formats
  served bitwise (`q8_0` ... `q6_k`: `QuantLinear`) and torch's packed int8 / int4 ops and dynamic
  int8 linear (`t_int8`, `t_int4`, `t_w8a8`); weight GB/s.
- int8: Llama-3.2-1B's shapes, bf16 beside each format bitwise and with int8 activations
  (`<fmt>+a8`); GFLOP/s against this CPU's nominal peaks.
- ternary: BitNet b1.58 2B4T's shapes, the same weights in bf16 (`Linear`), ternary through the
  dispatch table's kernel (`ternary`: two bits a weight) and through the PyTorch twin (`t_ternary`:
  int8 and torch._int_mm), activations quantized per token inside each call (docs/bitnet.md); GB/s.
`read` (int8 step, `--kernels read,q4_0+a8`) is a plain read of as many bytes as the first
`--formats` entry's int8-activation panels, torch's sum: the rate a GEMV could read them at.
The K-quants' codes are made from q4_1's and q8_0's (the speed does not depend on the values).
Quant and int8 cycle each kernel over copies of its weight, at least `--min-mb` a round (48 MB: 3x
a Zen 2's L3), so the weight streams from DRAM as in a decode step; gemm reuses one weight (0).
Per row count: the median (`--stat min`: the fastest) of `--rounds` rounds of `--calls` calls
(fewer from 64 rows on), the kernels alternated round by round. `--clock cpu --threads 1` times
the thread's CPU time, for a machine shared with other work. Peaks are nominal: cores x GHz x
operations per cycle and core from the CPU's flags (bf16: vdpbf16ps 64, AMX 1024; int8: vpdpbusd
128, AMX-INT8 2048).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.bench import result
from orcaserve.bench.cpu.dram import INT8_PACKED_BYTES
from orcaserve.kernels.cpu import build
from orcaserve.kernels.linear import MKL_PACK_ROWS, Linear
from orcaserve.kernels.quant import BlockCodes, QuantLinear, quantize
from orcaserve.kernels.ternary import TernaryLinear

# (out, in); lm_head only where --shapes names it
SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LLAMA1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "lm_head": (128256, 2048)}  # fmt: skip
BITNET2B = {"qkv": (3840, 2560), "o": (2560, 2560), "gate_up": (13824, 2560), "down": (2560, 6912)}
MODELS = {"llama1b": LLAMA1B, "smollm2": SMOLLM2, "bitnet2b": BITNET2B}
FORMATS = ("q4_0", "q8_0", "q4_1", "q4_k", "q6_k")
# step: (shapes, default kernels, default rows, MB of weight copies a round, figure)
STEPS: dict[str, tuple[dict[str, tuple[int, int]], str, str, int, str]] = {
    "gemm": (SMOLLM2, "pre,plain,mkl,orca,dot", "1,32,128,256,384,512", 0, "GFLOP/s"),
    "quant": (LLAMA1B, "fp32,bf16,q8_0,q4_0,q4_1,q4_k,q6_k,t_int8,t_int4,t_w8a8", "1,4,8,16,32,64,512", 48, "GB/s"),
    "int8": (LLAMA1B, "", "1,4,8,16,32,64,512", 48, "GFLOP/s"),
    "ternary": (BITNET2B, "bf16,ternary,t_ternary", "1,4,32,512", 48, "GB/s"),
}
Kernel = tuple[Callable[[torch.Tensor], Any], int, torch.dtype, str]  # (call, weight bytes, x dtype, what runs)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def nominal_ghz() -> float:
    """The highest frequency the OS reports (cpufreq's maximum, else /proc/cpuinfo's current)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6
    except (OSError, ValueError):
        text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        mhz = [float(x.split(":")[1]) for x in text.splitlines() if x.startswith("cpu MHz")]
        return max(mhz) / 1e3 if mhz else 0.0


def peaks(cores: int, ghz: float) -> dict[str, float]:
    """Nominal GFLOP/s (GOP/s for int8): operations per cycle and core times cores and GHz."""
    f = cpu_flags()
    bf16 = 1024 if "amx_bf16" in f else 64 if "avx512_bf16" in f or "avx512f" in f else 32
    int8 = 2048 if "amx_int8" in f else 128 if "avx512_vnni" in f or "avx512bw" in f else 64
    return {"bf16_flop_per_cycle": bf16, "int8_op_per_cycle": int8, "bf16_gflops": cores * ghz * bf16,
            "int8_gops": cores * ghz * int8}  # fmt: skip


def orca_op(name: str) -> Any:
    """`torch.ops.orcaserve.<name>` in the widest ISA variant loaded here, None where none is."""
    packet = getattr(torch.ops.orcaserve, name, None)
    found = [v for v in build.built_variants() if packet is not None and hasattr(packet, v)]
    return getattr(packet, found[-1]) if found else None


def codes_for(w: torch.Tensor, fmt: str) -> BlockCodes:
    """Codes of `fmt`; a K-quant's in its served layout from the quantizers there are (timing only)."""
    if fmt == "q4_k":
        c = quantize(w, "q4_1")
        return BlockCodes(fmt, c.q, c.scale, c.offset)
    if fmt == "q6_k":
        c = quantize(w, "q8_0")
        return BlockCodes(fmt, c.q >> 2, c.scale.repeat_interleave(2, dim=1) * 4, None)
    return quantize(w, fmt)


def torch_kernel(kernel: str, w: torch.Tensor) -> Kernel:
    """torch's own: packed int8 (per channel) or int4 (group 32) weights, or the dynamic int8 linear."""
    n, k = w.shape
    scale = w.abs().amax(1) / 127
    if kernel == "t_int8":
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        s = scale.bfloat16()
        mm8 = torch.ops.aten._weight_int8pack_mm
        return (lambda x: mm8(x, q, s)), q.numel() + 2 * s.numel(), torch.bfloat16, kernel
    if kernel == "t_int4":
        g = w.view(n, k // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        sc = ((hi - lo) / 15).clamp(min=1e-8)
        q4 = torch.round((g - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 8)
        sz = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous().bfloat16()  # [K / 32, N, 2]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return (lambda x: mm(x, packed, 32, sz)), packed.numel() + 2 * sz.numel(), torch.bfloat16, kernel
    lin = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False, dtype=torch.qint8)
    with warnings.catch_warnings():  # quantized tensor constructors are deprecated, the op is not gone
        warnings.simplefilter("ignore")
        zeros = torch.zeros(n, dtype=torch.long)
        lin.set_weight_bias(torch.quantize_per_channel(w, scale, zeros, 0, torch.qint8), None)
    return lin, n * k + 4 * n, torch.float32, f"{kernel} ({torch.backends.quantized.engine})"


def make(kernel: str, w: torch.Tensor, args: argparse.Namespace) -> Kernel:
    """One copy of weight `w` [N, K] ready for `kernel`."""
    dt = getattr(torch, args.dtype)
    size = w.numel() * w.element_size()
    if kernel == "pre":
        onednn = torch.ops.mkldnn._reorder_linear_weight(w.to(dt), None)
        return (lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")), size, dt, "oneDNN"
    if kernel == "plain":
        wd = w.to(dt)
        return (lambda x: F.linear(x, wd)), size, dt, "F.linear"
    if kernel == "mkl":
        wd, mkl = w.to(dt), torch.ops.mkl._mkl_reorder_linear_weight(w.to(dt), MKL_PACK_ROWS)
        return (lambda x: torch.ops.mkl._mkl_linear(x, mkl, wd, None, x.shape[0])), size, dt, "MKL packed"
    if kernel in ("orca", "dot"):
        name = "linear_packed" if kernel == "orca" else "linear_packed_bf16"
        op, packed = orca_op(name), orca_op("pack_linear_weight" + name[13:])(w.to(dt))
        return (lambda x: op(x, packed, None, w.shape[0])), size, dt, f"orcaserve::{name}"
    if kernel in ("fp32", "bf16"):
        lin = Linear(w if kernel == "fp32" else w.bfloat16(), None, pack=True)
        x_dt = torch.float32 if kernel == "fp32" else torch.bfloat16
        return lin, lin.weight.numel() * lin.weight.element_size(), x_dt, lin.kernel
    if kernel in ("ternary", "t_ternary"):
        ternary = (w / w.abs().mean()).round().clamp(-1, 1).to(torch.int8)
        layer = TernaryLinear(ternary, torch.ones(w.shape[0]), kernel="torch" if kernel == "t_ternary" else None)
        return layer, layer.nbytes(), torch.bfloat16, layer.kernel
    if kernel.startswith("t_"):
        return torch_kernel(kernel, w)
    if kernel == "read":  # a plain read (torch's sum) of the first format's int8-activation bytes
        fmt = args.formats.split(",")[0]
        buf = torch.ones(w.shape[0] * w.shape[1] // 32 * INT8_PACKED_BYTES[fmt] // 4)
        return (lambda x: buf.sum()), buf.numel() * 4, torch.bfloat16, f"sum of {fmt}+a8's bytes"
    fmt, _, act = kernel.partition("+")
    forced = f"orcaserve.{'linear_int8' if act else 'linear_quant'}.{args.isa}" if args.isa else None
    q = QuantLinear(codes_for(w, fmt), None, kernel=forced, activations="int8" if act else None)
    return q, q.nbytes(), torch.bfloat16, q.kernel


def bench_shape(name: str, n: int, k: int, kernels: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every kernel at every row count for one weight shape; prints a table, returns its cells."""
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    built: dict[str, list[Kernel]] = {}
    for kern in kernels:
        first = make(kern, w, args)
        built[kern] = [first] + [make(kern, w, args) for _ in range(math.ceil((args.min_mb << 20) / first[1]) - 1)]
    figure = STEPS[args.step][4]
    say(f"\n{name} [{n} x {k}]: " + ", ".join(f"{kn}={built[kn][0][3]}" for kn in kernels))
    say("| rows | " + " | ".join(f"{kn} ms ({figure})" for kn in kernels) + " |")
    say("|" + " --- |" * (len(kernels) + 1))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    cells = []
    for m in args.rows:
        xs = {dt: torch.randn(m, k).to(dt) for dt in {c[2] for copies in built.values() for c in copies}}
        with torch.inference_mode():
            for kern in kernels:  # warm-up: first calls (oneDNN compiles per shape), page faults
                for fn, _, dt, _ in built[kern]:
                    fn(xs[dt])
            times: dict[str, list[float]] = {kern: [] for kern in kernels}
            n_calls = max(1, args.calls * 32 // max(m, 32))  # prefill sizes: fewer calls, each is long
            for r in range(args.rounds):
                for kern in kernels if r % 2 == 0 else kernels[::-1]:  # alternated round by round
                    copies = built[kern]
                    t = clock()
                    for i in range(n_calls):
                        fn, _, dt, _ = copies[i % len(copies)]
                        fn(xs[dt])
                    times[kern].append((clock() - t) / n_calls * 1e3)
        row = []
        for kern in kernels:
            ms = min(times[kern]) if args.stat == "min" else statistics.median(times[kern])
            cell = {"shape": name, "rows": m, "kernel": kern, "runs": built[kern][0][3], "ms": ms}
            cell.update(gflops=2 * m * n * k / ms / 1e6, gbps=built[kern][0][1] / ms / 1e6)
            cells.append(cell)
            gbps = figure == "GB/s" or "read" in kernels  # beside a plain read: both at the read's figure
            row.append(f"{ms:.3f} ({cell['gbps' if gbps else 'gflops']:.{1 if gbps else 0}f})")
        say(f"| {m} | " + " | ".join(row) + " |")
    return cells


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", default=None, help="row counts (default per step: " + "; ".join(
        f"{s} {v[2]}" for s, v in STEPS.items()) + ")")  # fmt: skip
    ap.add_argument("--shapes", default="qkv,o,gate_up,down", help="add lm_head for the vocabulary projection")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="whose shapes (default per step)")
    per_step = "; ".join(f"{s} {v[1]}" for s, v in STEPS.items())
    ap.add_argument("--kernels", default=None, help=f"default per step: {per_step}")
    ap.add_argument("--formats", default=",".join(FORMATS), help="int8: each as <fmt> and <fmt>+a8")
    ap.add_argument("--no-bitwise", action="store_true", help="int8: skip the bitwise quantized path")
    ap.add_argument("--dtype", default="bfloat16", help="gemm: the weight's and x's dtype")
    ap.add_argument("--isa", default="", help="force the quantized GEMMs' variant (avx2: the fallback)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--min-mb", type=int, default=None, help="weight copies read a round (default per step)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--ghz", type=float, default=0.0, help="the clock for the nominal peak (default: the OS's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: this thread's CPU time")
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="min: on a loaded machine")


LINES = result.Table()  # what run() printed
say = LINES.say


def run(args: argparse.Namespace) -> dict[str, Any]:
    LINES.clear()
    shapes, kernels, rows, min_mb, _ = STEPS[args.step]
    shapes = MODELS[args.model] if args.model else shapes
    args.rows = [int(r) for r in (args.rows or rows).split(",")]
    args.min_mb = min_mb if args.min_mb is None else args.min_mb
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu times the calling thread: run it with --threads 1")
    ok, why = build.load(build=False)
    if args.step == "int8":
        kernels = "bf16," + ",".join(("" if args.no_bitwise else f"{f},") + f"{f}+a8" for f in args.formats.split(","))
    chosen = (args.kernels or kernels).split(",")
    if args.step == "gemm":  # what this CPU and build have
        dt = getattr(torch, args.dtype)
        have = {"pre": dt == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                "mkl": dt == torch.float32 and torch.backends.mkl.is_available(),
                "orca": ok and orca_op("linear_packed") is not None,
                "dot": dt == torch.bfloat16 and ok and orca_op("linear_packed_bf16") is not None}  # fmt: skip
        chosen = [c for c in chosen if have.get(c, True)]
    cores, ghz = torch.get_num_threads(), args.ghz or nominal_ghz()
    peak = peaks(cores, ghz)
    say(f"threads {cores} (cpus {os.cpu_count()}), {ghz:.2f} GHz, library: {why}")
    bf16, int8 = peak["bf16_flop_per_cycle"], peak["int8_op_per_cycle"]
    say(f"nominal peaks: bf16 {peak['bf16_gflops']:.0f} GFLOP/s ({cores} x {ghz:.2f} GHz x {bf16}), "
        f"int8 {peak['int8_gops']:.0f} GOP/s (x {int8})")  # fmt: skip
    cells = []
    for name in args.shapes.split(","):
        cells += bench_shape(name, *shapes[name], chosen, args)
    return {"threads": cores, "ghz": ghz, "peaks": peak, "library": why if ok else None, "cells": cells,
            "table": list(LINES)}  # fmt: skip
