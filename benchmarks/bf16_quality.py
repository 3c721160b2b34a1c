"""How far bf16 greedy answers stray from fp32 ones on the default model (docs/engine.md).

    python benchmarks/bf16_quality.py [--max-tokens 64] [--json benchmarks/results/bf16_quality.json]

A fixed set of 48 prompts (24 chat questions, 24 completions) is answered greedily by the engine
in fp32 and in bf16. Reported: the share of answers identical token for token, the mean position
of the first differing token over the answers that differ, and how many answers agree on their
first 16 tokens. bf16 keeps 8 bits of mantissa, so near-ties between the top two logits flip.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from orcaserve.scheduler import Engine, SamplingParams, default_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What does a bee make?",
    "How many legs does a spider have?",
    "Write a haiku about rain.",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Translate 'thank you' into French.",
    "What is the largest ocean?",
    "Explain gravity in one sentence.",
    "List two fruits that are red.",
    "What is a prime number?",
    "How do you make tea?",
    "What is the speed of light?",
    "Name a famous painting.",
    "What is the opposite of cold?",
    "Describe a cat in five words.",
    "What language is spoken in Brazil?",
    "Give a tip for sleeping well.",
]
COMPLETIONS = [
    "The capital of France is",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
    "My favourite food is",
    "The quick brown fox",
    "In 1492, Columbus",
    "Photosynthesis is",
    "The largest planet in the solar system",
    "To be or not to be,",
    "A haiku about autumn:",
    "SELECT * FROM",
    "The speed of light is",
    "Dear diary, today",
    "def fibonacci(n):",
    "The best way to learn a language is",
    "Paris is known for",
    "import numpy as np\n",
    "The mitochondria is",
    "Roses are red,",
    "In the beginning",
    "The recipe calls for",
    "Breaking news:",
    "The theory of relativity",
]


def answers(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = default_model_path()
    results = {}
    prompts = None
    for dtype in ("float32", "bfloat16"):
        engine = Engine.from_pretrained(path, dtype=dtype, max_num_seqs=48, max_num_batched_tokens=1024)
        if prompts is None:
            prompts = [
                engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
                for q in QUESTIONS
            ]
            prompts += COMPLETIONS
        t = time.perf_counter()
        results[dtype] = answers(engine, prompts, args.max_tokens)
        print(f"{dtype}: {time.perf_counter() - t:.1f} s", flush=True)
        del engine
    firsts = []
    for a, b in zip(results["float32"], results["bfloat16"]):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    differing = [f for f in firsts if f is not None]
    report = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "identical_share": round(1 - len(differing) / len(firsts), 3),
        "mean_first_divergence": round(sum(differing) / len(differing), 1) if differing else None,
        "agree_first_16": sum(f is None or f >= 16 for f in firsts),
        "first_divergence": firsts,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "command": "python benchmarks/bf16_quality.py"
        + (f" --max-tokens {args.max_tokens}" if args.max_tokens != 64 else ""),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "first_divergence"}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
