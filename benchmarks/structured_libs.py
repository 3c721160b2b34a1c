"""xgrammar against llguidance for orcaserve's structured outputs (issue 44): what each costs here.

For the SmolLM2 tokenizer (49152 tokens) and a few realistic JSON schemas (plus OpenAI's
json_object), per library:
- set-up: the tokenizer's preparation, once per engine;
- compile: a schema's first compilation (cold, no cache), the cost admission pays per new schema;
- mask: filling one row's token bitmask, per token of a valid answer walked token by token (the
  matcher advancing with each token), the cost the engine thread pays per constrained row per step;
- apply: the bitmask applied to [32, 49152] fp32 logits with 16 rows constrained.

    .venv/bin/python benchmarks/structured_libs.py [--repeats 3]

Results in docs/serving.md, 'Structured outputs and tool calls'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SCHEMAS: dict[str, dict | None] = {
    "json_object": None,  # any JSON object
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "weather_tool": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["location", "unit"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
                "minItems": 1,
            },
            "shipping": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/address"}]},
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["id", "items", "shipping", "status"],
        "additionalProperties": False,
        "$defs": {
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            }
        },
    },
}

ANSWERS = {
    "json_object": {"answer": "yes", "score": 0.75, "nested": {"a": [1, 2, 3]}},
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]},
    "weather_tool": {"location": "Paris, France", "unit": "celsius", "days": 3},
    "order": {
        "id": "ABC-1234",
        "items": [{"sku": "X1", "qty": 2, "price": 9.5}, {"sku": "Y22", "qty": 1, "price": 120.0}],
        "shipping": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
        "status": "paid",
    },
}


def tokenizer():
    from transformers import AutoTokenizer

    from orcaserve.scheduler import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def bench_xgrammar(tok, vocab: int, answers: dict[str, list[int]]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    setup = time.perf_counter() - t0
    out: dict = {"setup_s": setup, "schemas": {}}
    for name, schema in SCHEMAS.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = (
            compiler.compile_builtin_json_grammar()
            if schema is None
            else compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        )
        compile_s = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(cg)
        bitmask = xgr.allocate_token_bitmask(1, vocab)  # [1, ceil(V/32)] int32
        times = []
        for token in answers[name]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(token), (name, token)
        out["schemas"][name] = {"compile_s": compile_s, "mask_us": 1e6 * statistics.mean(times), "tokens": len(times)}
    logits = torch.randn(32, vocab)
    mask = xgr.allocate_token_bitmask(32, vocab)
    rows = list(range(0, 32, 2))
    out["apply_us"] = _time_us(lambda: xgr.apply_token_bitmask_inplace(logits, mask, indices=rows))
    return out


def bench_llguidance(tok, vocab: int, answers: dict[str, list[int]]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    out: dict = {"setup_s": setup, "schemas": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False},
        )
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llt.allocate_token_bitmask(1, vocab)
        llt.fill_next_token_bitmask(matcher, bitmask, 0)  # llguidance builds its lexer lazily: count the first mask
        compile_s = time.perf_counter() - t0
        times = []
        for i, token in enumerate(answers[name]):
            if i:
                t0 = time.perf_counter()
                llt.fill_next_token_bitmask(matcher, bitmask, 0)
                times.append(time.perf_counter() - t0)
            assert matcher.consume_token(token), (name, token, matcher.get_error())
        out["schemas"][name] = {"compile_s": compile_s, "mask_us": 1e6 * statistics.mean(times), "tokens": len(times)}
    logits = torch.randn(32, vocab)
    mask = llt.allocate_token_bitmask(32, vocab)
    out["apply_us"] = _time_us(lambda: llt.apply_token_bitmask_inplace(logits, mask))
    return out


def _time_us(fn, n: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = tokenizer()
    vocab = len(tok)
    answers = {name: tok.encode(json.dumps(ans, separators=(",", ":"))) for name, ans in ANSWERS.items()}
    # compact JSON for both: any_whitespace False / whitespace_flexible False
    for lib, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        runs = [fn(tok, vocab, answers) for _ in range(args.repeats)]
        print(f"{lib}: tokenizer set-up {min(r['setup_s'] for r in runs) * 1e3:.0f} ms (best of {args.repeats})")
        for name in SCHEMAS:
            comp = statistics.median(r["schemas"][name]["compile_s"] for r in runs) * 1e3
            mask = statistics.median(r["schemas"][name]["mask_us"] for r in runs)
            n = runs[0]["schemas"][name]["tokens"]
            print(f"  {name:13s} compile {comp:8.1f} ms   mask {mask:7.1f} us/token over {n} tokens")
        print(f"  apply mask to [32, {vocab}] fp32 (16 rows): {statistics.median(r['apply_us'] for r in runs):.0f} us")


if __name__ == "__main__":
    main()
