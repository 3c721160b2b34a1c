"""Time the Triton attention kernels against the PyTorch reference on a CUDA GPU.

    python benchmarks/kernels.py [--dtype bf16] [--heads 32 --kv-heads 8 --head-dim 128]
                                 [--block-size 16] [--peak-gbps 4800] [--quick]

Reports per shape: milliseconds (Triton, and the reference path the CPU engine uses), the bytes
the step must move at minimum (each request's K and V once per KV head, plus q/out; for store_kv
K/V in and out), and the achieved bandwidth as a fraction of the device's peak HBM bandwidth
(from PEAK_GBPS by device name, or --peak-gbps). Target on Hopper: decode >= 70% of peak at
contexts >= 4k. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

PEAK_GBPS = {  # HBM peak, GB/s, matched as substrings of torch.cuda.get_device_name()
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "GH200": 4000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
}

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def peak_gbps(name: str) -> float | None:
    for key, val in PEAK_GBPS.items():  # insertion order puts specific names first
        if key in name:
            return val
    return None


def bench(fn, iters: int = 20) -> float:
    """Median milliseconds over `iters` CUDA-event-timed calls after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def make_step(q_lens, ctx, h, h_kv, d, bs, dtype, dev):
    """A step with shuffled block tables over a cache just big enough for it."""
    per_req = [-(-c // bs) for c in ctx]
    num_blocks = sum(per_req)
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    tables = torch.zeros(len(ctx), max(per_req), dtype=torch.int32, device=dev)
    used = 0
    for i, n in enumerate(per_req):
        tables[i, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, bs, h_kv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    cu = torch.zeros(len(ctx) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, device=dev), 0)
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    q = torch.randn(int(sum(q_lens)), h, d, device=dev, dtype=dtype)
    return q, k_cache, v_cache, cu, seq_lens, tables


def shapes(quick: bool):
    batches = (1, 8, 64, 256) if quick else (1, 4, 16, 32, 64, 128, 256)
    contexts = (512, 4096, 32768) if quick else (512, 1024, 2048, 4096, 8192, 16384, 32768)
    for b in batches:
        for c in contexts:
            if b * c <= 2**21:  # keep the cache under ~8 GiB at 32 KV heads
                yield f"decode B={b} ctx={c}", [1] * b, [c] * b
    # ORCA's merged steps: one prefill chunk joining running decodes.
    for b, c, chunk in ((32, 2048, 512), (64, 4096, 512), (128, 1024, 2048)):
        yield f"mixed {b}x1@{c} + {chunk}", [1] * b + [chunk], [c] * b + [chunk]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the PyTorch timings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device; nothing to time (GPU figures not measured).")
        return 0

    from orcaserve.kernels import reference
    from orcaserve.kernels.triton_attention import choose_num_splits, num_sms, unified_attention
    from orcaserve.kernels.triton_store_kv import store_kv

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = args.peak_gbps or peak_gbps(name)
    dtype, h, h_kv, d, bs = DTYPES[args.dtype], args.heads, args.kv_heads, args.head_dim, args.block_size
    esz = torch.tensor([], dtype=dtype).element_size()
    print(f"device {name}, peak {peak or 'unknown'} GB/s, {args.dtype}, H={h} H_kv={h_kv} D={d} "
          f"block_size={bs}")
    print(f"{'shape':<28} {'splits':>6} {'triton ms':>10} {'torch ms':>9} {'GB/s':>8} {'% peak':>7}")
    for label, q_lens, ctx in shapes(args.quick):
        q, kc, vc, cu, sl, bt = make_step(q_lens, ctx, h, h_kv, d, bs, dtype, dev)
        scale = d**-0.5
        mq, mk = max(q_lens), max(ctx)
        splits = choose_num_splits(q.shape[0], len(ctx), h_kv, h // h_kv, mq, mk, num_sms(dev), dtype)
        out = torch.empty_like(q)
        ms = bench(lambda: unified_attention(q, kc, vc, cu, sl, bt, scale, out, max_seqlen_q=mq,
                                             max_seqlen_k=mk, num_splits=splits))
        ref_ms = float("nan")
        if not args.no_reference:
            plan = reference.TorchAttentionPlan(cu, sl, bt, bs)
            try:
                ref_ms = bench(lambda: plan.attend(q, kc, vc, scale, out), iters=5)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
        moved = 2 * sum(ctx) * h_kv * d * esz + 2 * q.numel() * esz
        gbps = moved / ms / 1e6
        pct = f"{100 * gbps / peak:6.1f}%" if peak else "    n/a"
        print(f"{label:<28} {splits:>6} {ms:>10.3f} {ref_ms:>9.3f} {gbps:>8.0f} {pct}")
        del q, kc, vc
        torch.cuda.empty_cache()

    for t in (1, 64, 256, 4096):  # store_kv: a decode batch up to a long prefill chunk
        kc = torch.zeros(t // bs + 2, bs, h_kv, d, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        qkv = torch.randn(t, (h + 2 * h_kv) * d, device=dev, dtype=dtype)
        key = qkv[:, h * d : (h + h_kv) * d].view(t, h_kv, d)
        value = qkv[:, (h + h_kv) * d :].view(t, h_kv, d)
        slots = torch.randperm(kc.shape[0] * bs, device=dev)[:t]
        ms = bench(lambda: store_kv(key, value, kc, vc, slots))
        ref_ms = bench(lambda: reference.store_kv(key, value, kc, vc, slots), iters=5)
        gbps = 4 * t * h_kv * d * esz / ms / 1e6
        pct = f"{100 * gbps / peak:6.1f}%" if peak else "    n/a"
        print(f"{'store_kv T=' + str(t):<28} {'-':>6} {ms:>10.3f} {ref_ms:>9.3f} {gbps:>8.0f} {pct}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
