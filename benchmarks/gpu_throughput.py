"""gpu_engine.py throughput: a random model of SmolLM2-135M's shape (or, `--shape llama8b`, of
Llama-3.1-8B's layers with SmolLM2's vocabulary) on the
offline workload."""

from __future__ import annotations

import argparse
import time
from typing import Any

from orcaserve.bench.gpu_common import CONFIGS, ByteTokenizer, OnDevice, Results, device_name, free_cuda

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.02,
)
# Llama-3.1-8B's layers (hidden 4096, 32 layers, 32 / 8 heads x 128, MLP 14336) with SmolLM2's
# vocabulary and tied embeddings: 7.2 B parameters, 14.4 GB in bf16 (the 8B shape).
LLAMA8B = dict(
    SMOLLM2,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
)
SHAPES: dict[str, dict[str, Any]] = {"smollm2": SMOLLM2, "llama8b": LLAMA8B}
SMOKE_SHAPE: dict[str, Any] = dict(
    SMOLLM2,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def smollm2_shaped(dev, dtype, smoke: bool, shape: str = "smollm2"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):  # the 8B shape: 29 GB in fp32 before the cast, on a 141 GB H200
        model = LlamaForCausalLM(LlamaConfig(**(SMOKE_SHAPE if smoke else SHAPES[shape]))).to(dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS everywhere: fixed output lengths
    return model


def generate_batch_startup(model, args) -> float:
    """Seconds to start and stop an idle continuous-batching manager (its warm-up captures CUDA
    graphs): offline.run_generate_batch times it as part of the run, so it is also reported apart."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=args.max_out, do_sample=False, eos_token_id=None, pad_token_id=0)
    t = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5):
        pass
    return time.perf_counter() - t


def run_throughput(args, dev) -> dict:
    import torch

    from orcaserve.bench import offline
    from orcaserve.bench.serve_workload import offline_workload_of, workload_sha256

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = smollm2_shaped(dev, dtype, args.smoke, args.shape)
    tok = ByteTokenizer()
    work = offline_workload_of(args, model.config.vocab_size)
    warm = work[: args.warmup_prompts]
    res = Results(
        args.out,
        step="throughput",
        device=str(dev),
        device_name=device_name(dev),
        model="smoke shape" if args.smoke else f"random-init, {args.shape} shape",
        model_config={k: v for k, v in (SMOKE_SHAPE if args.smoke else SHAPES[args.shape]).items()},
        workload={
            k: getattr(args, k)
            for k in ("num_prompts", "seed", "min_prompt", "max_prompt", "min_out", "max_out", "dtype")
        },
        workload_sha256=workload_sha256(work),
        useful_tokens=sum(n for _, n in work),
        prompt_tokens=sum(len(p) for p, _ in work),
        runs=[],
    )
    runners = {
        "orcaserve": offline.run_orcaserve,
        "generate": offline.run_padded_generate,
        "generate_batch": offline.run_generate_batch,
    }
    failed = 0
    for cfg_name in args.configs.split(","):
        seqs, tokens, batch = CONFIGS[cfg_name]
        if args.smoke:
            seqs, tokens, batch = 4, 64, 4
        ns = argparse.Namespace(**vars(args))
        ns.max_num_seqs, ns.max_num_batched_tokens, ns.batch = seqs, tokens, batch
        ns.max_model_len, ns.attention_backend = None, "triton"  # also under the CPU smoke run's interpreter
        for name in args.systems.split(","):
            if name == "generate_batch" and cfg_name != args.configs.split(",")[0]:
                continue  # its own scheduler sizes itself; one run is enough
            fn = runners[name]
            target = OnDevice(model) if name == "generate" else model
            row = {
                "system": name,
                "config": cfg_name,
                "max_num_seqs": seqs,
                "max_num_batched_tokens": tokens,
                "generate_batch_size": batch if name == "generate" else None,
                "status": "warm-up",
            }
            res.data["runs"].append(row)  # saved as it goes: a timeout leaves the row with its status
            res.save()
            print(f"[{cfg_name}] {name}: warm-up ...", flush=True)
            try:
                if name == "generate_batch":
                    row["startup_s"] = generate_batch_startup(model, ns)
                else:
                    fn(target, tok, warm, ns)
                free_cuda()
                row["status"] = "running"
                res.save()
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.time()  # epoch seconds: gpu_check.sh reads SM busy (dmon) over this window
                r = fn(target, tok, work, ns)
                r["window"] = [t0, time.time()]
                r["useful_tok_s"] = r["useful_tokens"] / r["wall_s"]
                if dev.type == "cuda":
                    r["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(dev) / (1 << 30)
                if "startup_s" in row and r["wall_s"] > row["startup_s"]:
                    r["useful_tok_s_excl_startup"] = r["useful_tokens"] / (r["wall_s"] - row["startup_s"])
                row.update(r, status="done")
                print(
                    f"[{cfg_name}] {name}: {r['useful_tok_s']:9.1f} useful tok/s, wall {r['wall_s']:7.2f} s", flush=True
                )
            except Exception as e:  # report and go on with the next system
                failed += 1
                row.update(error=f"{type(e).__name__}: {e}", status="failed")
                print(f"[{cfg_name}] {name}: FAILED {row['error']}", flush=True)
            free_cuda()
            res.save()
    by = {(r["config"], r["system"]): r.get("useful_tok_s") for r in res.data["runs"]}
    res.data["speedup_vs_generate"] = {
        f"{c}/{s}": v / by[(c, "generate")] for (c, s), v in by.items() if v and by.get((c, "generate"))
    }
    res.data["speedup_vs_generate_batch"] = {
        f"{c}/orcaserve": by[(c, "orcaserve")] / gb
        for (c, s), gb in by.items()
        if s == "generate_batch" and gb and by.get((c, "orcaserve"))
    }
    res.save()
    for k, v in res.data["speedup_vs_generate"].items():
        print(f"{k}: {v:.2f}x padded generate")
    return {**res.data, "exit_code": 1 if failed else 0}
