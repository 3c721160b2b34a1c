"""vLLM's CPU LoRA throughput on `orcaserve-bench lora`'s workload, run inside vLLM's own venv
(docs/peers.md, "vLLM recipe"; docs/lora.md, "What it costs"). The adapters are directories in
PEFT's format (`orcaserve-bench lora`'s `write_adapter`); the prompts are the same random token ids
(seeded as lora.py seeds them); all requests are submitted at once, `--clients` decoding together,
greedy, EOS ignored. Runs the base model and the mixed workload (request i on adapter i mod N)
alternated `--repeats` times on one engine, and prints both throughputs and their ratio.

    VLLM_CPU_KVCACHE_SPACE=2 LD_PRELOAD=... benchmarks/peers/.venv-vllm/bin/python \\
        benchmarks/peers/vllm_lora.py --model HF_DIR --adapters DIR/a0,DIR/a1,... --rank 16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (benchmarks/peers/convert_model.py)")
    ap.add_argument("--adapters", required=True, help="adapter directories, comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    paths = args.adapters.split(",")
    with open(f"{args.model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)  # as benchmarks/engine/lora.py draws its prompts
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(args.requests)]
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.clients,
        max_num_batched_tokens=512,
        max_model_len=1024,
        enable_lora=True,
        max_loras=len(paths),
        max_lora_rank=max(16, args.rank),
        seed=0,
    )
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], SamplingParams(max_tokens=2), lora_request=loras[:2], use_tqdm=False)  # warm-up

    def run(lora: list[LoRARequest] | None) -> float:
        t = time.perf_counter()
        outs = llm.generate(inputs, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    base: list[float] = []
    mixed: list[float] = []
    for _ in range(args.repeats):
        base.append(run(None))
        mixed.append(run([loras[i % len(loras)] for i in range(len(inputs))]))
    result = {
        "system": "vllm",
        "dtype": args.dtype,
        "adapters": len(paths),
        "rank": args.rank,
        "base_tok_s": statistics.median(base),
        "mixed_tok_s": statistics.median(mixed),
        "base_runs": base,
        "mixed_runs": mixed,
    }
    result["ratio"] = result["mixed_tok_s"] / result["base_tok_s"]
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    raise SystemExit(main())
