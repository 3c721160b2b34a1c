"""What log-probabilities cost a step: time in `token_logprobs` inside real engine runs.

    python benchmarks/logprobs.py                     # 64 requests, every one asks for 5, 2 rounds
    python benchmarks/logprobs.py --logprobs 20 --json out.json

One engine serving the default model runs the same batch of random-id prompts (lengths U[16, 256],
outputs U[8, 128], EOS ignored, prefix caching off so every run computes the same) with and
without `logprobs`, alternating. Printed per run: output tokens/s, and the time spent in
`token_logprobs` (wrapped with a timer) as a share of the run. The share is the figure to read:
on a shared VM the runs' tokens/s drift by more than it. First, the top-k alone: ATen's `topk`
against `top_k` (scheduler/model/logprobs.py) on a [32, vocabulary] fp32 batch of log-probabilities.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from serve_report import machine

import orcaserve.scheduler.engine as engine_module
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.model.logprobs import top_k


def _ms(fn, repeats: int = 50) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - t) / repeats


def time_top_k(vocab: int) -> list[dict]:
    x = torch.log_softmax(torch.randn(32, vocab, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    rows = []
    for k in (1, 5, 20):
        aten, ours = _ms(lambda k=k: x.topk(k, dim=-1)), _ms(lambda k=k: top_k(x, k))
        rows.append({"k": k, "aten_ms": aten, "top_k_ms": ours})
        print(f"top {k:>2} of [32, {vocab}]: ATen topk {aten:.2f} ms, top_k {ours:.2f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=5, help="alternatives per token in the runs that ask")
    ap.add_argument("--rounds", type=int, default=2, help="each round: one run with, one without")
    ap.add_argument("--dtype", default=None, help="the engine's default when not given")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    spent = {"s": 0.0, "calls": 0}
    inner = engine_module.token_logprobs

    def timed(*a):
        t = time.perf_counter()
        try:
            return inner(*a)
        finally:
            spent["s"] += time.perf_counter() - t
            spent["calls"] += 1

    engine_module.token_logprobs = timed  # the engine calls it through its module's name
    engine = Engine.from_pretrained(
        default_model_path(),
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=1024,
        enable_prefix_caching=False,
        dtype=args.dtype,
    )
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    micro = time_top_k(vocab)
    work = [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))], rng.randint(8, 128))
        for _ in range(args.num_prompts)
    ]
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    runs = []
    for r in range(args.rounds):
        for k in (args.logprobs, None) if r % 2 == 0 else (None, args.logprobs):
            spent.update(s=0.0, calls=0)
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=k) for _, n in work]
            t = time.perf_counter()
            engine.generate([p for p, _ in work], params)
            wall = time.perf_counter() - t
            run = {
                "logprobs": k,
                "tok_s": sum(n for _, n in work) / wall,
                "wall_s": wall,
                "token_logprobs_s": spent["s"],
                "steps": spent["calls"],
                "share": spent["s"] / wall,
            }
            runs.append(run)
            print(
                f"logprobs={k}: {run['tok_s']:.1f} tok/s, wall {wall:.1f} s, token_logprobs "
                f"{1e3 * spent['s']:.0f} ms over {spent['calls']} steps ({100 * run['share']:.1f} % of the run)",
                flush=True,
            )
    if args.json:
        result = {"args": vars(args), "dtype": str(engine.dtype), "machine": machine(), "top_k": micro, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
