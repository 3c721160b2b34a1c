"""GGUF -> HF checkpoint directory for vLLM (which does not read the project's Q4_1 GGUF).

    convert(["--out", DIR])   # default model; `orcaserve-bench peers` calls it for vLLM

Loads the GGUF with transformers (dequantized to fp32, the loader orcaserve uses), saves model and
tokenizer into `--out` as `LlamaForCausalLM`, then checks that both agree: the same greedy tokens
for "The capital of France is" (" Paris ...") and the same next-token argmax on random prompts.
A directory that already holds a verified conversion of the same GGUF is left as it is.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "model", "SmolLM2-135M-Instruct")
STAMP = "orcaserve-conversion.json"
PROMPT = "The capital of France is"


def _greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


def plain_copy(model):
    """The GGUF-loaded model is flagged as quantized (save_pretrained refuses it) although its
    weights are already dequantized: copy them into a plain model built from the same config."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    return plain.eval()


def verify(gguf_model, gguf_tok, out: str, new_tokens: int = 8) -> dict:
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    hf_model, hf_tok = load_model_and_tokenizer(out, torch.float32, torch.device("cpu"))
    a, b = _greedy(gguf_model, gguf_tok, PROMPT, new_tokens), _greedy(hf_model, hf_tok, PROMPT, new_tokens)
    text = hf_tok.decode(b)
    if a != b:
        raise SystemExit(
            f"convert: greedy tokens differ: GGUF {a} ({gguf_tok.decode(a)!r}) vs converted {b} ({text!r})"
        )
    if not text.startswith(" Paris"):
        raise SystemExit(f"convert: unexpected continuation {text!r} of {PROMPT!r}")
    if gguf_tok(PROMPT).input_ids != hf_tok(PROMPT).input_ids:
        raise SystemExit("convert: the tokenizers disagree")
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(100, gguf_model.config.vocab_size) for _ in range(64)] for _ in range(4)])
    with torch.inference_mode():
        la, lb = gguf_model(ids).logits, hf_model(ids).logits
    if not torch.equal(la.argmax(-1), lb.argmax(-1)):
        raise SystemExit("convert: next-token argmax differs on random prompts")
    return {
        "prompt": PROMPT,
        "greedy_tokens": b,
        "greedy_text": text,
        "max_abs_logit_diff": float((la - lb).abs().max()),
    }


def convert(argv: list[str]) -> int:
    """The conversion, `argv` as its flags (below)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the project's SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=DEFAULT_OUT, help="HF checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="convert again even if --out holds a verified copy")
    args = p.parse_args(argv)

    from orcaserve.scheduler import default_model_path
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    gguf = os.path.abspath(args.gguf or default_model_path())
    source = {"gguf": gguf, "size": os.path.getsize(gguf), "mtime": int(os.path.getmtime(gguf))}
    stamp = os.path.join(args.out, STAMP)
    if not args.force and os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f).get("source") == source:
                print(f"convert: {args.out} already holds a verified conversion of {gguf}")
                return 0

    print(f"convert: loading {gguf} (fp32)", file=sys.stderr)
    model, tokenizer = load_model_and_tokenizer(gguf, torch.float32, torch.device("cpu"))
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    plain = plain_copy(model)
    plain.save_pretrained(args.out, safe_serialization=True)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    cfg_path = os.path.join(args.out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        cfg["architectures"] = ["LlamaForCausalLM"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    check = verify(model, tokenizer, args.out)
    with open(stamp, "w") as f:
        json.dump({"source": source, "check": check}, f, indent=2)
    print(
        f"convert: wrote {args.out}; greedy {PROMPT!r} -> {check['greedy_text']!r} on both "
        f"(max |logit diff| {check['max_abs_logit_diff']:.2e})"
    )
    return 0
