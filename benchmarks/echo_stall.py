"""What a prompt's log-probabilities (`echo` with `logprobs`) cost the streams decoding beside it.

    python benchmarks/echo_stall.py                          # prompts of 512 and 2,048 tokens
    python benchmarks/echo_stall.py --prompt-lens 512 --streams 16 --rounds 3 --json out.json

The default model, `max_num_batched_tokens` 512. `--streams` requests decode (ignore_eos); then one
request with `prompt_logprobs=5` arrives. Two ways, per prompt length:
- `chunked` (the engine): its job advances one chunk per step (core/prompt_jobs.py); printed: the
  job's wall time and steps, the streams' tokens in that time, their longest and median gap
  between tokens, beside their median step before the request came;
- `at_once` (what the engine did before): the whole forward in one call (`prompt_logprobs`), during
  which no stream gets a token: the gap is that call's time.
The two alternate over `--rounds` (chunked first in even rounds, at once first in odd ones).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from serve_report import machine

from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.model.prompt_logprobs import prompt_logprobs


def decode_steps(engine: Engine, steps: int) -> list[float]:
    """Wall time of `steps` steps."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def chunked(engine: Engine, ids: list[int]) -> dict:
    """Add the echo request and step until its job is done: per step, time and stream tokens."""
    engine.add_request("echo", ids, SamplingParams(max_tokens=1, prompt_logprobs=5))
    started, steps, tokens = time.perf_counter(), [], 0
    while "echo" in engine.prompt_jobs:
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        tokens += sum(len(o.new_token_ids) for o in outs if o.request_id != "echo")
    wall = time.perf_counter() - started
    engine.abort("echo")
    return {
        "job_s": wall,
        "steps": len(steps),
        "stream_tokens": tokens,
        "max_gap_s": max(steps),
        "median_gap_s": statistics.median(steps),
    }


def report(row: dict) -> None:
    c = row["chunked"]
    print(
        f"round {row['round']}, {row['prompt_tokens']} prompt tokens: decode step before "
        f"{row['decode_step_s'] * 1e3:.0f} ms; chunked: job {c['job_s']:.2f} s in {c['steps']} steps, streams got "
        f"{c['stream_tokens']} tokens, gap max {c['max_gap_s'] * 1e3:.0f} ms median {c['median_gap_s'] * 1e3:.0f} ms; "
        f"at once: {row['at_once_s']:.2f} s without a token",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rng = random.Random(0)
    engine = Engine.from_pretrained(default_model_path(), max_num_seqs=32, max_num_batched_tokens=512)
    load = os.getloadavg()[0]
    print(f"{machine()['summary']}; load {load:.1f}; {args.streams} streams decoding", flush=True)
    prompt_logprobs(engine.runner, [rng.randrange(100, 40000) for _ in range(64)], 5)  # warm-up
    stream = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{i}", [rng.randrange(100, 40000) for _ in range(32)], stream)
    decode_steps(engine, 5)  # their prefill, then decodes only
    rows = []
    for r in range(args.rounds):
        for length in args.prompt_lens:
            ids = [rng.randrange(100, 40000) for _ in range(length)]
            row = {"round": r, "prompt_tokens": length, "decode_step_s": statistics.median(decode_steps(engine, 10))}
            for way in ("chunked", "at_once") if r % 2 == 0 else ("at_once", "chunked"):
                if way == "chunked":
                    row["chunked"] = chunked(engine, ids)
                else:
                    t = time.perf_counter()
                    prompt_logprobs(engine.runner, ids, 5)
                    row["at_once_s"] = time.perf_counter() - t
            rows.append(row)
            report(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "load": load, "args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
