"""Offline throughput: orcaserve vs transformers padded `generate` vs transformers `generate_batch`.

    orcaserve-bench offline                      # the default workload, all systems
    orcaserve-bench offline --num-prompts 16 --systems orcaserve --out out.json
    orcaserve-bench offline --systems orcaserve --dtype bf16 --max-model-len 1024   # as `peers` runs it

Workload: N prompts of random token ids with lengths U[min_prompt, max_prompt] and output lengths
U[min_out, max_out] (fixed seed, EOS ignored), all submitted at once. "Useful" tokens are each
request's own output length: a padded batch that runs to its longest member produces more tokens
than were asked for, and those do not count. Also measures the steady-state decode step time at
batch B and context C: the engine's `step()` (scheduler, paged cache, sampler, detokenizer
included) against a bare transformers forward of the same batch over a `DynamicCache`. orcaserve's
model runs are also timed per step and summed by kind (decode-only steps, steps with prompt tokens:
`model_runs` in the JSON), which says whether a workload's time goes to prefill or to decode.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import sys
import time

import torch

from orcaserve.bench.serve.workload import add_offline_args, offline_workload_of, workload_sha256
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model.loader import load_model_and_tokenizer


def _engine_args(args) -> dict:
    """The engine's quantization, activations and attention backend arguments (callers such as the
    GPU check pass their own argument namespaces, with or without them)."""
    return {k: getattr(args, k, None) for k in ("quantization", "activations", "attention_backend")}


def run_orcaserve(model, tokenizer, work, args) -> dict:
    engine = Engine.from_model(
        copy.deepcopy(model),
        tokenizer,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        **_engine_args(args),
    )
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    by_kind = _time_model_runs(engine)
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t
    assert [o.completion_tokens for o in outs] == [n for _, n in work]
    per_token, per_sample = projection_flop(model.config)
    model_s = sum(k["model_s"] for k in by_kind.values())
    flop = per_token * sum(k["tokens"] for k in by_kind.values()) + per_sample * sum(n for _, n in work)
    return {
        "wall_s": wall,
        "useful_tokens": sum(n for _, n in work),
        "steps": engine.stats.num_steps,
        "preemptions": engine.stats.num_preemptions,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "model_runs": by_kind,
        # The projections' work over the model runs' time (attention and norms included in the
        # time, not in the work): a lower bound of the GEMMs' rate.
        "projection_gflop_s": flop / model_s / 1e9 if model_s else None,
        "projection_peak": projection_peak(str(engine.dtype), args),
    }


def projection_peak(dtype: str, args) -> dict | None:
    """The nominal peak the projections run against: threads x GHz (`--ghz`, else the OS's maximum)
    x operations per cycle of the GEMM in use (vpdpbusd's int8 with int8 activations, vdpbf16ps's or
    AMX's bf16 with bf16 weights); None for the fp32 GEMMs (their rate per cycle is not in the flags)."""
    from orcaserve.bench.cpu.gemm import nominal_ghz, peaks

    cores, ghz = torch.get_num_threads(), getattr(args, "ghz", None) or nominal_ghz()
    p = peaks(cores, ghz)
    if getattr(args, "activations", None) == "int8":
        kind, per_cycle, gflops = "int8", p["int8_op_per_cycle"], p["int8_gops"]
    elif dtype == "torch.bfloat16" and not getattr(args, "quantization", None):
        kind, per_cycle, gflops = "bf16", p["bf16_flop_per_cycle"], p["bf16_gflops"]
    else:
        return None
    return {"kind": kind, "gflop_s": gflops, "formula": f"{cores} x {ghz:.2f} GHz x {per_cycle:g}"}


def projection_flop(config) -> tuple[int, int]:
    """FLOP of the decoder's projections per token (q, k, v, o, gate, up, down in every layer),
    and of the lm_head per sampled row (one per output token)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter), 2 * h * config.vocab_size


def _time_model_runs(engine: Engine) -> dict[str, dict[str, float]]:
    """Times each step's model run (the runner's `execute`: its metadata, the forward and the
    lm_head; not scheduling or sampling), summed by kind: steps that ran one token per request
    (decodes; a prompt's 1-token last chunk counts there too), and steps with more (prompt
    chunks). The two cost differently per token (weights read once per step, GEMM rows), so their
    split says where a workload's time goes."""
    by_kind = {k: {"steps": 0, "tokens": 0, "model_s": 0.0} for k in ("decode_only", "with_prompt")}
    execute = engine.runner.execute

    def timed(sched, kv):
        t = time.perf_counter()
        logits = execute(sched, kv)
        elapsed = time.perf_counter() - t
        tokens = sum(sched.num_scheduled_tokens.values())
        k = by_kind["decode_only" if tokens == len(sched.num_scheduled_tokens) else "with_prompt"]
        k["steps"] += 1
        k["tokens"] += tokens
        k["model_s"] += elapsed
        return logits

    engine.runner.execute = timed
    return by_kind


def run_padded_generate(model, tokenizer, work, args) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    produced = 0
    t = time.perf_counter()
    for i in range(0, len(work), args.batch):
        batch = work[i : i + args.batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        produced += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "useful_tokens": sum(n for _, n in work), "tokens_generated": produced}


def run_generate_batch(model, tokenizer, work, args) -> dict:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=args.max_out, do_sample=False, eos_token_id=None, pad_token_id=0)
    t = time.perf_counter()
    # The manager behind generate_batch, so that each request gets its own max_new_tokens.
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in work]
        done = 0
        while done < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
    wall = time.perf_counter() - t
    return {"wall_s": wall, "useful_tokens": sum(n for _, n in work)}


