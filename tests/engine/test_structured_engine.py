"""Structured outputs in the engine: constrained rows follow their grammar, the others
are untouched, preemption keeps the matcher right, and a broken grammar fails its request alone."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.model.grammar import GrammarError
from orcaserve.scheduler.structured_outputs import StructuredOutputs

PROMPT = [1, 20, 30, 40, 50]


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema of bounded output: strings have a maxLength, arrays a maxItems."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null"] + (
        ["object", "array", "anyOf"] if depth < 2 else []
    )
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        return (
            {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 1000)}
            if rng.random() < 0.5
            else {"type": "integer"}
        )
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"uote', "ü"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if kind == "anyOf":
        return {"anyOf": [_schema(rng, depth + 1), _schema(rng, depth + 1)]}
    if kind == "object":
        props = {f"k{i}": _schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
        return {
            "type": "object",
            "properties": props,
            "required": rng.sample(sorted(props), rng.randint(0, len(props))),
            "additionalProperties": False,
        }
    return {"type": kind}


def _object_schema(rng: random.Random) -> dict:
    props = {f"field_{i}": _schema(rng, 1) for i in range(rng.randint(1, 5))}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def _partial_utf8(tokenizer) -> dict[int, float]:
    """A ban on the tiny vocabulary's tokens that are not whole UTF-8 characters (lone bytes
    >= 0x80). A random model strings them into malformed UTF-8, which xgrammar counts as
    characters against maxLength while the text shows one U+FFFD per byte (docs/serving.md,
    'Structured outputs and tool calls': limits); trained models do not write malformed UTF-8."""
    return {i: -100.0 for i in range(TINY_VOCAB) if "\ufffd" in tokenizer.decode([i])}


def test_fuzz_sampled_outputs_always_validate_against_their_schema(engine_for, tokenizer):
    """40 random schemas x 3 seeds at temperature 1 (top_k/top_p/min_p on some), in one batch."""
    engine = engine_for(tiny_model("llama"), max_num_seqs=32)
    ban = _partial_utf8(tokenizer)
    rng = random.Random(44)
    schemas = [_object_schema(rng) for _ in range(40)]
    params = []
    for i, schema in enumerate(schemas):
        for seed in range(3):
            extra = rng.choice([{}, {"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}])
            params.append(
                SamplingParams(
                    temperature=1.0,
                    seed=1000 * i + seed,
                    max_tokens=400,
                    structured_outputs=StructuredOutputs(json=schema),
                    logit_bias=ban,
                    **extra,
                )
            )
    outs = engine.generate([PROMPT] * len(params), params)
    texts = set()
    for k, out in enumerate(outs):
        schema = schemas[k // 3]
        assert out.finish_reason == "stop", (k, out.finish_reason, out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)  # raises with the path on a mismatch
        texts.add(out.text)
    assert len(texts) > len(params) // 2, "sampling was meant to give different outputs"


@pytest.mark.parametrize(
    "spec, check",
    [
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"), None),
        (StructuredOutputs(choice=["yes", "no", 'say "maybe"', "日本"]), None),
    ],
)
def test_other_constraints(engine_for, spec, check):
    import re

    engine = engine_for(tiny_model("qwen2"))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=spec) for s in range(6)]
    for out in engine.generate([PROMPT] * 6, params):
        if spec.json_object and out.finish_reason == "length":
            continue  # any object: a random model may nest past 300 tokens
        assert out.finish_reason == "stop", out.text
        if spec.regex:
            assert re.fullmatch(spec.regex, out.text), out.text
        elif spec.choice:
            assert out.text in spec.choice
        else:
            assert check(out.text)


def test_unconstrained_rows_are_token_identical_beside_constrained_ones(engine_for):
    """Greedy and seeded sampled requests, alone and in a batch where half the rows are
    constrained (and mask their logits), give the same tokens."""
    model = tiny_model("llama")
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in range(4)]
    plain += [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured_outputs=StructuredOutputs(json=schema))
        for s in range(8)
    ]
    prompts = [[1, 20 + i, 30, 40] for i in range(8)]
    alone = engine_for(model).generate(prompts, plain)
    mixed_params = [p for pair in zip(plain, constrained) for p in pair]  # interleaved rows
    mixed = engine_for(model).generate([p for p in prompts for _ in (0, 1)], mixed_params)
    assert [o.output_token_ids for o in mixed[::2]] == [o.output_token_ids for o in alone]


def test_preempted_constrained_requests_give_the_same_valid_output(engine_for, tokenizer):
    """A KV pool too small for the batch preempts (recomputes) requests mid-answer; the matcher
    keeps its state (the output tokens stay), so seeded outputs equal a run with room."""
    model = tiny_model("llama")
    rng = random.Random(7)
    schemas = [_object_schema(rng) for _ in range(12)]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=300,
            structured_outputs=StructuredOutputs(json=s),
            logit_bias=_partial_utf8(tokenizer),
        )
        for i, s in enumerate(schemas)
    ]
    prompts = [[1] + list(range(20, 20 + 40 + i)) for i in range(12)]
    roomy = engine_for(model, max_num_seqs=12).generate(prompts, params)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    tight = engine_for(model, max_num_seqs=12, block_size=16, kv_cache_memory=24 * block_bytes)
    outs = tight.generate(prompts, params)
    assert tight.stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in roomy]
    for out, schema in zip(outs, schemas):
        jsonschema.validate(json.loads(out.text), schema)


def test_a_grammar_failure_fails_its_request_alone(engine_for):
    """A row whose mask allows nothing samples a token its grammar refuses: that request ends
    with an error, its batch-mates and later requests are served."""
    engine = engine_for(tiny_model("llama"))
    spec = StructuredOutputs(json_object=True)
    engine.add_request("bad", PROMPT, SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec))
    engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    bad = engine.scheduler.requests["bad"]
    bad.grammar = engine.grammars.state(spec, bad.stop_token_ids)  # made here so it can be broken
    bad.grammar.fill = lambda bitmask, row: bitmask[row].zero_()  # type: ignore[method-assign,union-attr]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].finish_reason == "error" and "left its grammar" in final["bad"].error
    assert final["good"].finish_reason == "length" and len(final["good"].output_token_ids) == 20
    again = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=300, structured_outputs=spec))[0]
    assert again.finish_reason in ("stop", "length") and again.error is None


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json": {"type": "objectx"}}, ["JSON schema", "objectx"]),
        ({"json": '{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}'}, ["JSON schema", "nope"]),
        ({"regex": "[a-"}, ["regex", "Unclosed"]),
    ],
)
def test_an_invalid_constraint_is_refused_naming_the_problem(engine_for, spec, words):
    engine = engine_for(tiny_model("llama"))
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(**spec, param="response_format"))
    with pytest.raises(GrammarError) as e:
        engine.add_request("r", PROMPT, params)
    assert e.value.param == "response_format" and all(w in str(e.value) for w in words), str(e.value)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {}, "regex": "a"}, {"json": "not json"}, {"json": [1]}, {"choice": []}, {"choice": ["a", ""]}],
)
def test_malformed_specs_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        StructuredOutputs(**kwargs)


def test_log_probabilities_stay_the_models_beside_an_unconstrained_row(engine_for):
    """A constrained row's reported log-probabilities are the model's own (not renormalized over
    what the grammar allows), and an unconstrained row beside it reports the same as alone."""
    import torch

    model = tiny_model("qwen2")
    spec = StructuredOutputs(choice=["yes", "no way"])
    constrained = SamplingParams(temperature=0, max_tokens=8, logprobs=0, structured_outputs=spec)
    plain = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    out, beside = engine_for(model).generate([PROMPT, PROMPT], [constrained, plain])
    alone = engine_for(model).generate([PROMPT], plain)[0]
    assert out.text in spec.choice and out.finish_reason == "stop"
    ids = PROMPT + out.output_token_ids
    with torch.inference_mode():
        raw = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
    for k, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(raw[len(PROMPT) - 1 + k, lp.token_id].item(), abs=1e-4)
    assert beside.output_token_ids == alone.output_token_ids
    for got, want in zip(beside.logprobs, alone.logprobs):  # the batch may differ in the last bits
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
