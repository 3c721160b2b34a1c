"""The decoder's GEMM shapes on this CPU: first call against later calls, pre-packed against plain.

    orcaserve-bench kernels gemm [--dtype bfloat16] [--rows 32,128,256,384,512]
    orcaserve-bench kernels gemm --dtype float32 --layers 30 --rows 1,8,32,128,512   # weights in DRAM

SmolLM2-135M's shapes (hidden 576, q/k/v 960, intermediate 1536 x 2), random weights, the calls
the lean decoder makes (`orcaserve.kernels.linear.Linear`): oneDNN on a pre-packed weight,
`F.linear` on the plain one, in fp32 MKL's packed GEMM, and where built the project's own GEMMs
(`orcaserve::linear_packed`, fp32 and bf16; `orcaserve::linear_packed_bf16`, `vdpbf16ps`). Per row
count: oneDNN's first call (it compiles a kernel per new shape) and the median of `--rounds`
rounds of 10 calls of each, alternated round by round; those reuse one weight, which stays in
cache. `--layers N` calls each layer's four GEMMs in turn over N layers' weights, as a step does,
and prints ms per N layers (the minimum of `--rounds`). `--library` loads another build of the
project's ops (e.g. an older kernel's .so from the build cache). Runs that used it:
docs/performance-log.md (2026-11-30 and 2026-12-01 GEMM sections).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.bench import result
from orcaserve.kernels.cpu import build
from orcaserve.kernels.linear import MKL_PACK_ROWS

LINES = result.Table()  # what run() printed
say = LINES.say
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)


def _ms(f, calls: int = 10) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t) / calls * 1e3


def orca_op(name: str) -> Any:
    """`torch.ops.orcaserve.<name>` in the widest ISA variant loaded here, None where none is."""
    build.load(build=True)
    packet = getattr(torch.ops.orcaserve, name, None)
    found = [v for v in build.built_variants() if packet is not None and hasattr(packet, v)]
    return getattr(packet, found[-1]) if found else None


def _variants(
    x: torch.Tensor,
    w: torch.Tensor,
    onednn: torch.Tensor,
    mkl: torch.Tensor | None,
    orca: torch.Tensor | None,
    dot: torch.Tensor | None = None,
) -> dict:
    """The calls to time for one weight and input: oneDNN on its pre-packed copy, F.linear, and in
    fp32 MKL's packed GEMM (one copy, packed for MKL_PACK_ROWS, serving every row count) and the
    project's GEMM on its 24-column panels; in bf16 its `vdpbf16ps` GEMM on 48-column pair panels."""
    calls = {
        "pre": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
        "plain": lambda: F.linear(x, w),
    }
    if mkl is not None:
        calls["mkl"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, x.shape[0])
    if orca is not None:
        calls["orca"] = lambda: orca_op("linear_packed")(x, orca, None, w.shape[0])
    if dot is not None:
        calls["dot"] = lambda: orca_op("linear_packed_bf16")(x, dot, None, w.shape[0])
    return calls


