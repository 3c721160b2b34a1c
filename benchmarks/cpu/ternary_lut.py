"""Lookup-table ternary GEMMs against the product's `vpdpbusd` kernel at BitNet b1.58 2B4T's shapes,
for measurement only (docs/bitnet.md, "The kernel"): bitnet.cpp's TL2 method (`tl2`), the same
bytes with the sign folded into a `vpermb` index (`tl2v`), and a 27-entry `vpermw` table (`perm27`).

    orcaserve-bench kernels ternary-lut [--rows 1,32] [--rounds 7] [--min-mb 96] [--check-only]
        [--clock cpu] [--stat min]     (--clock cpu: one thread, OMP_NUM_THREADS=1)

The LUT kernels live in benchmarks/cpu/ternary_lut*.cpp, built here by torch's extension loader for
AVX-512BW and VBMI (they are not part of the product library). Each is first checked against the
PyTorch twin (kernels/ternary.py: integer sums equal) at 1, 3, 8, 32 and 33 rows with extreme
activations, then timed: per row count, the kernels alternated call by call, each call on the next
of as many copies of its weight as fill `--min-mb` (so the weights stream from DRAM, as in a decode
step), each call timed alone; the median (`--stat min`: the fastest) of all calls of `--rounds`
rounds, by the wall clock on the threads torch has (`OMP_NUM_THREADS`), or by one thread's CPU time
(`--clock cpu`, for a machine shared with other work).
Printed: ms a call, GB/s of the packed weight, bits a weight, and GOP/s (2 N K rows a call).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from orcaserve.kernels.ternary import TernaryLinear

# (N, K): q and o, k and v, gate and up, down
SHAPES = {"q,o": (2560, 2560), "k,v": (640, 2560), "gate,up": (6912, 2560), "down": (2560, 6912)}
CHECK_ROWS = (1, 3, 8, 32, 33)


def build() -> Any:
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi"]
    here = Path(__file__).parent
    sources = [str(here / f"ternary_lut{part}.cpp") for part in ("", "_tl2", "_perm27")]
    return load("orcaserve_ternary_lut", sources, extra_cflags=flags, extra_ldflags=["-fopenmp"])


def kernels(ext: Any, w: torch.Tensor) -> dict[str, tuple[Any, torch.Tensor]]:
    """name -> (op(x, packed, n), packed weight)"""
    layer = TernaryLinear(w, torch.ones(w.shape[0]))
    if layer.kernel == "torch":
        raise SystemExit("the C++ ternary kernel is not built here: nothing to compare against")
    return {"vpdpbusd": (layer._op, layer.weight), "tl2": (ext.linear_tl2, ext.pack_tl2(w)),
            "tl2v": (ext.linear_tl2v, ext.pack_tl2v(w)),
            "perm27": (ext.linear_perm27, ext.pack_perm27(w))}  # fmt: skip


def check(ext: Any, n: int, k: int) -> None:
    w = torch.randint(-1, 2, (n, k), dtype=torch.int8)
    twin = TernaryLinear(w, torch.ones(n), kernel="torch")
    for rows in CHECK_ROWS:
        x = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
        x[0, : k // 2] = -128  # extreme sums: every group's entry at its bound
        want = twin.int_sums(x)
        for name, (op, packed) in kernels(ext, w).items():
            if not torch.equal(op(x, packed, n), want):
                raise SystemExit(f"{name} differs from the twin at [{n} x {k}], {rows} rows")


def time_rows(ops: dict[str, tuple[Any, list[torch.Tensor]]], x: torch.Tensor, n: int, args: Any) -> dict[str, float]:
    """Seconds a call per kernel: the median (or the fastest) of its calls, each timed alone (on a
    shared machine the fastest two-thread call is one where neither thread was descheduled), the
    kernels alternated call by call; by the wall clock or the calling thread's CPU time."""
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in ops}
    calls = max(len(copies) for _, copies in ops.values())
    for _ in range(args.rounds):
        for i in range(calls):
            for name, (op, copies) in ops.items():
                packed = copies[i % len(copies)]
                start = clock()
                op(x, packed, n)
                times[name].append(clock() - start)
    stat = min if args.stat == "min" else statistics.median
    return {name: stat(v) for name, v in times.items()}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-mb", type=int, default=96, help="MB of weight copies a kernel cycles over")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="keys of SHAPES, ';'-separated or 'all'")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the thread's CPU time")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--check-only", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu times the calling thread: run with OMP_NUM_THREADS=1")
    ext = build()
    shapes = SHAPES if args.shapes == ",".join(SHAPES) else {s: SHAPES[s] for s in args.shapes.split(";")}
    for n, k in shapes.values():
        check(ext, n, k)
    print(f"exact against the twin at {', '.join(f'[{n} x {k}]' for n, k in shapes.values())}, rows {CHECK_ROWS}")
    if args.check_only:
        return {"exact": True}
    how = f"threads {torch.get_num_threads()}, {args.clock} clock, {args.stat}"
    print(f"{how}; ms a call, GB/s of packed weight, bits a weight, GOP/s")
    print("| shape [N x K] | rows | kernel | ms | GB/s | bits/w | GOP/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    table: list[dict[str, Any]] = []
    for label, (n, k) in shapes.items():
        w = torch.randint(-1, 2, (n, k), dtype=torch.int8)
        ops: dict[str, tuple[Any, list[torch.Tensor]]] = {}
        for name, (op, packed) in kernels(ext, w).items():
            copies = max(2, -(-args.min_mb * 2**20 // packed.numel()))
            ops[name] = (op, [packed] + [packed.clone() for _ in range(copies - 1)])
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
            for name, sec in time_rows(ops, x, n, args).items():
                nbytes = ops[name][1][0].numel()
                table.append({"shape": label, "rows": rows, "kernel": name, "ms": sec * 1e3, "bytes": nbytes})
                print(f"| {label} [{n} x {k}] | {rows} | {name} | {sec * 1e3:.3f} | {nbytes / sec / 1e9:.1f} "
                      f"| {8 * nbytes / (n * k):.2f} | {2 * n * k * rows / sec / 1e9:.0f} |")  # fmt: skip
        del ops
    return {"exact": True, "calls": table}