def step_time(model, tokenizer, args) -> dict:
    """Decode steps at batch B over context C: engine step vs bare transformers forward."""
    b, c, n = args.step_batch, args.step_context, args.step_tokens
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 49000) for _ in range(c)] for _ in range(b)]

    engine = Engine.from_model(
        copy.deepcopy(model),
        tokenizer,
        max_num_seqs=b,
        max_num_batched_tokens=max(512, c),
        dtype=args.dtype,
        **_engine_args(args),
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (chunked), not timed
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    engine_s = (time.perf_counter() - t) / n

    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(n):
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        bare_s = (time.perf_counter() - t) / n
    return {
        "batch": b,
        "context": c,
        "engine_step_ms": engine_s * 1e3,
        "bare_forward_ms": bare_s * 1e3,
        "ratio": engine_s / bare_s,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    add_offline_args(ap)
    ap.add_argument("--max-model-len", type=int, default=None, help="engine max_model_len (default: the engine's)")
    ap.add_argument(
        "--dtype",
        default=None,
        help="fp32 | bf16 | fp16 for every system (default: fp32 load, the engine's own default dtype)",
    )
    ap.add_argument("--quantization", default=None, help="orcaserve: gguf | int8 | int4 (the model loads in fp32)")
    ap.add_argument("--activations", default=None, help="orcaserve, with --quantization: int8")
    ap.add_argument(
        "--ghz", type=float, default=None, help="clock of the projections' nominal peak (default: the OS's)"
    )
    ap.add_argument("--batch", type=int, default=32, help="padded generate batch size")
    ap.add_argument("--systems", default="orcaserve,generate,generate_batch,step")
    ap.add_argument("--step-batch", type=int, default=32)
    ap.add_argument("--step-context", type=int, default=256)
    ap.add_argument("--step-tokens", type=int, default=16)


def run(args: argparse.Namespace) -> dict:
    load_dtype = EngineConfig(dtype=args.dtype, device="cpu").resolved_dtype() if args.dtype else torch.float32
    load_dtype = torch.float32 if args.quantization else load_dtype  # codes from the exact weights
    model, tokenizer = load_model_and_tokenizer(args.model or default_model_path(), load_dtype, torch.device("cpu"))
    model.generation_config.eos_token_id = None  # ignore EOS everywhere: fixed output lengths
    work = offline_workload_of(args, model.config.vocab_size)
    runners = {"orcaserve": run_orcaserve, "generate": run_padded_generate, "generate_batch": run_generate_batch}
    results: dict = {
        "workload": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d"),
        "workload_sha256": workload_sha256(work),
    }
    systems = args.systems.split(",")
    for name in systems:
        if name in runners:
            r = runners[name](model, tokenizer, work, args)
            r["useful_tok_s"] = r["useful_tokens"] / r["wall_s"]
            results[name] = r
            print(f"{name:>15}: {r['useful_tok_s']:7.1f} useful tok/s  wall {r['wall_s']:7.1f} s", file=sys.stderr)
            if r.get("projection_gflop_s"):
                peak = r.get("projection_peak")
                of = (
                    f", {100 * r['projection_gflop_s'] / peak['gflop_s']:.0f} % of the nominal {peak['kind']}"
                    f" peak {peak['gflop_s']:.0f} ({peak['formula']})"
                    if peak
                    else ""
                )
                print(f"{'':>15}  projections {r['projection_gflop_s']:.0f} GFLOP/s in model runs{of}", file=sys.stderr)
            for kind, k in r.get("model_runs", {}).items():
                print(
                    f"{'':>15}  {kind}: {k['steps']} steps, {k['tokens']} tokens, model {k['model_s']:.1f} s"
                    f" ({1e3 * k['model_s'] / max(k['steps'], 1):.1f} ms per step)",
                    file=sys.stderr,
                )
    if "step" in systems:
        results["step_time"] = step_time(model, tokenizer, args)

    print(f"\n{'system':<16}{'useful tok/s':>14}{'wall s':>10}{'vs generate':>13}")
    base = results.get("generate", {}).get("useful_tok_s")
    for name in runners:
        if name in results:
            r = results[name]
            rel = f"{r['useful_tok_s'] / base:.2f}x" if base else "-"
            print(f"{name:<16}{r['useful_tok_s']:>14.1f}{r['wall_s']:>10.1f}{rel:>13}")
    if "step_time" in results:
        s = results["step_time"]
        print(
            f"\ndecode step, batch {s['batch']}, context {s['context']}: engine {s['engine_step_ms']:.1f} ms, "
            f"bare transformers forward {s['bare_forward_ms']:.1f} ms, ratio {s['ratio']:.2f}"
        )
    return results
