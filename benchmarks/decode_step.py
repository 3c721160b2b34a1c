"""Time (and optionally profile) steady-state decode steps of the engine, or prefill steps.

    python benchmarks/decode_step.py --dtype bfloat16 --batch 32 --context 256 [--profile 20]
    python benchmarks/decode_step.py --dtype bfloat16 --prefill 128 [--profile 20]

B requests of C random prompt tokens are prefilled, then whole `Engine.step()`s (scheduler,
attention, model, sampler, detokenizer) are timed while every request decodes; the best of
`--repeats` means of `--steps` steps is printed. `--profile N` adds torch.profiler's top N ops by
self CPU time over 5 steps. `--toggle ATTR` switches a flag of the lean decoder (`rope_store`,
`fused`) off and on in alternating order, `--repeats` rounds each, and prints both medians: on
this VM, whose speed drifts by tens of percent over minutes, only such in-process A/B figures
compare two variants. Runs against whatever `orcaserve` is importable, so an older checkout
can be measured the same way; `--library` loads another build of the C++ operators (an older
kernel's .so from the build cache) in place of the current sources' (docs/engine.md, "Decode
step, before and after"). `--prefill L` times steps of 512 prompt tokens instead: each step gets
512 / L fresh prompts of L random tokens (one output token each, no prefix caching), as a burst of
new requests does.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--library", default=None, help="compiled orcaserve CPU ops (.so) to load instead")
    ap.add_argument("--toggle", default=None, metavar="ATTR", help="A/B a boolean flag of the lean decoder")
    ap.add_argument(
        "--prefill", type=int, default=0, metavar="L", help="time 512-token prefill steps of L-token prompts"
    )
    args = ap.parse_args()
    if args.library:
        from pathlib import Path

        from orcaserve.kernels.cpu import build

        build.library_path = lambda variants=None: Path(args.library)  # type: ignore[assignment]
    if args.threads:
        torch.set_num_threads(args.threads)

    engine_args = {
        "max_num_seqs": args.batch,
        "max_num_batched_tokens": max(512, args.context),
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
    }
    if "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)}:
        engine_args["enable_prefix_caching"] = False  # random prompts share nothing; older checkouts lack it
    engine = Engine.from_pretrained(args.model or default_model_path(), **engine_args)
    if args.prefill:
        prefill(engine, args)
        return
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.context)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    if args.toggle:
        toggle(engine, args)
        return
    means = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        means.append((time.perf_counter() - t) / args.steps)
    print(
        f"decode step: {min(means) * 1e3:.1f} ms (B={args.batch}, context ~{args.context}, {engine.dtype}, "
        f"attention {type(engine.runner.backend).__name__}, {torch.get_num_threads()} threads)"
    )
    if args.profile:
        print_profile(engine.step, args.profile)


def prefill(engine: Engine, args: argparse.Namespace) -> None:
    """Best of `--repeats` means of `--steps` steps of 512 prompt tokens (the first 3 untimed)."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    n = max(1, 512 // args.prefill)
    count = 0

    def step() -> float:
        nonlocal count
        for _ in range(n):
            engine.add_request(f"p{count}", [rng.randrange(100, 49000) for _ in range(args.prefill)], params)
            count += 1
        t = time.perf_counter()
        engine.step()  # every prompt whole, each request finished by its one token
        return time.perf_counter() - t

    for _ in range(3):
        step()
    best = min(sum(step() for _ in range(args.steps)) / args.steps for _ in range(args.repeats))
    print(
        f"prefill step: {best * 1e3:.1f} ms ({n} prompts of {args.prefill} tokens, {engine.dtype}, "
        f"{torch.get_num_threads()} threads)"
    )
    if args.profile:
        print_profile(step, args.profile)


def print_profile(step, rows: int) -> None:
    """torch.profiler's top `rows` ops by self CPU time over 5 calls of `step`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def toggle(engine: Engine, args: argparse.Namespace) -> None:
    """Median step time with the decoder flag `args.toggle` on and off, alternated per round."""
    import statistics

    decoder = engine.runner.decoder
    assert decoder is not None and isinstance(getattr(decoder, args.toggle, None), bool), args.toggle
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeats):
        for on in (True, False) if r % 2 == 0 else (False, True):
            setattr(decoder, args.toggle, on)
            engine.step()  # the first step after a switch is not timed
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[on].append((time.perf_counter() - t) / args.steps * 1e3)
    for on in (True, False):
        runs = " ".join(f"{x:.0f}" for x in times[on])
        print(f"{args.toggle}={on}: median {statistics.median(times[on]):.1f} ms per step (rounds: {runs})")


if __name__ == "__main__":
    main()
