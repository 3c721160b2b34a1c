"""A real model through the engine against transformers, greedy, on text prompts as a user sends
them (the engine tokenizes; transformers gets `tokenizer(prompt)`), on the CPU.

    python benchmarks/real_model_exact.py --model /path/to/model.gguf [--dtype float32] [--tokens 32]

Prints per prompt whether the engine's tokens are transformers' and both answers' start; exits 1
if any differs in fp32. How Gemma 3 270M's wrong answers were found and checked fixed
(docs/serving.md "Supported architectures").
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The largest planet in the solar system is",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a .gguf file, an HF directory or a cached hub id")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()

    from orcaserve.scheduler import Engine, SamplingParams
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    dtype = getattr(torch, args.dtype)
    model, tok = load_model_and_tokenizer(args.model, dtype, torch.device("cpu"))
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
            expected.append(out[0, ids.shape[1] :].tolist())
    engine = Engine.from_model(copy.deepcopy(model), tok, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=False)
    outs = engine.generate(PROMPTS, [params] * len(PROMPTS))
    rows = []
    for prompt, want, got in zip(PROMPTS, expected, outs):
        # transformers stops at EOS too; compare up to the shorter, then lengths.
        same = got.output_token_ids == want[: len(got.output_token_ids)] and len(got.output_token_ids) <= len(want)
        rows.append({"prompt": prompt, "exact": same, "engine": got.text[:60], "transformers": tok.decode(want)[:60]})
        print(f"{'EXACT' if same else 'DIFF '} {prompt!r}\n  engine:       {got.text[:60]!r}")
        if not same:
            print(f"  transformers: {tok.decode(want)[:60]!r}")
    exact = sum(r["exact"] for r in rows)
    arch = type(engine.runner.model).__name__
    print(json.dumps({"model": args.model, "architecture": arch, "dtype": args.dtype, "exact": f"{exact}/{len(rows)}"}))
    return 0 if exact == len(rows) or args.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
