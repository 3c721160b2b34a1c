"""`orcaserve-bench kernels lora`: one step's LoRA update by part, against the base GEMMs it rides
on (docs/lora.md "What it costs"; dated runs in docs/performance-log.md).

    orcaserve-bench kernels lora                       # SmolLM2, 32 rows, 16 adapters of rank 16
    orcaserve-bench kernels lora --rows 32 --adapters 1 --dtype float32
    OMP_NUM_THREADS=1 orcaserve-bench kernels lora --cold --clock cpu   # weights from memory, CPU time

At SmolLM2's widths, per layer: the base projections (the project's `Linear` over the fused q/k/v,
o, gate/up and down weights) and the update of every module an adapter targets (seven), through
the PyTorch twin's parts (the stacked shrink over all S R columns, the mask, the expand, the scale
and add; with one adapter, its GEMM pair) and through the C++ operator (gemm/lora.cpp) where the
library has it: once a module at a time over the standard stacks, and once as the engine calls it
(one call per fused output, over the blocked stacks where the engine holds them blocked). Each
figure is the median of `--repeats` timed passes over 30 layers' worth of calls, alternated:
microseconds per step (the 30 layers summed). By default one layer's weights
serve the 30 (they stay in cache: the arithmetic); `--cold` gives each layer its own, as the
engine's step streams them from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.kernels import dispatch
from orcaserve.kernels.cpu import build
from orcaserve.kernels.cpu.lora import batched_cell, block_a, block_b, blocked, parts_cell, sgmv_cell
from orcaserve.kernels.linear import Linear
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, lora_batched, lora_sgmv

# SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, MLP 1536; 30 layers.
HIDDEN, Q, KV, MLP, LAYERS = 576, 576, 192, 1536, 30
MODULES = {"q": (HIDDEN, Q), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (Q, HIDDEN), "gate": (HIDDEN, MLP),
           "up": (HIDDEN, MLP), "down": (MLP, HIDDEN)}  # fmt: skip
FUSED = {"qkv": (HIDDEN, Q + 2 * KV), "o": (Q, HIDDEN), "gate_up": (HIDDEN, 2 * MLP), "down": (MLP, HIDDEN)}


Calls = list[Callable[[], Any]]  # one layer's calls of a part, one per module


def _time(calls: Calls, reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    for _ in range(reps):
        for call in calls:
            call()
    return (clock() - start) * 1e6  # us for `reps` passes over `calls`


def _scale_add(y: torch.Tensor, d: torch.Tensor, scale: torch.Tensor) -> None:
    y.add_(d * scale if y.dtype == torch.float32 else (d.float() * scale).to(y.dtype))


def parts(args: argparse.Namespace) -> dict[str, Calls]:
    """name -> one layer's calls of that part (every module); with `--cold`, every layer's."""
    dt, t, s, r = getattr(torch, args.dtype), args.rows, args.adapters, args.rank
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dt)

    batch = LoraBatch.of([i * s // t for i in range(t)], s, r, [2.0] * s, dt)  # each adapter's rows adjacent
    # B as the engine holds it: an adapter's own [out, r] (PEFT's), the stacks' [out, S R] over B^T's
    # storage (scheduler/lora/resident.py)
    layers = LAYERS if args.cold else 1  # --cold: each layer its own weights, streamed from memory
    mods = [(rand(t, i), rand(t, o), rand(s * r, i), rand(o, r) if s == 1 else rand(s * r, o).t())
            for _ in range(layers) for i, o in MODULES.values()]  # fmt: skip
    base = [(rand(t, i), Linear(rand(o, i), None, pack=True)) for _ in range(layers) for i, o in FUSED.values()]
    hs = [F.linear(x, a) for x, _, a, _ in mods]
    ds = [F.linear(h, b) for h, (_, _, _, b) in zip(hs, mods)]
    out: dict[str, Calls] = {"base GEMMs": [partial(lin, x) for x, lin in base]}
    cap = dispatch.capability()
    if s == 1:
        groups = [[LoraGroup(slice(0, t), a, b, 2.0)] for _, _, a, b in mods]
        out["twin: shrink GEMM"] = [partial(F.linear, x, a) for x, _, a, _ in mods]
        out["twin: expand GEMM"] = [partial(F.linear, h, b) for h, (_, _, _, b) in zip(hs, mods)]
        out["twin: whole update"] = [partial(lora_sgmv, y, x, gr) for (x, y, _, _), gr in zip(mods, groups)]
        op = dispatch.orcaserve_op(f"orcaserve.lora_sgmv.{cap}")
        if op is not None:
            cell = sgmv_cell(op)
            out["C++ lora_sgmv"] = [partial(cell, y, x, gr) for (x, y, _, _), gr in zip(mods, groups)]
        return out
    out["twin: shrink GEMM (S R cols)"] = [partial(F.linear, x, a) for x, _, a, _ in mods]
    out["twin: mask"] = [partial(torch.mul, h, batch.mask) for h in hs]
    out["twin: expand GEMM"] = [partial(F.linear, h, b) for h, (_, _, _, b) in zip(hs, mods)]
    out["twin: scale + add"] = [partial(_scale_add, y, d, batch.scale) for d, (_, y, _, _) in zip(ds, mods)]
    out["twin: whole update"] = [partial(lora_batched, y, x, batch, a, b) for x, y, a, b in mods]
    op = dispatch.orcaserve_op(f"orcaserve.lora_batched.{cap}")
    if op is not None:
        batched = batched_cell(op)
        out["C++ lora_batched"] = [partial(batched, y, x, batch, a, b) for x, y, a, b in mods]
        out["C++ as the engine calls it"] = _engine_calls(op, mods, batch, blocked(op, dt))
    return out


def _engine_calls(op: Any, mods: list, batch: LoraBatch, blocks: bool) -> Calls:
    """The operator as `LoraStep.apply` calls it: one call per fused output (q/k/v, o, gate/up,
    down) over its projections' stacks, blocked where the engine holds them so (kernels/cpu/lora.py)."""
    cell, r, s = parts_cell(op), batch.rank, batch.num_slots
    calls: Calls = []
    for layer in range(len(mods) // len(MODULES)):
        m = dict(zip(MODULES, mods[layer * len(MODULES) : (layer + 1) * len(MODULES)]))
        for group in (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)):
            x, parts, first = m[group[0]][0], [], 0
            y = torch.cat([m[name][1] for name in group], dim=1)
            for name in group:
                _, _, a, b = m[name]
                width = b.shape[0]
                if blocks:
                    a = torch.stack([block_a(a[i * r : (i + 1) * r], r) for i in range(s)])
                    b = torch.stack([block_b(b[:, i * r : (i + 1) * r], r) for i in range(s)])
                parts.append((first, first + width, a, b))
                first += width
            calls.append(partial(cell, y, x, batch, parts))
    return calls


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", type=int, default=32, help="the step's rows (32: 32 decode streams)")
    ap.add_argument("--adapters", type=int, default=16, help="adapters in the step (1: one adapter's GEMM pair)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--cold",
        action="store_true",
        help="each of the 30 layers its own weights (as in the engine: 156 MB of adapters a step "
        "at 16 x rank 16 in bf16, streamed from memory), not one layer's 30 times (cache-warm)",
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="cpu: this process's CPU time (time.process_time), steadier on a shared machine with OMP_NUM_THREADS=1",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    build.load(build=False)
    calls = parts(args)
    reps, clock = 1 if args.cold else LAYERS, time.process_time if args.clock == "cpu" else time.perf_counter
    for part in calls.values():  # warm up: first calls pack, allocate
        _time(part, 1)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):  # alternated, so a shared machine's load falls on every part alike
        for name, part in calls.items():
            times[name].append(_time(part, reps, clock))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{args.rows} rows, {args.adapters} adapters of rank {args.rank}, {args.dtype}, {LAYERS} layers "
          f"{'(each its own weights) ' if args.cold else ''}(capability {dispatch.capability()}): "
          f"us per step ({args.clock} clock), median of {args.repeats}")  # fmt: skip
    for name, us in med.items():
        print(f"  {name:32s} {us:10.0f}  ({us / med['base GEMMs']:.2f}x the base GEMMs)")
    return {"rows": args.rows, "adapters": args.adapters, "rank": args.rank, "dtype": args.dtype, "us_per_step": med}
