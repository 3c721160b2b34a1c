"""The engine end to end on CUDA with the Triton backend (gpu_check.sh's engine steps; what each
measures and the exactness metric: docs/kernels.md "GPU check").

    orcaserve-bench gpu engine exact --out exact.json            # greedy vs transformers, tiny models
    orcaserve-bench gpu engine throughput --out tp.json [--systems orcaserve,generate,generate_batch]
    orcaserve-bench gpu engine real --out real.json              # the default model, if it can load
    ... --smoke                                                  # CPU, TRITON_INTERPRET=1, tiny sizes

`--configs` picks throughput's concurrency: "gpu" (256 sequences, 4,096 batched tokens, generate
batch 256) and/or "cpu" (offline.py's CPU defaults, 32 / 512 / 32). The JSON is rewritten after
every case or system, so a step cut short keeps what it measured. Exit status 0 when every case
that ran passed (throughput: every system ran).
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
        from orcaserve.bench.gpu_exact import run_real as step
    return step(args, dev)
