"""The benchmarks' workloads: the load generator's (benchmarks/serve/bench.py) request specs, seeded
synthetic or JSONL prompts, Poisson arrival offsets and argparse types, and the offline workload
(benchmarks/engine/offline.py, benchmarks/peers/vllm_offline.py). Standard library only: vLLM's own
environment imports it too."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import dataclass


def offline_workload(
    num_prompts: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: random ids >= 100 (past special and control
    tokens), lengths uniform in the given ranges."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
        for _ in range(num_prompts)
    ]


def add_offline_args(ap: argparse.ArgumentParser) -> None:
    """The offline workload's shape and engine limits, the same defaults for every system."""
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-out", type=int, default=8)
    ap.add_argument("--max-out", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)


def offline_workload_of(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """`offline_workload` with the shape `add_offline_args` parsed: every system builds it this way."""
    return offline_workload(
        args.num_prompts, args.seed, (args.min_prompt, args.max_prompt), (args.min_out, args.max_out), vocab
    )


def workload_sha256(work) -> str:
    """Fingerprint of a workload, so two systems' results can be checked to come from the same one."""
    return hashlib.sha256(json.dumps(work).encode()).hexdigest()


# ---- workload --------------------------------------------------------------------------------
@dataclass
class Spec:
    """One request of the workload (arrival offset filled in per rate)."""

    index: int
    prompt: object  # str or list of token ids
    input_len: int
    max_tokens: int


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    lo, hi = int(a), int(b or a)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"want A:B with 1 <= A <= B, got {text!r}")
    return lo, hi


def make_workload(
    n: int,
    seed: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    token_range: tuple[int, int],
    dataset: str | None = None,
) -> list[Spec]:
    """`n` requests: synthetic token-id prompts, or lines of a JSONL dataset (cycled)."""
    rng = random.Random(seed)
    specs = []
    if dataset:
        rows = []
        with open(dataset) as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
        if not rows:
            raise ValueError(f"{dataset} holds no prompts")
        for i in range(n):
            row = rows[i % len(rows)]
            prompt = row["prompt"]
            out = int(row.get("max_tokens") or rng.randint(*output_len))
            specs.append(Spec(i, prompt, len(prompt) if isinstance(prompt, list) else -1, out))
        return specs
    for i in range(n):
        k = rng.randint(*input_len)
        ids = [rng.randrange(*token_range) for _ in range(k)]
        specs.append(Spec(i, ids, k, rng.randint(*output_len)))
    return specs


def _counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want N or N1,N2,... (each >= 1), got {text!r}")
    return counts


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process: the same unit-rate draws scaled by 1/rate."""
    rng = random.Random(seed + 7919)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out
