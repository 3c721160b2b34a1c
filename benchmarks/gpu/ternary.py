"""Time BitNet's ternary GEMM in Triton (kernels/triton/ternary.py) on a CUDA GPU at BitNet
2B4T's projections, against the GEMMs it stands beside.

    orcaserve-bench gpu ternary [--tokens 1,16,256] [--out ternary.json] [--time-budget S]
    orcaserve-bench gpu ternary --smoke     # CPU, TRITON_INTERPRET=1, tiny: every code path

Per projection (2B4T: hidden 2560, q/k/v 3840, gate/up 2 x 6912, down from 6912) and step size T:
  exact      the int32 sums bit for bit an fp32 matmul of the same values (every sum is an integer
             below 2^24, so fp32 holds it exactly)
  triton_ms  ternary_int_mm (median, L2 flushed); gbps the bytes it must move (the packed weight,
             two bits a value, the int8 rows, the int32 sums) over that time
  int_mm_ms  torch._int_mm on the same weight unpacked to int8 (the twin's op; None where CUDA's
             _int_mm refuses the shape: it wants more than 16 rows)
  bf16_ms    F.linear on a bf16 weight of the same shape (what a bf16 copy of the model runs)
Exit status 1 if a sum is wrong. Without CUDA and without --smoke it says so and exits 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from orcaserve.bench.gpu.common import Results, Timer, add_step_arguments, device, finish_rows, save_rows

# name: (outputs, inputs) at BitNet 2B4T's widths
SHAPES = {"qkv": (3840, 2560), "o": (2560, 2560), "gate_up": (13824, 2560), "down": (2560, 6912)}
SMOKE = {"qkv": (40, 64), "down": (16, 96)}


def bench(name: str, n: int, k: int, t: int, dev, timer: Timer) -> dict:
    from orcaserve.kernels.triton.ternary import pack_ternary, ternary_int_mm

    g = torch.Generator(device=dev).manual_seed(n + t)
    w = torch.randint(-1, 2, (n, k), generator=g, device=dev, dtype=torch.int8)
    x = torch.randint(-128, 128, (t, k), generator=g, device=dev, dtype=torch.int8)
    packed = pack_ternary(w)
    got = ternary_int_mm(x, packed, n)
    want = (x.float() @ w.float().t()).to(torch.int32)
    row: dict = {"projection": name, "tokens": t, "out": n, "in": k, "exact": torch.equal(got, want)}
    row["bytes"] = packed.numel() + x.numel() + 4 * t * n
    row["triton_ms"] = timer(lambda: ternary_int_mm(x, packed, n))
    row["gbps"] = round(row["bytes"] / row["triton_ms"] / 1e6, 1)
    try:
        row["int_mm_ms"] = timer(lambda: torch._int_mm(x, w.t()))
    except RuntimeError:
        row["int_mm_ms"] = None
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    row["bf16_ms"] = timer(lambda: F.linear(xb, wb))
    return row


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_step_arguments(ap, None, "1,16,256")


def run(args: argparse.Namespace) -> dict:
    dev = device("ternary", args.smoke)
    if isinstance(dev, dict):
        return dev
    shapes = SHAPES if dev.type == "cuda" else SMOKE
    if dev.type != "cuda":
        args.tokens = "1,3"
    res = Results(args.out, dev, shapes=shapes, rows=[])
    result, timer = res.data, Timer(dev)
    result["truncated"] = False
    for t in (int(n) for n in args.tokens.split(",")):
        if res.over(args.time_budget):
            result["truncated"] = True
            print(f"time budget of {args.time_budget} s reached; stopping")
            break
        for name, (n, k) in shapes.items():
            r = bench(name, n, k, t, dev, timer)
            result["rows"].append(r)
            int_mm = "-" if r["int_mm_ms"] is None else f"{r['int_mm_ms'] * 1e3:.1f} us"
            print(
                f"T={t:<4} {name:<8} {'exact' if r['exact'] else 'WRONG'} triton {r['triton_ms'] * 1e3:8.1f} us "
                f"({r['gbps']:7.1f} GB/s) _int_mm {int_mm} bf16 {r['bf16_ms'] * 1e3:8.1f} us",
                flush=True,
            )
        save_rows(res, "all_exact", "exact")
    return finish_rows(res, dev, "all_exact", "exact")