def layers_in_dram(
    args, dtype: torch.dtype, use_mkl: bool, use_orca: bool, onednn: bool, use_dot: bool = False
) -> None:
    """Each library over `args.layers` layers' own weights, four GEMMs per layer, as a step calls them;
    F.linear in oneDNN's place where it cannot pack the dtype (bf16 on AVX2-only CPUs)."""
    libs = ["pre" if onednn else "plain", *(["mkl"] if use_mkl else []), *(["orca"] if use_orca else [])]
    libs += ["dot"] if use_dot else []
    layers: list[dict[str, Any]] = []
    for _ in range(args.layers):
        weights = {n: torch.randn(shape, dtype=dtype) * 0.02 for n, shape in SHAPES.items()}
        layers.append(
            {
                n: {
                    "pre": torch.ops.mkldnn._reorder_linear_weight(w, None) if onednn else None,
                    "mkl": torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS) if use_mkl else None,
                    "orca": orca_op("pack_linear_weight")(w) if use_orca else None,
                    "dot": orca_op("pack_linear_weight_bf16")(w) if use_dot else None,
                    "plain": w,
                }
                for n, w in weights.items()
            }
        )
    say(f"{args.dtype}, {torch.get_num_threads()} threads, {args.layers} layers' weights; ms per {args.layers} layers")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {n: torch.randn(m, shape[1], dtype=dtype) for n, shape in SHAPES.items()}
            steps = {
                lib: [
                    _variants(xs[n], c["plain"], c["pre"], c["mkl"], c["orca"], c["dot"])[lib]
                    for c0 in layers
                    for n, c in c0.items()
                ]
                for lib in libs
            }
            times: dict[str, list[float]] = {lib: [] for lib in libs}
            for r in range(args.rounds + 1):
                for lib in libs if r % 2 == 0 else libs[::-1]:
                    t = time.perf_counter()
                    for call in steps[lib]:
                        call()
                    if r:  # the first round compiles oneDNN's kernels for this row count
                        times[lib].append((time.perf_counter() - t) * 1e3)
            flops = 2 * m * sum(o * i for o, i in SHAPES.values()) * args.layers
            cells = [f"{lib} {min(times[lib]):.1f} ({flops / min(times[lib]) / 1e6:.0f} GFLOP/s)" for lib in libs]
            say(f"M={m:4d}: " + "   ".join(cells))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,32,128,256,384,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=0, help="N layers' weights called in turn (weights in DRAM)")
    ap.add_argument("--library", default=None, help="compiled orcaserve CPU ops (.so) to load instead")


def run(args: argparse.Namespace) -> dict:
    LINES.clear()
    if args.library:  # an older build of the ops, e.g. from the build cache, against the current one
        from pathlib import Path

        build.library_path = lambda variants=None: Path(args.library)
    dtype = getattr(torch, args.dtype)
    onednn = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if not (onednn or args.layers):
        sys.exit(
            "oneDNN cannot pack bf16 on this CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): "
            "try --dtype float32, or --layers N (F.linear against the project's GEMM)"
        )
    torch.manual_seed(0)
    use_mkl = dtype == torch.float32 and torch.backends.mkl.is_available()
    use_orca = dtype in (torch.float32, torch.bfloat16) and orca_op("linear_packed") is not None
    use_dot = dtype == torch.bfloat16 and orca_op("linear_packed_bf16") is not None
    if args.layers:
        layers_in_dram(args, dtype, use_mkl, use_orca, onednn, use_dot)
        return {"table": list(LINES)}
    weights = {n: torch.randn(shape, dtype=dtype) for n, shape in SHAPES.items()}
    packed = {n: torch.ops.mkldnn._reorder_linear_weight(w, None) for n, w in weights.items()}
    mkl = {n: torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS) for n, w in weights.items() if use_mkl}
    orca = {n: orca_op("pack_linear_weight")(w) for n, w in weights.items() if use_orca}
    dot = {n: orca_op("pack_linear_weight_bf16")(w) for n, w in weights.items() if use_dot}
    heads = {
        "pre": "oneDNN pre-packed",
        "plain": "F.linear",
        "mkl": "MKL packed",
        "orca": "orcaserve",
        "dot": "orcaserve vdpbf16ps",
    }
    skip = {"mkl": not use_mkl, "orca": not use_orca, "dot": not use_dot}
    columns = [c for c in heads if not skip.get(c, False)]
    names = " | ".join(heads[c] for c in columns)
    say(f"{args.dtype}, {torch.get_num_threads()} threads; ms per call: first | {names}")
    with torch.no_grad():
        for m in (int(r) for r in args.rows.split(",")):
            cells = []
            for name, w in weights.items():
                x = torch.randn(m, w.shape[1], dtype=dtype)
                calls = _variants(x, w, packed[name], mkl.get(name), orca.get(name), dot.get(name))
                first = _ms(calls["pre"], 1)
                for c in columns[1:]:
                    calls[c]()
                times: dict[str, list[float]] = {c: [] for c in columns}
                for r in range(args.rounds):
                    for c in columns if r % 2 == 0 else columns[::-1]:
                        times[c].append(_ms(calls[c]))
                medians = " | ".join(f"{statistics.median(times[c]):.2f}" for c in columns)
                cells.append(f"{name} {first:.2f} | {medians}")
            say(f"M={m:4d}: " + "   ".join(cells))
    return {"table": list(LINES)}
