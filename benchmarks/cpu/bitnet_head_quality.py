"""Quality of a BitNet GGUF's quantized lm_head against its F16 head (docs/bitnet.md, "A quantized
lm_head").

    orcaserve-bench bitnet-head-quality [--layers 0] [--head q6_k] [--prompts 8] [--tokens 16] [--llamacpp]

The files: the 2B4T-shape TQ2_0 file (benchmarks/models/bitnet_2b4t.py; its head tied to the F16
embedding, as llama.cpp's converter writes it) and the same file through llama.cpp's
`llama-quantize` (the tied head, and with it the embedding, in Q6_K: its default; or Q8_0). The
weights are random, so this measures the head's quantization error on a model whose logits are
those of random weights, not a trained model's quality. The F16-head file served by orcaserve in
bf16 (its default) continues `--prompts` of int8_quality.py's prompts greedily for `--tokens`
tokens; each variant then reads prompt + continuation (one teacher-forced forward each, the
engine's prompt path) and, at every continuation position, its logits are compared with the
reference's: top-1 agreement, mean KL(p_ref || p_variant) in nats, and the logit error (mean and
max |difference|, over the reference logits' standard deviation). Each variant is also taken
"alone": its head on the reference's own head inputs (the F16 model's final normed rows), the
head's error without the tied embedding's through 30 layers of random weights, where BitNet's
per-token int8 rounding of every projection's input makes small differences grow. Variants, all
served in bf16:
- the quantized-head file served dense (`quantization: none`: the head dequantized to bf16): the
  weights' error alone;
- the same file as served by default (`gguf`: the head from its blocks, int8 activations);
- with `--llamacpp`: llama.cpp's server on each file, its greedy token at the same positions, the
  quantized file's against the F16 file's (its server gives no whole distribution: no KL, no
  logits). llama.cpp's `bitnet` graph gates with SiLU where 2B4T uses ReLU^2: another model than
  orcaserve's, so only its two files are compared with each other.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from orcaserve.bench.cpu.int8_quality import PROMPTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=0, help="the 2B4T's first N layers; 0: all 30")
    parser.add_argument("--head", default="q6_k", help="the quantized file's head type: q6_k (default) or q8_0")
    parser.add_argument("--prompts", type=int, default=8, help="how many of int8_quality.py's prompts")
    parser.add_argument("--tokens", type=int, default=16, help="greedy continuation tokens a prompt")
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp's server on both files")


def _engine(path: str, **overrides: Any) -> Any:
    from orcaserve.scheduler import Engine

    print(f"bitnet-head-quality: loading {path} {overrides or ''}", flush=True)
    return Engine.from_pretrained(path, dtype="bfloat16", max_num_seqs=1, **overrides)


def position_logits(engine: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([len(ids) - 1, V] fp32 logits, [len(ids) - 1, hidden] the head's input rows) at every
    position of `ids` but the last, from the engine's prompt path (prompt_logprobs.py), read off
    the decoder's head."""
    from orcaserve.scheduler.model.prompt_logprobs import prompt_logprobs

    decoder, rows, lasts = engine.runner.decoder, [], []
    head = decoder._head

    def kept(last: torch.Tensor) -> torch.Tensor:
        lasts.append(last.clone())
        rows.append(head(last))
        return rows[-1]

    decoder._head = kept
    try:
        prompt_logprobs(engine.runner, ids, 0)
    finally:
        del decoder._head
    return torch.cat(rows).float(), torch.cat(lasts)


def _logits(engine: Any, seqs: list[tuple[list[int], list[int]]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's logits at its continuation positions, [tokens, V], and the head's inputs."""
    got = [position_logits(engine, p + c) for p, c in seqs]
    at = [slice(len(p) - 1, len(p) + len(c) - 1) for p, c in seqs]
    return [g[0][a] for g, a in zip(got, at)], [g[1][a] for g, a in zip(got, at)]


def _head_alone(engine: Any, lasts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`engine`'s head on the reference model's head inputs: the head's own error, without the
    quantized embedding's path through the layers."""
    with torch.inference_mode():
        return [engine.runner.decoder._head(x).float() for x in lasts]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    agree = total = 0
    kl = err = 0.0
    worst = 0.0
    for r, g in zip(ref, got):
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
        lr, lg = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
        kl += float((lr.exp() * (lr - lg)).sum())
        d = (g - r).abs() / r.std(-1, keepdim=True)  # in units of the reference logits' spread
        err += float(d.mean(-1).sum())
        worst = max(worst, float(d.max()))
    return {"top1_agreement": agree / total, "mean_kl_nats": kl / total, "mean_abs_err_sd": err / total,
            "max_abs_err_sd": worst, "positions": total}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    from orcaserve.bench.models.bitnet_2b4t import bitnet_2b4t_gguf

    t0 = time.perf_counter()
    layers = args.layers or None
    ref_path = bitnet_2b4t_gguf("TQ2_0", layers=layers)
    head_path = bitnet_2b4t_gguf("TQ2_0", layers=layers, head=args.head.upper())
    engine = _engine(ref_path)
    from orcaserve.scheduler import SamplingParams

    seqs = []
    for text in PROMPTS[: args.prompts]:
        p = engine.tokenizer(text).input_ids
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        seqs.append((p, engine.generate([p], [params])[0].output_token_ids))
    ref, lasts = _logits(engine, seqs)
    del engine
    rows: dict[str, dict[str, Any]] = {}
    for name, overrides in (
        (f"{args.head} head dequantized, dense bf16", {"quantization": "none"}),
        (f"{args.head} head from its blocks, int8 activations (default)", {}),
    ):
        gc.collect()
        engine = _engine(head_path, **overrides)
        rows[name] = compare(ref, _logits(engine, seqs)[0])
        rows[f"{name}, the head alone"] = compare(ref, _head_alone(engine, lasts))
        print(f"bitnet-head-quality: {name}: {rows[name]}; alone {rows[name + ', the head alone']}", flush=True)
        del engine
    if args.llamacpp:
        from orcaserve.bench.peers.llamacpp import greedy_next

        prefixes = [p + c[:i] for p, c in seqs for i in range(len(c))]
        want, got = greedy_next(ref_path, prefixes), greedy_next(head_path, prefixes)
        agree = sum(a == b for a, b in zip(want, got)) / len(want)
        rows[f"llama.cpp server, {args.head} file against F16 file"] = {"top1_agreement": agree, "positions": len(want)}
    print(f"\nBitNet 2B4T shape, {args.layers or 30} layers: {args.head} head against the F16 head, "
          f"{len(seqs)} prompts x {args.tokens} tokens")  # fmt: skip
    print(f"{'variant':<58}{'top-1':>8}{'KL nats':>10}{'mean err':>10}{'max err':>9}")
    for name, v in rows.items():
        cells = [f"{v[k]:.5f}" if k in v else "-" for k in ("mean_kl_nats", "mean_abs_err_sd", "max_abs_err_sd")]
        print(f"{name:<58}{v['top1_agreement']:>8.4f}{cells[0]:>10}{cells[1]:>10}{cells[2]:>9}")
    return {"layers": args.layers or 30, "head": args.head, "tokens": args.tokens, "prompts": len(seqs),
            "variants": rows, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
