"""Time the Triton LoRA kernels (kernels/triton/lora.py) on a CUDA GPU: 16 adapters of rank 16 in
one step, against the PyTorch twin and the base projections they add to.

    orcaserve-bench gpu lora [--dtype bf16] [--shapes smollm2,llama8b] [--tokens 32,256]
                             [--adapters 16] [--rank 16] [--out lora.json] [--time-budget S]
    orcaserve-bench gpu lora --smoke     # CPU, TRITON_INTERPRET=1, fp32, tiny: every code path

Per model shape and step size T (a quarter of the rows of the base model, the others spread over
the adapters in turn), for each fused projection of the lean decoder (q/k/v, o, gate/up, down),
with every adapter stacked as the engine stacks them (`lora_batched`'s A [S R, in], B over B^T's
storage):
  check      the Triton update against the twin on the same GPU (max error over the update's
             size; rows of no adapter bit for bit untouched)
  triton_ms  the Triton shrink + expand (median, L2 flushed), gbps the bytes they must move
             (every stacked adapter's A and B, x's rows, y's rows read and written) over that time
  twin_ms    kernels/pytorch/lora.py's lora_batched_parts (two dense GEMMs over all S R columns)
  base_ms    the base projection's GEMM at the same T (what the update is added to)
and per shape and T the step's sums over every layer: the update against the base GEMMs.
Exit status 1 if a check fails. Without CUDA and without --smoke it says so and exits 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from orcaserve.bench.gpu.common import Results, Timer, add_step_arguments, device, finish_rows, save_rows, torch_dtype

# name: (hidden, intermediate, q width, k/v width, layers)
SHAPES = {"smollm2": (576, 1536, 576, 192, 30), "llama8b": (4096, 14336, 4096, 1024, 32)}
SMOKE = (64, 96, 64, 32, 2)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # of the update's size


def projections(shape: tuple[int, ...]) -> dict[str, tuple[int, list[int]]]:
    """Each fused projection's input width and its modules' output widths."""
    hidden, inter, q, kv, _ = shape
    return {
        "qkv": (hidden, [q, kv, kv]),
        "o": (q, [hidden]),
        "gate_up": (hidden, [inter, inter]),
        "down": (inter, [hidden]),
    }


def bench_projection(name, d_in, widths, t, slots, rank, dtype, dev, timer) -> dict:
    from orcaserve.kernels.pytorch import lora as twin
    from orcaserve.kernels.triton import lora as tri

    g = torch.Generator(device=dev).manual_seed(t)
    esize = torch.empty(0, dtype=dtype).element_size()

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * 0.1).to(dtype)

    slot_of = [-1 if i % 4 == 3 else i % slots for i in range(t)]
    batch = twin.LoraBatch.of(slot_of, slots, rank, [2.0] * slots, dtype, str(dev))
    parts, col = [], 0
    for w in widths:
        parts.append((col, col + w, randn(slots * rank, d_in), randn(slots, rank, w).view(-1, w).t()))
        col += w
    x, y0 = randn(t, d_in), randn(t, col)
    base_w = randn(col, d_in)
    want, got = y0.clone(), y0.clone()
    twin.lora_batched_parts(want, x, batch, parts)
    tri.lora_batched_parts(got, x, batch, parts)
    update = (want - y0).float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    base_rows = torch.tensor([i for i, s in enumerate(slot_of) if s < 0], dtype=torch.int64, device=dev)
    untouched = torch.equal(got[base_rows], y0[base_rows])
    rel = err / max(update, 1e-30)
    rows = t - len(base_rows)
    nbytes = esize * (slots * rank * (d_in + col) + rows * (d_in + 2 * col))
    y = y0.clone()
    row = {
        "projection": name,
        "tokens": t,
        "in": d_in,
        "out": col,
        "max_err": err,
        "rel_err": rel,
        "ok": untouched and rel <= TOLERANCE[dtype],
        "bytes": nbytes,
        "triton_ms": timer(lambda: tri.lora_batched_parts(y, x, batch, parts)),
        "twin_ms": timer(lambda: twin.lora_batched_parts(y, x, batch, parts)),
        "base_ms": timer(lambda: F.linear(x, base_w)),
    }
    row["gbps"] = round(nbytes / row["triton_ms"] / 1e6, 1)
    return row


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_step_arguments(ap, ",".join(SHAPES), "32,256")
    ap.add_argument("--adapters", type=int, default=16, help="adapters stacked and present in the step")
    ap.add_argument("--rank", type=int, default=16)


def run(args: argparse.Namespace) -> dict:
    dev = device("lora", args.smoke)
    if isinstance(dev, dict):
        return dev
    cuda, dtype = dev.type == "cuda", torch_dtype(args.dtype, dev)
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    if not cuda:
        args.dtype, args.tokens, args.adapters, args.rank, shapes = "fp32", "6", 3, 8, {"smoke": SMOKE}
    res = Results(args.out, dev, dtype=args.dtype, smoke=args.smoke, adapters=args.adapters, rank=args.rank, rows=[])
    result, timer = res.data, Timer(dev)
    result["truncated"], result["per_step"] = False, {}
    for shape, dims in shapes.items():
        for t in (int(n) for n in args.tokens.split(",")):
            if res.over(args.time_budget):
                result["truncated"] = True
                print(f"time budget of {args.time_budget} s reached; stopping")
                break
            rows = [
                dict(
                    shape=shape, **bench_projection(name, d_in, widths, t, args.adapters, args.rank, dtype, dev, timer)
                )
                for name, (d_in, widths) in projections(dims).items()
            ]
            result["rows"].extend(rows)
            layers = dims[-1]
            step = {k: round(layers * sum(r[k] for r in rows), 3) for k in ("triton_ms", "twin_ms", "base_ms")}
            step["update_over_base"] = round(step["triton_ms"] / step["base_ms"], 3)
            result["per_step"][f"{shape}/T={t}"] = step
            for r in rows:
                print(
                    f"{shape:<8} T={t:<4} {r['projection']:<8} {'ok ' if r['ok'] else 'BAD'} err {r['rel_err']:.1e} "
                    f"triton {r['triton_ms'] * 1e3:8.1f} us ({r['gbps']:7.1f} GB/s) twin {r['twin_ms'] * 1e3:8.1f} us "
                    f"base GEMM {r['base_ms'] * 1e3:8.1f} us",
                    flush=True,
                )
            print(f"{shape:<8} T={t:<4} per step ({layers} layers): {step}", flush=True)
            save_rows(res, "all_ok", "ok")
    return finish_rows(res, dev, "all_ok", "ok")
