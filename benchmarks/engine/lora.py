"""`orcaserve-bench lora`: many LoRA adapters mixed in one step against the base model alone
(docs/lora.md "What it costs"; dated runs in docs/performance-log.md).

    orcaserve-bench lora                                   # SmolLM2, 1/4/16 adapters x rank 8/16/64
    orcaserve-bench lora --adapters 16 --ranks 16 --traffic uniform,zipf --out lora.json
    orcaserve-bench lora --adapters 16 --ranks 16 --max-loras 4   # 16 on the host, 4 stacked: LRU swaps
    orcaserve-bench lora --adapters 16 --ranks 16 --twin   # and the mixed runs through the PyTorch twins
    orcaserve-bench lora --adapters 16 --ranks 16 --loop   # and with the adapters' steps op by op
    OMP_WAIT_POLICY=passive orcaserve-bench lora --clock cpu   # tokens per second of the process's CPU time
    orcaserve-bench lora --swap-cost --adapters 8 --ranks 16 --max-loras 4   # a swap, a load: lora_swap.py
    orcaserve-bench lora --adapters 16 --ranks 16 --traffic uniform --peer vllm   # then vLLM's (peers/lora_vllm.py)

For each (adapter count, rank) one engine is built with that many random adapters in PEFT's format
(every projection of every layer targeted, B nonzero: written to a temporary directory, read
through the engine's own loader). On that engine the same closed-loop workload (`--clients`
clients, `--requests` requests of `--input-len` random prompt tokens and `--output-len` greedy
tokens, EOS ignored) runs with every request on the base model and with the requests spread over
the adapters, uniformly or by a Zipf law (adapter i drawn with weight 1 / (i + 1)), alternating
base and mixed runs `--repeats` times (the machine may be shared) and keeping medians. Printed:
tokens/s of each, the ratio mixed / base, the steps that carried an adapter, and memory per adapter
(its weights and its share of the stacked copy the batched update reads). With `--max-loras` below
the adapter count, adapters are swapped into the stacked slots by LRU (docs/lora.md "More adapters
than a step holds"); the mixed runs also report the slot evictions and the share of their wall
time spent rewriting slots (`LoraSet.sync`).
Adapters are served over dense weights (docs/lora.md "What is refused"): a GGUF loads dense.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orcaserve.kernels.pytorch.lora import lora_batched_parts, lora_sgmv
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.lora.adapter import TARGETS

# Each target's (in, out) width from a transformers config.
_WIDTHS = {
    "q_proj": lambda c, d: (c.hidden_size, c.num_attention_heads * d),
    "k_proj": lambda c, d: (c.hidden_size, c.num_key_value_heads * d),
    "v_proj": lambda c, d: (c.hidden_size, c.num_key_value_heads * d),
    "o_proj": lambda c, d: (c.num_attention_heads * d, c.hidden_size),
    "gate_proj": lambda c, d: (c.hidden_size, c.intermediate_size),
    "up_proj": lambda c, d: (c.hidden_size, c.intermediate_size),
    "down_proj": lambda c, d: (c.intermediate_size, c.hidden_size),
}


def model_config(path: str) -> Any:
    """transformers' config of an HF directory or a .gguf file."""
    from transformers import AutoConfig

    p = Path(path)
    if p.suffix == ".gguf":
        return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoConfig.from_pretrained(str(p))


def write_adapter(path: Path, config: Any, rank: int, seed: int, std: float = 0.02) -> int:
    """A random rank-`rank` adapter on every projection of every layer, in PEFT's format; its bytes."""
    from safetensors.torch import save_file

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, block in TARGETS.items():
            in_f, out_f = _WIDTHS[module](config, head_dim)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    spec = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(spec))
    return sum(t.numel() for t in tensors.values())


def pick(names: list[str], traffic: str, count: int, seed: int) -> list[str | None]:
    """Each request's adapter: None for the base run, else uniform or Zipf over `names`."""
    if traffic == "base":
        return [None] * count
    rng = random.Random(seed)
    if traffic == "uniform":
        return [names[i % len(names)] for i in range(count)]
    weights = [1 / (i + 1) for i in range(len(names))]
    return list(rng.choices(names, weights=weights, k=count))


