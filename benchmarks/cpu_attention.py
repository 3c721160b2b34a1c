"""Per-layer attention time on the CPU: `TorchAttentionPlan.attend` vs the C++ paged operator.

    python benchmarks/cpu_attention.py [--threads 2] [--repeats 5] [--iters 20] [--quick]
    python benchmarks/cpu_attention.py --memory [--context 256]     # C++ only, caches in DRAM
    python benchmarks/cpu_attention.py --quick --library OLD.so     # another build of the operator

SmolLM2-135M heads (H=9, H_kv=3, D=64), block size 16, fp32 and bf16. Shapes: decode batches of
1/8/32/64 at contexts 128/512/1024, a mixed step (one 512-token prefill chunk with no history
plus 31 decodes at contexts 128-1024) and steps of 512 prompt tokens (16 x 32, 4 x 128, 2 x 256).
The variant is kernels/dispatch.py's; `ORCASERVE_CPU_ISA=avx512_bf16` on an AMX CPU measures the
vdpbf16ps tiles instead of AMX's (any lower variant the CPU executes, likewise).
Per shape: median and minimum over `--repeats` x `--iters` calls (the plan is built once per step
and is not timed, as in the engine).
The cache is sized for the shape only, so it may sit in L3 cache: a real engine's per-layer
cache for 30 layers does not, which favours neither path more than the other. `--memory` measures
that case for the C++ operator: 32 decodes called over 30 layers, each with its own 4,096-block
cache, as an engine step does; ms per layer call (minimum and median of 8 steps) and the K/V bytes
read per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.cpu import build
from orcaserve.kernels.cpu.attention import CpuBackend
from orcaserve.kernels.pytorch.attention import TorchAttentionPlan

H, H_KV, D, BS = 9, 3, 64, 16


def make_step(q_lens: list[int], ctx: list[int], dtype: torch.dtype, seed: int = 0):
    """Random cache with shuffled block tables for one step (every request owns its blocks)."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-c // BS) for c in ctx]
    num_blocks = sum(per_req) + 1
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(ctx), max(per_req), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_req):
        tables[i, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, BS, H_KV, D, generator=g).to(dtype)  # [num_blocks, bs, H_kv, D]
    v_cache = torch.randn(num_blocks, BS, H_KV, D, generator=g).to(dtype)
    cu = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), H, D, generator=g).to(dtype)  # [T, H, D]
    return q, k_cache, v_cache, cu, torch.tensor(ctx, dtype=torch.int32), tables


def time_ms(fn, iters: int, repeats: int) -> tuple[float, float]:
    """(median, minimum) milliseconds per call over `repeats` rounds of `iters` calls.

    On a shared machine the median carries other jobs' preemptions (OpenMP regions wait for
    their slowest thread); the minimum is the closest to the uncontended cost.
    """
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def shapes(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    out = []
    for batch in (1, 8, 32, 64):
        for ctx in (128, 512, 1024):
            if quick and (batch, ctx) not in ((1, 128), (32, 512)):
                continue
            out.append((f"decode B={batch} ctx={ctx}", [1] * batch, [ctx] * batch))
    decode_ctx = [128 + (1024 - 128) * i // 30 for i in range(31)]
    out.append(("mixed: prefill 512 + 31 decodes", [512] + [1] * 31, [512] + decode_ctx))
    for n, length in ((16, 32), (4, 128), (2, 256)):  # a step of 512 prompt tokens, no history
        out.append((f"prefill {n} x {length}", [length] * n, [length] * n))
    return out


def _step_ms(op, caches: list, args: tuple) -> float:
    """One engine step's attention calls, layer after layer; milliseconds."""
    q, cu, seq_lens, tables, out = args
    start = time.perf_counter()
    for kc, vc in caches:
        op(q, kc, vc, cu, seq_lens, tables, D**-0.5, out)
    return (time.perf_counter() - start) * 1e3


def memory_resident(op, context: int, layers: int = 30, blocks: int = 4096, batch: int = 32) -> None:
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        g = torch.Generator().manual_seed(0)
        caches = [
            tuple(torch.randn(blocks, BS, H_KV, D, generator=g).to(dtype) for _ in range(2)) for _ in range(layers)
        ]
        per_req = -(-context // BS)
        tables = torch.randperm(blocks, generator=g)[: batch * per_req].to(torch.int32).view(batch, per_req)
        cu = torch.arange(batch + 1, dtype=torch.int32)
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, H, D, generator=g).to(dtype)
        out = torch.empty_like(q)

        per_layer = [_step_ms(op, caches, (q, cu, seq_lens, tables, out)) / layers for _ in range(9)][1:]
        best = min(per_layer)
        kv_bytes = 2 * batch * context * H_KV * D * q.element_size()
        print(
            f"decode B={batch} ctx={context} {tag}, {layers} layers' caches: {best:.3f} ms per layer "
            f"(median {statistics.median(per_layer):.3f}), {kv_bytes / best / 1e6:.1f} GB/s of K/V"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="two decode shapes and the mixed step")
    parser.add_argument("--memory", action="store_true", help="C++ only, 30 layers' caches in memory")
    parser.add_argument("--context", type=int, default=256, help="--memory: tokens per request")
    parser.add_argument("--library", default=None, help="compiled orcaserve CPU ops (.so) to load instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.library:  # another build (an older kernel's .so from the build cache), to compare
        build.library_path = lambda variants=None: Path(args.library)  # type: ignore[assignment]
    ok, reason = build.load(build=True)
    op = dispatch.kernel("paged_attention", torch.float32)
    print(f"threads={torch.get_num_threads()} op: {reason}; fp32 {dispatch.resolve('paged_attention', torch.float32)}")
    print(f"bf16: {dispatch.resolve('paged_attention', torch.bfloat16)}")
    if not ok or op is None:
        return
    if args.memory:
        memory_resident(op, args.context)
        return
    backend = CpuBackend()
    scale = D**-0.5
    print(f"{'':41s}{'median ms':>28s}   {'minimum ms':>27s}")
    print(
        f"{'shape':34s} {'dtype':5s} {'torch':>9s} {'C++':>8s} {'ratio':>7s}   {'torch':>9s} {'C++':>8s} {'ratio':>7s}"
        "  max|diff|"
    )
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for name, q_lens, ctx in shapes(args.quick):
            q, kc, vc, cu, sl, bt = make_step(q_lens, ctx, dtype)
            ref_plan = TorchAttentionPlan(cu, sl, bt, BS)
            plan = backend.plan(cu, sl, bt, BS, max(q_lens), max(ctx))
            out_ref, out_cpp = torch.empty_like(q), torch.empty_like(q)
            ref_med, ref_min = time_ms(partial(ref_plan.attend, q, kc, vc, scale, out_ref), args.iters, args.repeats)
            cpp_med, cpp_min = time_ms(
                partial(backend.attend, plan, q, kc, vc, scale, out_cpp), args.iters, args.repeats
            )
            diff = (out_ref.float() - out_cpp.float()).abs().max().item()
            print(
                f"{name:34s} {tag:5s} {ref_med:9.3f} {cpp_med:8.3f} {ref_med / cpp_med:6.1f}x   "
                f"{ref_min:9.3f} {cpp_min:8.3f} {ref_min / cpp_min:6.1f}x  {diff:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
