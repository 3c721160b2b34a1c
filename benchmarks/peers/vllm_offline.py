"""vLLM's offline throughput on `orcaserve-bench offline`'s workload, run inside vLLM's own venv by
`orcaserve-bench peers` (orcaserve.bench alone on PYTHONPATH, the tuned environment). The prompts
come from the same `serve_workload.offline_workload` (`workload_sha256` in the JSON proves it);
all submitted at once after one small warm-up generate, greedy, EOS ignored; useful tokens = the
sum of the requested output lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from orcaserve.bench.serve.workload import add_offline_args, offline_workload_of, workload_sha256

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPES.update({v: v for v in DTYPES.values()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (benchmarks/peers/convert_model.py)")
    ap.add_argument("--dtype", required=True, choices=sorted(DTYPES))
    add_offline_args(ap)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    work = offline_workload_of(args, vocab)

    t = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=DTYPES[args.dtype],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=0,
    )
    startup = time.perf_counter() - t
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    got = [len(o.outputs[0].token_ids) for o in outs]
    want = [n for _, n in work]
    if got != want:
        print(f"vllm_offline: output lengths differ from the requested ones: {got[:8]} vs {want[:8]}", file=sys.stderr)
        return 1
    useful = sum(want)
    result = {
        "system": "vllm",
        "dtype": DTYPES[args.dtype],
        "wall_s": wall,
        "useful_tokens": useful,
        "useful_tok_s": useful / wall,
        "startup_s": startup,
        "workload": vars(args),
        "workload_sha256": workload_sha256(work),
        "versions": {
            "vllm": vllm.__version__,
            "torch": __import__("torch").__version__,
            "transformers": __import__("transformers").__version__,
            "python": platform.python_version(),
        },
        "env": {k: os.environ.get(k) for k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"vllm {DTYPES[args.dtype]}: {result['useful_tok_s']:.1f} useful tok/s, wall {wall:.1f} s "
        f"(start-up {startup:.0f} s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    raise SystemExit(main())
