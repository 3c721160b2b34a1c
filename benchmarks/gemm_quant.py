"""GGUF block formats served quantized: the project's GEMM over packed codes against its fp32 and
bf16 GEMMs and torch's own packed int8/int4 ops, at Llama-3.2-1B's GEMM shapes.

    orcaserve-bench kernels quant [--rows 1,4,8,16,32,64,512] [--shapes qkv,o,gate_up,down]

Kernels (each on the same random weight, x fp32 except where said):
- fp32, bf16: `kernels/linear.py`'s Linear, the project's packed GEMM (bf16: weight and x bf16);
- q8_0, q4_0, q4_1: `kernels/quant.py`'s QuantLinear on the dispatch table's kernel (the C++ GEMM
  over packed codes where built, `kernels/cpu/csrc/gemm/gemm_quant.cpp`), bf16 x as the decoder
  runs it in bf16;
- q4_k, q6_k: the same over K-quant codes (fp32 scales, 6 and 10 bits a weight), made from q4_1's
  and q8_0's codes (q8_0's codes >> 2; there is no K-quant quantizer here): the speed does not
  depend on the values;
- t_int8: `torch.ops.aten._weight_int8pack_mm`, per-channel int8, bf16 x;
- t_int4: `torch.ops.aten._weight_int4pack_mm_for_cpu`, group 32, bf16 x;
- t_w8a8: torch's dynamic int8 linear (`torch.ao.nn.quantized.dynamic.Linear` on the x86/fbgemm
  engine): per-channel int8 weight, x fp32 quantized to uint8 per call (one scale for the whole
  batch), integer dot products (`vpmaddubsw` on AVX2, VNNI where the CPU has it). What integer
  arithmetic on quantized activations buys on this CPU, as llama.cpp's q8 activations do
  (docs/performance-log.md#2026-12-05-integer-dot-products-on-quantized-activations-measured-not-built-amd-epyc-zen-2).
Each kernel cycles over enough copies of its weight to read at least 48 MB per round (3x this
Zen 2's L3), so the weight comes from DRAM as in a decode step over 16 layers. Prints ms per call
(median, or with `--stat min` the fastest, of `--rounds` rounds of `--calls` calls, fewer from 64
rows on; kernels alternated round by round) and the weight
bytes read per second (GB/s) (docs/performance-log.md
#2026-12-05-gguf-codes-served-quantized-the-cpu-gemm-over-packed-q8_0q4_0q4_1-amd-epyc-zen-2).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from orcaserve.bench import result
from orcaserve.kernels.cpu import build
from orcaserve.kernels.linear import Linear
from orcaserve.kernels.quant import BlockCodes, QuantLinear, quantize

LINES = result.Table()  # what run() printed
say = LINES.say
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # (out, in)
KERNELS = ("fp32", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "t_int8", "t_int4", "t_w8a8")
MIN_BYTES = 48 << 20


def torch_int8(w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    s = scale.bfloat16()
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)), q.numel() + 2 * s.numel()


def torch_int4(w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    sc = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    sz = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous().bfloat16()  # [K / 32, N, 2]
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)), packed.numel() + 2 * sz.numel()


def torch_w8a8(w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    n, k = w.shape
    lin = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False, dtype=torch.qint8)
    scale = w.abs().amax(1) / 127
    with warnings.catch_warnings():  # quantized tensor constructors are deprecated, the op is not gone
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        lin.set_weight_bias(q, None)
    return lin, n * k + 4 * n


def k_quant(w: torch.Tensor, fmt: str) -> BlockCodes:
    """Codes in a K-quant's served layout, from the quantizers there are (timing only)."""
    if fmt == "q4_k":
        c = quantize(w, "q4_1")
        return BlockCodes(fmt, c.q, c.scale, c.offset)
    c = quantize(w, "q8_0")
    return BlockCodes(fmt, c.q >> 2, c.scale.repeat_interleave(2, dim=1) * 4, None)


def make(kernel: str, w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int, torch.dtype, str]:
    """(call, weight bytes, x dtype, what runs) for one copy of weight `w`."""
    if kernel in ("fp32", "bf16"):
        lin = Linear(w if kernel == "fp32" else w.bfloat16(), None, pack=True)
        size = lin.weight.numel() * lin.weight.element_size()
        return lin, size, torch.float32 if kernel == "fp32" else torch.bfloat16, lin.kernel
    if kernel.startswith("q"):
        q = QuantLinear(k_quant(w, kernel) if kernel.endswith("_k") else quantize(w, kernel), None)
        return q, q.nbytes(), torch.bfloat16, q.kernel
    if kernel == "t_w8a8":
        fn, size = torch_w8a8(w)
        return fn, size, torch.float32, f"{kernel} ({torch.backends.quantized.engine})"
    fn, size = torch_int8(w) if kernel == "t_int8" else torch_int4(w)
    return fn, size, torch.bfloat16, kernel


def bench_shape(
    name: str, n: int, k: int, rows: list[int], kernels: list[str], rounds: int, calls: int, stat: str
) -> None:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    built = {}
    for kern in kernels:
        first = make(kern, w)
        copies = [first] + [make(kern, w) for _ in range(max(0, math.ceil(MIN_BYTES / first[1]) - 1))]
        built[kern] = copies
    what = ", ".join(f"{kern}={built[kern][0][3]}" for kern in kernels)
    say(f"\n{name} [{n} x {k}]: {what}")
    say("| rows | " + " | ".join(f"{kern} ms (GB/s)" for kern in kernels) + " |")
    say("|" + " --- |" * (len(kernels) + 1))
    for m in rows:
        xs = {torch.float32: torch.randn(m, k), torch.bfloat16: torch.randn(m, k).bfloat16()}
        times: dict[str, list[float]] = {kern: [] for kern in kernels}
        for kern in kernels:  # warm-up: first calls, page faults
            for fn, _, dt, _ in built[kern]:
                fn(xs[dt])
        n_calls = max(1, calls * 32 // max(m, 32))  # prefill sizes: fewer calls, each is long
        for _ in range(rounds):
            for kern in kernels:
                copies = built[kern]
                t = time.perf_counter()
                for i in range(n_calls):
                    fn, _, dt, _ = copies[i % len(copies)]
                    fn(xs[dt])
                times[kern].append((time.perf_counter() - t) / n_calls * 1e3)
        cells = []
        for kern in kernels:
            ms = statistics.median(times[kern]) if stat == "median" else min(times[kern])
            cells.append(f"{ms:.3f} ({built[kern][0][1] / ms / 1e6:.1f})")
        say(f"| {m} | " + " | ".join(cells) + " |")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", default="1,4,8,16,32,64,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="min: on a loaded machine")


def run(args: argparse.Namespace) -> dict:
    LINES.clear()
    if args.threads:
        torch.set_num_threads(args.threads)
    ok, why = build.load(build=False)
    say(f"threads {torch.get_num_threads()}, library: {why}")
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        bench_shape(name, n, k, rows, args.kernels.split(","), args.rounds, args.calls, args.stat)
    return {"table": list(LINES)}
