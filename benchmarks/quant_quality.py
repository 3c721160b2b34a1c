"""Quality of the quantized weight formats against fp32 (docs/serving.md "Quantized weights").

    python benchmarks/quant_quality.py [--tokens 64] [--json benchmarks/results/quant_quality.json]

32 fixed prompts (bf16_quality.py's first 16 chat questions and 16 completions) are continued
greedily for `--tokens` tokens in fp32; then every variant reads the same prompt + continuation
(teacher forcing) and at each continuation position its next-token distribution is compared with
fp32's: top-1 agreement (same argmax) and the mean KL(p_fp32 || p_variant) per token, in nats.

The reference is the default model's GGUF dequantized to fp32: SmolLM2-135M-Instruct ships only as
Q4_1 here, so "fp32" means those dequantized weights, and quantization "gguf" (the file's own
blocks) is the reference itself (KL 0). int8/q4_0/q4_1 re-quantize those weights from fp32 as
quantization "int8"/"int4" would (quantize() of kernels/quant.py, llama.cpp's reference
quantizers) and run transformers' fp32 forward on dequantize(codes), which the engine reproduces
token for token (tests/test_quantized_engine.py); bf16 casts the model (weights and activations).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
from bf16_quality import COMPLETIONS, QUESTIONS

from orcaserve.kernels.quant import dequantize, quantize
from orcaserve.scheduler import default_model_path
from orcaserve.scheduler.model.loader import load_model_and_tokenizer
from orcaserve.scheduler.model.quantized import linears

# name -> (layers' format, lm_head's format); None = the weights as they are
VARIANTS: dict[str, tuple[str, str] | None] = {
    "int8 (q8_0)": ("q8_0", "q8_0"),
    "q4_0 (lm_head q8_0)": ("q4_0", "q8_0"),
    "q4_1 (lm_head q8_0) = int4": ("q4_1", "q8_0"),
    "q4_1 (lm_head q4_1)": ("q4_1", "q4_1"),
}


def fake_quantized(model, fmts: tuple[str, str]):
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in linears(out):
            if name == "lm_head" and module.weight is out.model.embed_tokens.weight:
                module.weight = torch.nn.Parameter(module.weight.clone(), requires_grad=False)  # untie
            module.weight.copy_(dequantize(quantize(module.weight, fmts[1] if name == "lm_head" else fmts[0])))
    return out


def log_probs(model, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per sequence: [n, V] fp32 log-probabilities of the positions that predict the continuation."""
    out = []
    with torch.inference_mode():
        for prompt, cont in seqs:
            ids = torch.tensor([prompt + cont])
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(cont) - 1].float()
            out.append(torch.log_softmax(logits, dim=-1))
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    agree = total = 0
    kl = 0.0
    for r, g in zip(ref, got):
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
        kl += float((r.exp() * (r - g)).sum())
    return {"top1_agreement": agree / total, "mean_kl_nats": kl / total, "positions": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default="benchmarks/results/quant_quality.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = load_model_and_tokenizer(default_model_path(), torch.float32, torch.device("cpu"))
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS[:16]
    ]
    prompts = [tok.encode(p, add_special_tokens=False) for p in chats + COMPLETIONS[:16]]
    seqs = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(
                torch.tensor([p]), max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False
            )
            seqs.append((p, gen[0, len(p) :].tolist()))
    ref = log_probs(model, seqs)
    rows: dict[str, dict] = {}
    for name, fmts in VARIANTS.items():
        rows[name] = compare(ref, log_probs(fake_quantized(model, fmts) if fmts else model, seqs))
    rows["bf16"] = compare(ref, log_probs(copy.deepcopy(model).to(torch.bfloat16), seqs))
    report = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf dequantized to fp32 (the reference)",
        "prompts": len(seqs),
        "tokens_per_prompt": args.tokens,
        "variants": rows,
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.perf_counter() - t0, 1),
        "command": "python benchmarks/quant_quality.py" + (f" --tokens {args.tokens}" if args.tokens != 64 else ""),
    }
    table = [f"{'variant':<30}{'top-1 agree':>12}{'mean KL':>12}"]
    table += [f"{n:<30}{r['top1_agreement']:>12.4f}{r['mean_kl_nats']:>12.5f}" for n, r in rows.items()]
    print("\n".join(table))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