def run_load(
    engine: Engine,
    prompts: list[list[int]],
    loras: list[str | None],
    clients: int,
    out_len: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Closed loop: `clients` requests in flight, each prompt once, greedy, `out_len` tokens; timed
    by `clock` (the wall, or the process's CPU time: `--clock cpu`, steadier on a shared machine)."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    steps_with_adapter, sync_s = 0, 0.0
    loras_set = engine.runner.loras
    step, sync = loras_set.step, loras_set.sync
    evictions = loras_set.slots.num_evictions

    def counting(*a: Any) -> Any:
        nonlocal steps_with_adapter
        got = step(*a)
        steps_with_adapter += got is not None
        return got

    def timed() -> None:
        nonlocal sync_s
        t = clock()
        sync()
        sync_s += clock() - t

    loras_set.step, loras_set.sync = counting, timed
    in_flight, nxt, tokens, steps = 0, 0, 0, 0
    start = clock()
    try:
        while nxt < len(prompts) or in_flight:
            while in_flight < clients and nxt < len(prompts):
                engine.add_request(f"r{nxt}", prompts[nxt], params, lora=loras[nxt])
                nxt, in_flight = nxt + 1, in_flight + 1
            steps += 1
            for out in engine.step():
                if out.finished:
                    tokens += len(out.output_token_ids)
                    in_flight -= 1
    finally:
        del loras_set.step, loras_set.sync  # the instance attributes: the class's methods again
    wall = clock() - start
    return {
        "tok_s": tokens / wall,
        "steps": steps,
        "steps_with_adapter": steps_with_adapter,
        "evictions": loras_set.slots.num_evictions - evictions,
        "sync_share": sync_s / wall,
    }


def alternate(engine: Engine, prompts: list[list[int]], names: list[str], traffic: str, args: Any) -> dict:
    """Base and mixed runs alternated `args.repeats` times on one engine; medians and every run."""
    base: list[float] = []
    mixed: list[float] = []
    twin: list[float] = []
    loop: list[float] = []
    share: list[float] = []
    evictions: list[int] = []
    sync_share: list[float] = []
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for r in range(args.repeats):

        def load(kind: str, r: int = r) -> dict:
            return run_load(engine, prompts, pick(names, kind, len(prompts), r), args.clients, args.output_len, clock)

        base.append(load("base")["tok_s"])
        got = load(traffic)
        mixed.append(got["tok_s"])
        if args.twin:  # the same mixed run through the PyTorch twins (the A/B of the table's cells)
            loras: Any = engine.runner.loras
            table_ops = loras.op, loras.batched_op, loras.blocked
            loras.op = lora_sgmv
            loras.use_batched(lora_batched_parts, False)  # the stacks in the twin's layout
            try:
                twin.append(load(traffic)["tok_s"])
            finally:
                loras.op = table_ops[0]
                loras.use_batched(table_ops[1], table_ops[2])
        call = engine.runner.decoder.layer_call
        if args.loop and call is not None:  # the same mixed run, its adapters' steps op by op (the layer call's A/B)
            call.with_lora = False
            try:
                loop.append(load(traffic)["tok_s"])
            finally:
                call.with_lora = True
        share.append(got["steps_with_adapter"] / got["steps"])
        evictions.append(got["evictions"])
        sync_share.append(got["sync_share"])
    base_tok_s, mixed_tok_s = statistics.median(base), statistics.median(mixed)
    extra: dict[str, Any] = {}
    for name, runs in (("twin", twin), ("loop", loop)):  # the alternated A/B runs asked for
        if runs:
            extra |= {
                f"mixed_{name}_tok_s": round(statistics.median(runs), 2),
                f"{name}_runs": [round(x, 1) for x in runs],
            }
    return {
        "base_tok_s": round(base_tok_s, 2),
        "mixed_tok_s": round(mixed_tok_s, 2),
        "ratio": round(mixed_tok_s / base_tok_s, 3),
        "base_runs": [round(x, 1) for x in base],
        "mixed_runs": [round(x, 1) for x in mixed],
        "steps_with_adapter": round(statistics.mean(share), 3),
        "evictions": round(statistics.mean(evictions), 1),
        "sync_share": round(statistics.mean(sync_share), 4),
    } | extra


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--adapters", default="1,4,16", help="adapter counts, comma-separated")
    ap.add_argument("--ranks", default="8,16,64", help="adapter ranks, comma-separated")
    ap.add_argument("--traffic", default="uniform,zipf", help="uniform and/or zipf over the adapters")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternated base/mixed rounds; medians kept")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-loras", type=int, default=None, help="stacked slots (default: every adapter)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    ap.add_argument("--twin", action="store_true", help="also the mixed runs through the PyTorch twins, alternated")
    ap.add_argument(
        "--loop", action="store_true", help="also the mixed runs with the adapters' steps op by op (no layer call)"
    )
    ap.add_argument(
        "--peer",
        choices=["vllm"],
        default=None,
        help="then vLLM's runs on the same adapters and workload (uniform traffic; its venv: benchmarks/peers)",
    )
    ap.add_argument("--swap-cost", action="store_true", help="time slot swaps and adapter reads only (lora_swap.py)")


def run(args: argparse.Namespace) -> dict:
    path = args.model or default_model_path()
    config = model_config(path)
    if args.swap_cost:
        from orcaserve.bench.engine.lora_swap import swap_cost

        dtype = getattr(torch, args.dtype or "bfloat16")
        rank, count = int(args.ranks.split(",")[0]), int(args.adapters.split(",")[-1])
        return swap_cost(config, rank, count, args.max_loras or max(1, count // 2), dtype)
    rng = random.Random(0)
    vocab = config.vocab_size
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(args.requests)]
    traffics = args.traffic.split(",")
    results: dict[str, Any] = {"model": path, "clients": args.clients, "requests": args.requests, "runs": []}
    print(
        f"{'adapters':>8}{'rank':>6}{'traffic':>9}{'base tok/s':>12}{'mixed tok/s':>13}{'ratio':>8}"
        f"{'steps w/ adapter':>18}{'MiB/adapter':>13}{'evictions':>11}{'sync %':>8}",
        file=sys.stderr,
    )
    for rank in map(int, args.ranks.split(",")):
        for count in map(int, args.adapters.split(",")):
            with tempfile.TemporaryDirectory(prefix="orca-lora-bench-") as tmp:
                adapters = {}
                for i in range(count):
                    write_adapter(Path(tmp) / f"a{i}", config, rank, seed=1000 * rank + i)
                    adapters[f"a{i}"] = str(Path(tmp) / f"a{i}")
                engine = Engine.from_pretrained(
                    path,
                    dtype=args.dtype,
                    max_num_seqs=args.clients,
                    enable_prefix_caching=False,
                    lora_adapters=adapters,
                    max_lora_rank=max(16, rank),
                    max_loras=None if args.max_loras is None else min(args.max_loras, count),
                )
                mib = engine.runner.loras.nbytes / count / 2**20  # its weights and its stacked copy
                names = list(adapters)
                engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4))  # warm-up
                for traffic in traffics:
                    row = {"adapters": count, "rank": rank, "traffic": traffic, "mib_per_adapter": round(mib, 2)}
                    row["max_loras"] = len(engine.runner.loras.slots.names)
                    row.update(alternate(engine, prompts, names, traffic, args))
                    results["runs"].append(row)
                    print(
                        f"{count:>8}{rank:>6}{traffic:>9}{row['base_tok_s']:>12.1f}{row['mixed_tok_s']:>13.1f}"
                        f"{row['ratio']:>7.2f}x{row['steps_with_adapter']:>18.2f}{mib:>13.2f}"
                        f"{row['evictions']:>11.1f}{100 * row['sync_share']:>8.2f}",
                        file=sys.stderr,
                    )
                    if args.peer == "vllm" and traffic == "uniform":
                        from orcaserve.bench.peers.lora_vllm import vllm_lora

                        row.update(vllm_lora(list(adapters.values()), rank, args))
                        print(f"{'':>23}vLLM: base {row['vllm_base_tok_s']:.1f}, mixed {row['vllm_mixed_tok_s']:.1f} "
                              f"tok/s, {row['vllm_ratio']:.2f}x", file=sys.stderr)  # fmt: skip
                    if "mixed_twin_tok_s" in row:
                        twin = row["mixed_twin_tok_s"]
                        print(f"{'':>23}mixed through the PyTorch twins: {twin:.1f} tok/s", file=sys.stderr)
                    if "mixed_loop_tok_s" in row:
                        loop = row["mixed_loop_tok_s"]
                        print(f"{'':>23}mixed, adapters' steps op by op: {loop:.1f} tok/s "
                              f"({loop / row['base_tok_s']:.2f}x)", file=sys.stderr)  # fmt: skip
                del engine
    return results
