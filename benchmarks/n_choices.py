"""What `n` choices and `echo` log-probabilities cost: the engine offline, the default model.

    python benchmarks/n_choices.py                    # n=8 of a 512-token prompt, 32 tokens each
    python benchmarks/n_choices.py --n 4 --prompt-len 1024 --json out.json

n choices, three ways, alternating over `--rounds`:
- `shared`: one request with `n` (core/choices.py): the first choice computes the prompt, the
  others start when it has and find its full blocks in the prefix cache;
- `separate`: n requests of the same prompt submitted together, prefix caching on (what a client
  sending n requests gets: they are scheduled in the same steps, so none finds another's blocks);
- `no_cache`: one request with `n`, prefix caching off (every choice computes the prompt).
Printed per run: wall time, prompt tokens computed (the prompt's tokens minus cache hits, summed
over the choices), time to every choice's first token.

Then the prompt's log-probabilities (`prompt_logprobs`, scheduler/model/prompt_logprobs.py): the
time of that forward in one call, beside the prefill of the same prompt in the engine (a request of
one token). The engine spreads it over its steps; what that costs other streams: echo_stall.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

import torch
from serve_report import machine

from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.model.prompt_logprobs import prompt_logprobs


def run_choices(engine: Engine, way: str, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    salt = f"run-{time.time_ns()}"  # a fresh salt: nothing cached from an earlier run counts
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)
    started = time.perf_counter()
    if way == "separate":
        for i in range(n):
            engine.add_request(f"{way}-{i}", prompt, dataclasses.replace(params, seed=seed + i), cache_salt=salt)
    else:
        engine.add_request(way, prompt, dataclasses.replace(params, n=n), cache_salt=salt)
    first: dict[tuple[str, int], float] = {}
    computed = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault((out.request_id, out.index), time.perf_counter() - started)
            if out.finished:
                computed += out.prompt_tokens - out.num_cached_tokens
    wall = time.perf_counter() - started
    ttft = sorted(first.values())
    return {
        "way": way,
        "wall_s": wall,
        "prompt_tokens_computed": computed,
        "first_token_s": [round(t, 3) for t in ttft],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--echo", action=argparse.BooleanOptionalAction, default=True, help="time prompt_logprobs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    engine_args = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
    if args.dtype:
        engine_args["dtype"] = args.dtype
    cached = Engine.from_pretrained(default_model_path(), **engine_args)
    plain = Engine.from_pretrained(default_model_path(), **engine_args, enable_prefix_caching=False)
    load = os.getloadavg()[0]
    print(
        f"{machine()['summary']}; load {load:.1f}; n={args.n}, prompt {args.prompt_len} tokens, "
        f"{args.max_tokens} tokens each, max_num_batched_tokens 512",
        flush=True,
    )
    for engine in (cached, plain):  # first steps of each size are slower (GEMM set-up): not timed
        run_choices(engine, "warm-up", prompt[:64], 2, 4, seed=0)
    runs = []
    for r in range(args.rounds):
        for way, engine in (("shared", cached), ("separate", cached), ("no_cache", plain)):
            row = run_choices(engine, way, prompt, args.n, args.max_tokens, seed=r)
            runs.append(row)
            print(
                f"{way:>9}: {row['wall_s']:.2f} s, prompt tokens computed {row['prompt_tokens_computed']}, "
                f"first tokens at {row['first_token_s'][0]:.2f} .. {row['first_token_s'][-1]:.2f} s",
                flush=True,
            )

    echo = []
    for length in (128, 512, 2048) if args.echo else ():
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        t = time.perf_counter()
        prompt_logprobs(cached.runner, ids, 5)
        forward = time.perf_counter() - t
        t = time.perf_counter()
        cached.generate([ids], SamplingParams(max_tokens=1))
        prefill = time.perf_counter() - t
        echo.append({"prompt_tokens": length, "prompt_logprobs_s": forward, "prefill_s": prefill})
        print(
            f"prompt_logprobs of {length} tokens: {forward:.3f} s; its prefill in the engine {prefill:.3f} s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            out = {"machine": machine(), "load": load, "args": vars(args), "choices": runs, "echo": echo}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
