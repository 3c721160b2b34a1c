"""Decode throughput with quantized weights at the 1B shape (docs/serving.md "Quantized weights").

    python benchmarks/quant_decode.py --mode bf16            # dense bf16, the baseline
    python benchmarks/quant_decode.py --mode int4 --batches 1,32 --steps 6
    python benchmarks/quant_decode.py --model DIR_OR_GGUF --mode gguf

One mode per run (a process each, so its RSS is its own): the random Llama-3.2-1B-shaped bf16
checkpoint of random_checkpoint.py (built on first use), served with dtype `--dtype` (bf16:
activations and KV cache) and `quantization` none (mode bf16/fp32), int8 or int4. For each batch B,
B requests of `--context` random prompt tokens are prefilled, then whole `Engine.step()`s are
timed while every request decodes (EOS ignored); reported: the median step, B / step = decode
tokens per second, the decoder's weight bytes and the process RSS. Results merge into
`--json` under the mode's name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch
from random_checkpoint import checkpoint_path

from orcaserve.scheduler import Engine, SamplingParams


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def weight_bytes(engine: Engine) -> int:
    """Bytes the lean decoder's GEMMs hold (packed dense or block codes) plus the embedding."""
    dec = engine.runner.decoder
    assert dec is not None
    gemms = [dec.lm_head] + [g for layer in dec.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    total = dec.embed.numel() * dec.embed.element_size()
    for g in gemms:
        if hasattr(g, "nbytes"):
            total += g.nbytes()
        else:
            total += g.weight.numel() * g.weight.element_size()
            if getattr(g, "plain", None) is not None:
                total += g.plain.numel() * g.plain.element_size()
    return total


def decode_steps(engine: Engine, batch: int, context: int, steps: int, tag: str) -> list[float]:
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}{i}", [rng.randrange(100, 49000) for _ in range(context)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill, not timed
    engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", required=True, choices=["bf16", "fp32", "int8", "int4", "gguf"])
    ap.add_argument("--model", default=None, help="default: the random 1B-shape checkpoint")
    ap.add_argument("--dtype", default="bfloat16", help="activations and KV cache (modes int8/int4/gguf)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="benchmarks/results/quant_decode.json")
    args = ap.parse_args()
    path = args.model or checkpoint_path("1b")
    batches = [int(b) for b in args.batches.split(",")]
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(args.mode, args.dtype)
    quantization = None if args.mode in ("bf16", "fp32") else args.mode
    t = time.perf_counter()
    engine = Engine.from_pretrained(
        path,
        dtype=dtype,
        quantization=quantization,
        max_num_seqs=max(batches),
        max_num_batched_tokens=512,
        kv_cache_memory=1 << 30,
        enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - t
    decoder = engine.runner.decoder
    assert decoder is not None
    result: dict = {
        "dtype": dtype,
        "quantization": quantization,
        "kernel": {"layers": decoder.layers[0].qkv.kernel, "lm_head": decoder.lm_head.kernel},
        "load_s": round(load_s, 1),
        "weight_mb": round(weight_bytes(engine) / 1e6, 1),
        "rss_mb": round(rss_mb(), 1),
        "context": args.context,
        "batches": {},
    }
    for b in batches:
        times = decode_steps(engine, b, args.context, args.steps, f"b{b}_")
        step = statistics.median(times)
        result["batches"][str(b)] = {
            "step_ms_median": round(step * 1e3, 1),
            "step_ms_min": round(min(times) * 1e3, 1),
            "decode_tok_s": round(b / step, 2),
        }
        print(f"{args.mode}: batch {b}: median step {step * 1e3:.1f} ms, {b / step:.2f} tok/s", flush=True)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["load_avg_after"] = os.getloadavg()
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    result["command"] = f"python benchmarks/quant_decode.py --mode {args.mode} --batches {args.batches} " + (
        f"--context {args.context} --steps {args.steps}"
    )
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    merged = json.load(open(args.json)) if os.path.exists(args.json) else {}
    merged[args.mode] = result
    with open(args.json, "w") as f:
        json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
