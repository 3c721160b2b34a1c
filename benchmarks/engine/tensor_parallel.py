"""Tensor parallelism on the CPU: a model split over N ranks x T threads against one process with
N x T threads, same workload (docs/tensor-parallel.md).

    orcaserve-bench tp                                            # SmolLM2 (default GGUF), 2 ranks x 1 thread vs 1 x 2
    orcaserve-bench tp --num-prompts 8 --max-tokens 32 --out out.json

Each configuration runs in a fresh process (its peak RSS is its own): load (peak RSS per rank read
from /proc after the load: VmHWM), then the workload (N prompts of random token ids, greedy,
`max_tokens` each, EOS ignored), timed whole. For the split model also the seconds rank 0 spent in
collectives (the per-layer all-reduces, the step's broadcast, the logits' gather; waiting for the
slower rank included) and their share of the generation's wall time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import time
from typing import Any

import torch

from orcaserve.scheduler import Engine, SamplingParams, default_model_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all: per rank threads / ranks")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--kv-cache-memory", type=int, default=64 << 20, help="bytes per rank (small: the RSS is then mostly weights)"
    )


def _hwm_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure(ranks: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(args.threads)  # split between the ranks by from_pretrained when ranks > 1
    started = time.perf_counter()
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, tensor_parallel_size=ranks, kv_cache_memory=args.kv_cache_memory
    )
    load_s = time.perf_counter() - started
    workers = [p.pid for p in getattr(engine.runner, "processes", [])]
    rss = [_hwm_mib()] + [_hwm_mib(pid) for pid in workers]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    group = getattr(engine.runner, "group", None)
    before = group.seconds if group is not None else 0.0
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.output_token_ids) for o in outs)
    result = {
        "ranks": ranks,
        "threads_per_rank": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "peak_rss_mib_per_rank": [round(r, 1) for r in rss],
        "generate_s": round(wall, 3),
        "output_tokens": tokens,
        "tok_per_s": round(tokens / wall, 2),
    }
    if group is not None:
        result["collective_s"] = round(group.seconds - before, 3)
        result["collective_share"] = round((group.seconds - before) / wall, 3)
        engine.runner.close()
    out.put(result)


def run(args: argparse.Namespace) -> dict:
    args.model = args.model or default_model_path()
    ctx = multiprocessing.get_context("spawn")
    runs = []
    for ranks in (1, args.ranks):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(ranks, args, queue))  # not a daemon: it starts ranks
        proc.start()
        runs.append(queue.get())
        proc.join()
    one, split = runs
    result = {
        "model": os.path.basename(args.model),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "workload": {
            k: getattr(args, k)
            for k in ("num_prompts", "prompt_len", "max_tokens", "dtype", "threads", "kv_cache_memory")
        },
        "one_process": one,
        "tensor_parallel": split,
        "speedup": round(split["tok_per_s"] / one["tok_per_s"], 3),
    }
    print(json.dumps(result, indent=2))
    return result
