"""Yardsticks for benchmarks/kernel_bench.py: datasheet peaks, a CUDA-event timer, a shuffled K/V pool."""

from __future__ import annotations

import functools
import statistics
import time

import torch

PEAK_GBPS = {  # HBM peak, GB/s, matched as substrings of torch.cuda.get_device_name()
    "GH200": 4000.0,
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
}
PEAK_BF16_TFLOPS = {
    "GH200": 990.0,
    "H200": 990.0,
    "H100 PCIe": 756.0,
    "H100": 990.0,
    "H800": 990.0,
    "A100": 312.0,
}  # dense, datasheet
SPLIT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # split-K counts timed per decode shape


def lookup(table: dict, name: str) -> float | None:
    for key, val in table.items():  # insertion order puts specific names first
        if key in name:
            return val
    return None


def peak_gbps(name: str) -> float | None:
    return lookup(PEAK_GBPS, name)


class Timer:
    """Median milliseconds of `fn`: CUDA events with an L2 flush before each call, or (smoke mode,
    CPU) wall time of one call."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def __call__(self, fn, max_iters: int = 20, target_ms: float = 40.0) -> float:
        if not self.cuda:
            fn()  # warm-up (the interpreter has no compile step, but keep the shape of a run)
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        fn()  # compile + warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = (time.perf_counter() - t) * 1e3
        iters = max(3, min(max_iters, int(target_ms / max(first, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            assert self.flush is not None
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_gbps(device: torch.device, timer: Timer) -> float | None:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling)."""
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.int8, device=device)
    b = torch.empty_like(a)
    ms = timer(functools.partial(b.copy_, a))
    return 2 * (1 << 30) / ms / 1e6


class CachePool:
    """One K/V cache big enough for the largest step; each step gets shuffled blocks of it."""

    def __init__(self, num_blocks, bs, h_kv, d, dtype, device):
        self.bs, self.device = bs, device
        self.k = torch.randn(num_blocks, bs, h_kv, d, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)

    def step(self, q_lens, ctx, h, d, dtype):
        bs, dev = self.bs, self.device
        per_req = [max(1, -(-c // bs)) for c in ctx]
        total = sum(per_req)
        if total > self.k.shape[0]:
            raise ValueError(f"step needs {total} blocks, the pool has {self.k.shape[0]}")
        perm = torch.randperm(self.k.shape[0], device=dev)[:total].to(torch.int32)
        tables = torch.zeros(len(ctx), max(per_req), dtype=torch.int32, device=dev)
        used = 0
        for i, n in enumerate(per_req):
            tables[i, :n] = perm[used : used + n]
            used += n
        cu = torch.zeros(len(ctx) + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, device=dev), 0)
        seq_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
        q = torch.randn(int(sum(q_lens)), h, d, device=dev, dtype=dtype)
        return q, cu, seq_lens, tables


def visible_pairs(q_lens, ctx) -> int:
    """(query, key) pairs a causal step computes: new token j of a request sees ctx - n + j + 1 keys."""
    return sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, ctx, strict=True))
