"""What structured outputs cost a decode step (issue 44): batch 32, half the rows constrained.

SmolLM2-135M-Instruct, 32 requests decoding together; in the constrained runs the odd rows follow
a JSON schema (a story in at least 100 lines: the grammar stays open for the whole run, its mask
is a real one). Times Engine.step() over the decode steps where all 32 rows run, runs alternating
plain / constrained so drift on a shared machine hits both; prints medians and minima (the
minimum is the figure least disturbed by other work on shared cores) and the overhead (goal: at
most +5 %), and the sampler's share measured alone.

    .venv/bin/python benchmarks/structured_cost.py [--steps 40] [--repeats 3] [--dtype float32]

Results in docs/serving.md, 'Structured outputs and tool calls'.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.structured_outputs import StructuredOutputs

# At least 100 lines: the grammar stays open (and its mask a real one) for the whole run.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "lines": {"type": "array", "items": {"type": "string"}, "minItems": 100},
    },
    "required": ["title", "lines"],
}
PROMPT = [{"role": "user", "content": "Write a very long story about a dragon and a knight, as JSON."}]


def run(engine: Engine, constrained: bool, steps: int, tag: str) -> dict[str, list[float]]:
    """Per decode step with all 32 rows running (s): the whole step, the model's forward, and the
    rest (schedule, sampler with the masks, post-processing with the matchers' advance)."""
    spec = StructuredOutputs(json=SCHEMA)
    for i in range(32):
        params = SamplingParams(
            temperature=0,
            max_tokens=steps + 64,
            ignore_eos=True,
            structured_outputs=spec if constrained and i % 2 else None,
        )
        engine.add_request(f"{tag}-{i}", PROMPT_IDS[i], params)
    runner_execute = engine.runner.execute
    forward: list[float] = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = runner_execute(*args, **kwargs)
        forward.append(time.perf_counter() - t0)
        return out

    engine.runner.execute = timed  # type: ignore[method-assign]
    got: dict[str, list[float]] = {"step": [], "forward": [], "rest": []}
    try:
        while engine.has_unfinished() and len(got["step"]) < steps:
            before = engine.stats.num_steps
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if engine.stats.last_step_tokens == 32 and len(engine.scheduler.running) == 32 and forward:
                if engine.stats.num_steps > before:
                    got["step"].append(dt)
                    got["forward"].append(forward[-1])
                    got["rest"].append(dt - forward[-1])
        for i in range(32):
            engine.abort(f"{tag}-{i}")
    finally:
        engine.runner.execute = runner_execute  # type: ignore[method-assign]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = Engine.from_pretrained(
        default_model_path(), dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=2048
    )
    global PROMPT_IDS
    text = engine.tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    base = engine.tokenizer.encode(text, add_special_tokens=False)
    PROMPT_IDS = [base[:-3] + [engine.tokenizer.encode(f" {i}")[0]] + base[-3:] for i in range(32)]
    run(engine, True, 4, "warm")  # compiles the grammar, warms the caches
    plain: dict[str, list[float]] = {"step": [], "forward": [], "rest": []}
    constrained: dict[str, list[float]] = {"step": [], "forward": [], "rest": []}
    for r in range(args.repeats):
        for into, on in ((plain, False), (constrained, True)):
            for key, values in run(engine, on, args.steps, f"{int(on)}-{r}").items():
                into[key] += values
    print(f"decode step, batch 32, {args.dtype}, {len(plain['step'])} + {len(constrained['step'])} steps (ms)")
    for name, pick in (("median", statistics.median), ("minimum", min)):
        p = {k: 1e3 * pick(v) for k, v in plain.items()}
        c = {k: 1e3 * pick(v) for k, v in constrained.items()}
        print(
            f"  {name:7s} step / forward / rest: no constraints {p['step']:.2f} / {p['forward']:.2f} / {p['rest']:.2f}"
        )
        print(
            f"  {name:7s} step / forward / rest: 16 constrained {c['step']:.2f} / {c['forward']:.2f} / {c['rest']:.2f}"
        )
    # The forward is the same work in both (32 decode tokens, same lengths); on shared cores it is
    # what other work disturbs most. The constraints' cost is in `rest`: set against the fastest
    # plain step, the step least disturbed.
    extra = 1e3 * (statistics.median(constrained["rest"]) - statistics.median(plain["rest"]))
    fastest = 1e3 * min(plain["step"])
    share = 100 * extra / fastest
    print(f"  constraints' cost: rest +{extra:.2f} ms (medians) = {share:+.1f} % of the fastest plain step")
    whole = statistics.median(constrained["step"]) / statistics.median(plain["step"]) - 1
    print(f"  whole steps, medians: {100 * whole:+.1f} %")


PROMPT_IDS: list[list[int]] = []

if __name__ == "__main__":
    main()
