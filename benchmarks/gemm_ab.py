"""End to end, fp32: the project's GEMM against MKL's packed sgemm, two engines in one process.

    python benchmarks/gemm_ab.py                       # 48 prompts, 4 rounds
    python benchmarks/gemm_ab.py --rounds 6 --num-prompts 128

`benchmarks/gemm.py --layers 30` times the GEMMs alone; this runs the offline workload of
`benchmarks/offline.py` (random token-id prompts, EOS ignored, greedy) through whole engines whose
fp32 layers run one GEMM or the other (`orcaserve.kernels.linear.takes` refusing the project's
GEMMs before the "mkl" engine is built), alternating which goes first each round so neither gets
the VM's slow phases alone. Prints output tok/s per run and the medians (docs/performance-log.md,
the Nineteenth and Twentieth rounds). The "mkl" variant is what the dispatch table falls back to
without the project's GEMM: MKL's packed sgemm on Intel CPUs, oneDNN's pre-packed inner product
on others (`kernels/dispatch.py`).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from offline import run_orcaserve
from serve_workload import add_offline_args, offline_workload_of

from orcaserve.kernels import linear
from orcaserve.scheduler import default_model_path
from orcaserve.scheduler.model.loader import load_model_and_tokenizer

VARIANTS = ("mkl", "orca")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_offline_args(ap)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.set_defaults(num_prompts=48)
    args = ap.parse_args()
    args.dtype = "fp32"

    model, tokenizer = load_model_and_tokenizer(default_model_path(), torch.float32, torch.device("cpu"))
    model.generation_config.eos_token_id = None
    work = offline_workload_of(args, model.config.vocab_size)
    tok_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    takes = linear.takes
    for rnd in range(args.rounds):
        for variant in VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]:
            if variant == "orca":
                linear.takes = takes
            else:
                linear.takes = lambda k, w: takes(k, w) and not k.startswith("orcaserve.")  # type: ignore[assignment]
            r = run_orcaserve(model, tokenizer, work, args)
            tok_s[variant].append(r["useful_tokens"] / r["wall_s"])
            print(f"round {rnd}: {variant} {tok_s[variant][-1]:.1f} tok/s", flush=True)
    for variant, runs in tok_s.items():
        print(f"{variant}: median {statistics.median(runs):.1f} tok/s ({', '.join(f'{x:.1f}' for x in runs)})")
    ratio = statistics.median(tok_s["orca"]) / statistics.median(tok_s["mkl"])
    print(f"orca / mkl: {ratio:.2f}x")


if __name__ == "__main__":
    main()
