"""Time the fused Triton kernels of the lean decoder against the PyTorch ops they replace, on a CUDA GPU.

    orcaserve-bench gpu fused [--dtype bf16] [--shapes smollm2,llama8b] [--tokens 1,64,256,4096]
                                   [--out docs/results/gpu-fused.json] [--time-budget S]
    orcaserve-bench gpu fused --smoke     # CPU, TRITON_INTERPRET=1, fp32, tiny: every code path

Per model shape (SmolLM2-135M: hidden 576, I 1536, 9/3/64 heads; Llama-3.1-8B: 4096, 14336,
32/8/128) and step size T, each kernel of kernels/triton/fused.py against what the decoder runs on
a GPU without it (`Decoder(..., triton_fused=False)`):
  add_rms_norm   x + delta, then transformers' RMSNorm op for op (kernels/pytorch/fused.py)
  silu_mul       F.silu(gate) * up
  rope_store_kv  the roll-form rotary in PyTorch ops, then the Triton store_kv (the GPU backend's)
First each result is checked against the PyTorch twin on the same GPU (the sum and the rotary
bit for bit, the norm and SiLU within 2 ulp of the dtype); then three times per call:
  eager_us   wall time per call over a loop of calls, synchronised once: what the eager engine
             pays, launch overhead included (at small T the host, not the GPU, sets it)
  graph_us   one CUDA graph of 20 calls replayed: GPU time alone, as CUDA graphs would run it
  gbps       bytes the kernel must move / graph_us
and per shape and T, the sum over one decoder layer (2 norms, 1 SiLU, 1 rotary + store).
Exit status 1 if any result is wrong. The JSON (--json) is rewritten after every shape; without
CUDA and without --smoke it says so and exits 0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from orcaserve.bench.gpu.common import Results, add_step_arguments, device, device_name, torch_dtype

# name: (hidden, intermediate, H, H_kv, D)
SHAPES = {"smollm2": (576, 1536, 9, 3, 64), "llama8b": (4096, 14336, 32, 8, 128)}
RTOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}  # as tests/kernels/test_triton_fused.py
GRAPH_CALLS = 20
BLOCK_SIZE = 16


def time_eager(fn: Callable[[], object], cuda: bool, calls: int) -> float:
    """Microseconds per call of `calls` calls in a row, one synchronisation at the end."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def time_graph(fn: Callable[[], object], replays: int = 10) -> float:
    """Microseconds per call of a CUDA graph of GRAPH_CALLS calls (median replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return sorted(times)[len(times) // 2]


def compare(got: torch.Tensor, want: torch.Tensor, exact: bool, dtype: torch.dtype) -> dict:
    """max relative error beyond RTOL (<= 0: within), share of bit-equal values, verdict."""
    got, want = got.float(), want.float()
    same = (got == want) | (got.isnan() & want.isnan())
    excess = ((got - want).abs() - RTOL[dtype] * want.abs()).max().item() if got.numel() else 0.0
    ok = bool(same.all()) if exact else not got.isnan().any().item() and excess <= 1e-6
    return {"exact_fraction": round(same.float().mean().item(), 6), "excess_err": excess, "ok": ok}


def bench_shape(name: str, t: int, dtype: torch.dtype, dev: torch.device, calls: int) -> list[dict]:
    from orcaserve.kernels.pytorch import fused as ref
    from orcaserve.kernels.triton import fused
    from orcaserve.kernels.triton.store_kv import store_kv

    hidden, inter, h, hk, d = SHAPES[name]
    cuda = dev.type == "cuda"
    esize = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator(device=dev).manual_seed(t)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    x, delta, weight = randn(t, hidden), randn(t, hidden), randn(hidden)
    gate_up = randn(t, 2 * inter) * 4
    qkv, cos, sin = randn(t, (h + 2 * hk) * d), randn(t, d), randn(t, d)
    num_blocks = t // BLOCK_SIZE + 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g, device=dev)[:t]
    if t > 1:
        slots[-1] = -1  # a padding row, as CUDA-graph buckets bring
    caches = [torch.zeros(num_blocks, BLOCK_SIZE, hk, d, dtype=dtype, device=dev) for _ in range(4)]

    def rope_unfused() -> torch.Tensor:  # the decoder's GPU path without the fused kernel
        qk = qkv[:, : (h + hk) * d].view(-1, h + hk, d)
        qk = qk * cos[:, None, :] + qk.roll(d // 2, dims=-1) * sin[:, None, :]
        q, k = qk.split([h, hk], dim=1)
        store_kv(k, qkv[:, (h + hk) * d :].view(-1, hk, d), caches[2], caches[3], slots)
        return q

    ops: list[tuple[str, Callable[[], object], Callable[[], object], int]] = [
        (
            "add_rms_norm",
            lambda: fused.add_rms_norm(x, delta, weight, 1e-5),
            lambda: ref.add_rms_norm(x, delta, weight, 1e-5),
            (4 * t + 1) * hidden,
        ),
        ("silu_mul", lambda: fused.silu_mul(gate_up), lambda: ref.silu_mul(gate_up), 3 * t * inter),
        (
            "rope_store_kv",
            lambda: fused.rope_store_kv(qkv, cos, sin, caches[0], caches[1], slots, h, hk),
            rope_unfused,
            t * ((h + 2 * hk) * d + 2 * d + (h + 2 * hk) * d),
        ),
    ]

    rows = []
    for op, tri, base, elements in ops:
        row: dict = {"op": op, "shape": name, "tokens": t, "bytes": elements * esize}
        # Correctness against the twin on the same device, before any timing.
        if op == "add_rms_norm":
            (s, y), (s_ref, y_ref) = (
                fused.add_rms_norm(x, delta, weight, 1e-5),
                ref.add_rms_norm(x, delta, weight, 1e-5),
            )
            checks = {"sum": compare(s, s_ref, True, dtype), "norm": compare(y, y_ref, False, dtype)}
        elif op == "silu_mul":
            checks = {"out": compare(fused.silu_mul(gate_up), ref.silu_mul(gate_up), False, dtype)}
        else:
            k_ref, v_ref = torch.full_like(caches[0], float("nan")), torch.full_like(caches[1], float("nan"))
            caches[0].fill_(float("nan"))
            caches[1].fill_(float("nan"))
            q = fused.rope_store_kv(qkv, cos, sin, caches[0], caches[1], slots, h, hk)
            q_ref = ref.rope_store_kv(qkv, cos, sin, k_ref, v_ref, slots, h, hk)
            checks = {
                "q": compare(q, q_ref, True, dtype),
                "k_cache": compare(caches[0], k_ref, True, dtype),
                "v_cache": compare(caches[1], v_ref, True, dtype),
            }
        row["checks"] = checks
        row["ok"] = all(c["ok"] for c in checks.values())
        for label, fn in (("triton", tri), ("torch", base)):
            r: dict = {"eager_us": round(time_eager(fn, cuda, calls), 2)}
            if cuda:
                try:
                    r["graph_us"] = round(time_graph(fn), 2)
                    r["gbps"] = round(row["bytes"] / r["graph_us"] / 1e3, 1)
                except Exception as e:  # noqa: BLE001 - a capture failure is a finding, not a crash
                    r["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row[label] = r
        for key in ("eager_us", "graph_us"):
            a, b = row["triton"].get(key), row["torch"].get(key)
            if a and b:
                row[f"speedup_{key[:-3]}"] = round(b / a, 2)
        rows.append(row)
        tr, to = row["triton"], row["torch"]
        print(
            f"{name:<8} T={t:<5} {op:<14} {'ok ' if row['ok'] else 'BAD'} triton eager {tr['eager_us']:>8.1f} us "
            f"graph {tr.get('graph_us', float('nan')):>8.1f} us ({tr.get('gbps', float('nan')):>6.0f} GB/s) | "
            f"torch eager {to['eager_us']:>8.1f} us graph {to.get('graph_us', float('nan')):>8.1f} us",
            flush=True,
        )
    return rows


def per_layer(rows: list[dict]) -> dict:
    """One decoder layer's element-wise work per shape and T: 2 norms, 1 SiLU, 1 rotary + store
    (None where a time is missing)."""
    count = {"add_rms_norm": 2, "silu_mul": 1, "rope_store_kv": 1}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['shape']}/T={r['tokens']}", []).append(r)
    out: dict = {}
    for key, group in groups.items():
        out[key] = {}
        for label in ("triton", "torch"):
            for metric in ("eager_us", "graph_us"):
                times = [r[label].get(metric) for r in group]
                total = sum(count[r["op"]] * v for r, v in zip(group, times)) if None not in times else None
                out[key][f"{label}_{metric}"] = None if total is None else round(total, 2)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_step_arguments(ap, ",".join(SHAPES), "1,64,256,4096")
    ap.add_argument("--calls", type=int, default=200, help="calls per eager timing")


def run(args: argparse.Namespace) -> dict:
    dev = device("fused", args.smoke)
    if isinstance(dev, dict):
        return dev
    cuda, dtype = dev.type == "cuda", torch_dtype(args.dtype, dev)
    if not cuda:
        args.dtype, args.shapes, args.tokens, args.calls = "fp32", "smollm2", "1,3", 2
    names = ("hidden", "intermediate", "heads", "kv_heads", "head_dim")
    shapes = {s: dict(zip(names, SHAPES[s])) for s in args.shapes.split(",")}
    res = Results(args.out, device=device_name(dev), dtype=args.dtype, smoke=args.smoke, shapes=shapes, rows=[])
    result = res.data

    def save() -> None:
        result["all_ok"] = all(r["ok"] for r in result["rows"])
        result["per_layer"] = per_layer(result["rows"])
        result["elapsed_s"] = round(time.perf_counter() - res.t0, 1)
        res.save()

    result["truncated"] = False
    for shape in args.shapes.split(","):
        for t in (int(n) for n in args.tokens.split(",")):
            if res.over(args.time_budget):
                result["truncated"] = True
                print(f"time budget of {args.time_budget} s reached; stopping")
                break
            result["rows"].extend(bench_shape(shape, t, dtype, dev, args.calls))
            save()
            if cuda:
                torch.cuda.empty_cache()
    save()
    for key, v in result["per_layer"].items():
        print(f"per layer {key}: {v}")
    print(f"all_ok {result['all_ok']}, {result['elapsed_s']} s")
    return {**result, "exit_code": 0 if result["all_ok"] else 1}
