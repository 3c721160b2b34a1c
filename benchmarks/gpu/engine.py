"""The engine end to end on CUDA with the Triton backend (gpu_check.sh's engine steps; what each
measures and the exactness metric: docs/kernels.md "GPU check").

    orcaserve-bench gpu engine exact --out exact.json            # greedy vs transformers, tiny models
    orcaserve-bench gpu engine throughput --out tp.json [--systems orcaserve,generate,generate_batch]
    orcaserve-bench gpu engine real --out real.json              # the default model, if it can load
    ... --smoke                                                  # CPU, TRITON_INTERPRET=1, tiny sizes

throughput: a random model of SmolLM2-135M's shape (`--shape llama8b`: Llama-3.1-8B's layers with
SmolLM2's vocabulary) on the offline workload; `--configs` picks its concurrency: "gpu" (256
sequences, 4,096 batched tokens, generate batch 256) and/or "cpu" (offline's CPU defaults, 32 /
512 / 32). The JSON is rewritten after every case or system, so a step cut short keeps what it
measured. Exit status 0 when every case that ran passed (throughput: every system ran).
"""

from __future__ import annotations

import argparse
import time

from orcaserve.bench.gpu.common import (
    CONFIGS,
    SHAPES,
    SMOKE_SHAPE,
    ByteTokenizer,
    OnDevice,
    Results,
    device,
    free_cuda,
    shaped_model,
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from orcaserve.bench.serve.workload import add_offline_args

    ap.add_argument("what", choices=("exact", "throughput", "real"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; without CUDA on the CPU under TRITON_INTERPRET=1")
    add_offline_args(ap)
    ap.set_defaults(num_prompts=1024)
    ap.add_argument("--dtype", default="bf16", help="throughput: bf16 | fp16 | fp32")
    ap.add_argument("--systems", default="orcaserve,generate,generate_batch")
    ap.add_argument("--configs", default="gpu", help=f"throughput concurrency, comma list from {sorted(CONFIGS)}")
    ap.add_argument("--warmup-prompts", type=int, default=64)
    ap.add_argument("--shape", default="smollm2", choices=tuple(SHAPES), help="throughput: the model's shape")


def run(args: argparse.Namespace) -> dict:
    dev = device(f"engine {args.what}", args.smoke)
    if isinstance(dev, dict):
        return dev
    if args.smoke:
        args.num_prompts, args.min_prompt, args.max_prompt = min(args.num_prompts, 6), 4, 24
        args.min_out, args.max_out, args.warmup_prompts = 2, 5, 2
        args.configs = args.configs.split(",")[0]
    import torch

    torch.manual_seed(0)
    # gpu_exact imports orcaserve's Triton kernels: only now that TRITON_INTERPRET is set.
    from orcaserve.bench.gpu import exact as gpu_exact

    step = {"exact": gpu_exact.run_exact, "real": gpu_exact.run_real, "throughput": run_throughput}[args.what]
    return step(args, dev)


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

    from orcaserve.bench.engine import offline
    from orcaserve.bench.gpu.common import torch_dtype
    from orcaserve.bench.serve.workload import offline_workload_of, workload_sha256

    args.dtype = "fp32" if dev.type == "cpu" else args.dtype  # the interpreter computes bf16 wrongly
    model = shaped_model(dev, torch_dtype(args.dtype, dev), args.smoke, args.shape)
    work = offline_workload_of(args, model.config.vocab_size)
    keys = ("num_prompts", "seed", "min_prompt", "max_prompt", "min_out", "max_out", "dtype")
    res = Results(
        args.out, dev, step="throughput", model="smoke shape" if args.smoke else f"random-init, {args.shape} shape",
        model_config=SMOKE_SHAPE if args.smoke else SHAPES[args.shape],
        workload={k: getattr(args, k) for k in keys}, workload_sha256=workload_sha256(work),
        useful_tokens=sum(n for _, n in work), prompt_tokens=sum(len(p) for p, _ in work), runs=[],
    )  # fmt: skip
    runners = {"orcaserve": offline.run_orcaserve, "generate": offline.run_padded_generate,
               "generate_batch": offline.run_generate_batch}  # fmt: skip
    failed = 0
    for cfg_name in args.configs.split(","):
        seqs, tokens, batch = (4, 64, 4) if args.smoke else CONFIGS[cfg_name]
        ns = argparse.Namespace(**vars(args))
        ns.max_num_seqs, ns.max_num_batched_tokens, ns.batch = seqs, tokens, batch
        ns.max_model_len, ns.attention_backend = None, "triton"  # also under the CPU smoke run's interpreter
        for name in args.systems.split(","):
            if name == "generate_batch" and cfg_name != args.configs.split(",")[0]:
                continue  # its own scheduler sizes itself; one run is enough
            fn, target = runners[name], OnDevice(model) if name == "generate" else model
            row = {"system": name, "config": cfg_name, "max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                   "generate_batch_size": batch if name == "generate" else None, "status": "warm-up"}  # fmt: skip
            res.data["runs"].append(row)  # saved as it goes: a timeout leaves the row with its status
            res.save()
            print(f"[{cfg_name}] {name}: warm-up ...", flush=True)
            try:
                if name == "generate_batch":
                    row["startup_s"] = generate_batch_startup(model, ns)
                else:
                    fn(target, ByteTokenizer(), work[: args.warmup_prompts], ns)
                free_cuda()
                row["status"] = "running"
                res.save()
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.time()  # epoch seconds: gpu_check.sh reads SM busy (dmon) over this window
                r = fn(target, ByteTokenizer(), work, ns)
                r["window"], r["useful_tok_s"] = [t0, time.time()], r["useful_tokens"] / r["wall_s"]
                if dev.type == "cuda":
                    r["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(dev) / (1 << 30)
                if "startup_s" in row and r["wall_s"] > row["startup_s"]:
                    r["useful_tok_s_excl_startup"] = r["useful_tokens"] / (r["wall_s"] - row["startup_s"])
                row.update(r, status="done")
                print(f"[{cfg_name}] {name}: {r['useful_tok_s']:9.1f} useful tok/s, wall {r['wall_s']:7.2f} s")
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
