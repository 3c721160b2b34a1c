"""Speculative decoding (prompt lookup) on the GPU engine: one stream, greedy, copy-heavy prompts,
speculation off against ngram with CUDA graphs on and off; tokens/s and whether every output
equals speculation off (docs/kernels.md "GPU check", docs/speculative-decoding.md "What is refused").

    orcaserve-bench gpu spec [--dtype bf16] [--prompts 4] [--max-tokens 128] [--out spec.json]
    orcaserve-bench gpu spec --smoke     # CPU, TRITON_INTERPRET=1, tiny: every code path

The engine refuses speculation off the CPU; this step alone lifts that with
ORCASERVE_SPECULATIVE_GPU_CHECK=1 (set here, for this process), to prove the equality the refusal
waits for. A speculated step feeds 1 + K query tokens a request, so it is never a decode graph's
(B == T) step: it pads to a mixed graph. The `ngram_eager` side runs with cuda_graphs false, so a
difference between the two ngram sides points at the graphs. `off` runs as the engine does by
default (overlapped scheduling on CUDA); speculation runs synchronously. Exit status 1 if an
output differs.
"""

from __future__ import annotations

import argparse
import os
import time

from orcaserve.bench.gpu.common import ByteTokenizer, Results, device, device_name, free_cuda, shaped_model, torch_dtype

# side: (speculative, cuda_graphs). 256 batched tokens hold a 200-token prompt and keep the mixed
# graphs captured at start few (the step's 60 s cap covers two captures).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
SIDES = {"off": (None, True), "ngram": (SPEC, True), "ngram_eager": (SPEC, False)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="bf16")
    ap.add_argument("--prompts", type=int, default=4, help="copy-heavy prompts, run one at a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1 (fp32), tiny")


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Each a random cycle of 8-24 tokens repeated to ~200 tokens: what prompt lookup copies."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cycle = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
        out.append((cycle * (200 // len(cycle) + 1))[:200])
    return out


def run_side(model, dev, dtype, spec, graphs: bool, batch: list[list[int]], max_tokens: int) -> dict:
    import copy

    from orcaserve.scheduler import Engine, SamplingParams

    # async_scheduling null: on for `off` on CUDA (the engine's default), off with speculation.
    args = dict(attention_backend="triton", max_num_seqs=8, max_num_batched_tokens=256, block_size=16)
    engine = Engine.from_model(
        copy.deepcopy(model), ByteTokenizer(), speculative=spec, cuda_graphs=graphs and dev.type == "cuda",
        dtype=dtype, **args,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([batch[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    outs, t = [], time.perf_counter()
    for p in batch:  # one stream: one request at a time
        outs += [o.output_token_ids for o in engine.generate([p], params)]
    secs = time.perf_counter() - t
    row: dict = {"outputs": outs, "tok_s": round(sum(map(len, outs)) / secs, 1), "seconds": round(secs, 2)}
    g = getattr(engine.runner, "graphs", None)
    row["graph_replays"], row["capture_s"] = 0, 0.0
    if g is not None and engine.runner.use_graphs:
        row["graph_replays"], row["capture_s"] = g.replays, round(g.capture_seconds, 1)
    if engine.spec is not None:
        st = engine.spec.stats
        row.update(steps_on=st.steps_on, proposed=st.proposed, accepted=st.accepted)
    del engine
    free_cuda()
    return row


def run(args: argparse.Namespace) -> dict:
    dev = device("spec", args.smoke)
    if isinstance(dev, dict):
        return dev
    from orcaserve.scheduler.spec.config import GPU_CHECK_ENV

    os.environ[GPU_CHECK_ENV] = "1"  # this step's opt-in (module docstring)
    if dev.type != "cuda":
        args.prompts, args.max_tokens = min(args.prompts, 2), min(args.max_tokens, 8)
    dtype = torch_dtype(args.dtype, dev)
    model = shaped_model(dev, dtype, smoke=dev.type != "cuda")
    batch = prompts(args.prompts, model.config.vocab_size)
    res = Results(getattr(args, "out", None), dev, dtype=str(dtype), prompts=args.prompts, max_tokens=args.max_tokens)
    sides: dict = {}
    res.data["sides"] = sides
    for name, (spec, graphs) in SIDES.items():
        sides[name] = run_side(model, dev, dtype, spec, graphs, batch, args.max_tokens)
        res.save()
    base = sides["off"]["outputs"]
    res.data["all_equal"] = all(s["outputs"] == base for s in sides.values())
    res.data["speedup"] = round(sides["ngram"]["tok_s"] / sides["off"]["tok_s"], 3)
    res.data["elapsed_s"] = round(time.perf_counter() - res.t0, 1)
    for s in sides.values():
        s["outputs"] = [o[:16] for o in s["outputs"]]  # heads only in the JSON
    res.save()
    for name, s in sides.items():
        extra = f" accepted {s['accepted']}/{s['proposed']} in {s['steps_on']} steps" if "proposed" in s else ""
        print(f"{name:<12} {s['tok_s']:9.1f} tok/s  replays {s['graph_replays']}{extra}", flush=True)
    print(f"all_equal {res.data['all_equal']} speedup {res.data['speedup']}x on {device_name(dev)}")
    return {**res.data, "exit_code": 0 if res.data["all_equal"] else 1}
