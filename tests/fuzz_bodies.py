"""Request bodies for the fuzz suites (hypothesis strategies), unit-level and live.

`completions`, `chats`, `anthropic_messages` (Anthropic's Messages) and `responses` (OpenAI's
Responses) are valid bodies with zero to two fields broken or added: wrong types,
huge, negative and non-finite numbers, unknown fields, empty and oversized prompts, token ids
outside the vocabulary, unpaired surrogates, control characters, deep nesting, huge `stop`
lists, odd chat roles and content parts. Valid values include extremes that still reach torch.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

NASTY = [
    "\ud800",
    "a\udfff b",
    "\x00",
    "\x1b[31mred",
    "\u202eevil",
    "🙂" * 5,
    "<|im_start|>system",
    "<|endoftext|>",
    " " * 40,
    "",
    "\r\n\t",
    "日本語",
    "\ufffd",
    "a" * 300,
]
text = st.one_of(
    st.sampled_from(NASTY),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec=None, categories=["Cs", "Cc", "Lo"]), max_size=10),
)
ints = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**63, 2**64, 49151, 49152]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-9, 1e308, -1.0, 2.5]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=3), max_leaves=12
)
nested = st.integers(1, 80).map(lambda n: json.loads("[" * n + "1" + "]" * n))
any_value = st.one_of(scalars, values, nested)


# Plausible values, extremes that are still valid among them: these reach the tokenizer and torch.
VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-9, 1e-4, 1e6])),
    "top_p": st.one_of(st.floats(1e-6, 1), st.just(1)),
    "top_k": st.one_of(st.integers(-1, 100), st.just(10**12)),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.integers(0, 2**64 - 1)),
    "repetition_penalty": st.one_of(st.floats(0.01, 5), st.sampled_from([1e-30, 1e30])),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "stop": st.one_of(st.sampled_from(NASTY[1:]).filter(bool), st.lists(text.filter(bool), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 2**40), max_size=5),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "priority": st.integers(-(2**70), 2**70),
    "timeout": st.floats(1e-3, 1e9),
    "user": text,
    "model": text,
    "n": st.just(1),
}
prompts = st.one_of(text, st.lists(st.integers(0, 49151), min_size=1, max_size=40))
roles = st.sampled_from(["system", "user", "assistant", "developer"])
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": roles,
            "content": st.one_of(
                text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
odd_parts = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image_url", "input_audio", "text", ""]), "image_url": values, "text": any_value}
    ),
    any_value,
)
odd_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["tool", "function", "", "USER", "bot", "system"]),
                "content": st.one_of(text, st.none(), ints, st.lists(odd_parts, max_size=3)),
            },
            optional={"name": text, "tool_calls": values},
        ),
        any_value,
    ),
    max_size=4,
)
# What replaces a field, or joins as a new one: anything at all.
BAD = st.one_of(
    any_value,
    odd_messages,
    st.sampled_from(["\ud800", float("nan"), float("inf"), -1, 2**64, 10**30, [], {}, "", None]),
)
NAMES = sorted(
    set(VALID)
    | {
        "prompt",
        "messages",
        "echo",
        "logprobs",
        "best_of",
        "suffix",
        "logit_bias",
        "stream_options",
        "max_completion_tokens",
        "response_format",
        "top_logprobs",
    }
)


def bodies(first: str, first_values, valid: dict = VALID, names: list[str] = NAMES) -> st.SearchStrategy:
    """A valid body with zero to two fields broken or added (known or unknown names)."""
    base = st.fixed_dictionaries({first: first_values}, optional=valid)
    broken = st.lists(st.tuples(st.one_of(st.sampled_from(names), st.text(min_size=1, max_size=10)), BAD), max_size=2)
    return st.builds(lambda b, changes: {**b, **dict(changes)}, base, broken)


completions = bodies("prompt", prompts)
chats = bodies("messages", messages)

# Anthropic's Messages: user / assistant turns of text, tool_use and tool_result blocks.
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text, "input": values}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text, "content": any_value}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document", ""]), "thinking": any_value}),
)
turns = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(text, st.lists(blocks, max_size=3))}
    ),
    min_size=1,
    max_size=3,
)
ANTHROPIC_VALID = {
    **{k: VALID[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stream", "model")},
    "system": text,
    "stop_sequences": st.lists(text.filter(bool), max_size=4),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])}),
}
ANTHROPIC_NAMES = sorted(set(ANTHROPIC_VALID) | {"messages", "tools", "tool_choice", "output_config", "metadata"})
anthropic_messages = bodies("messages", turns, ANTHROPIC_VALID, ANTHROPIC_NAMES)

# OpenAI's Responses: a string or message, function_call and function_call_output items.
items = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": roles, "content": text}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text, "arguments": text}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": any_value}),
    ),
    min_size=1,
    max_size=3,
)
RESPONSES_VALID = {
    **{k: VALID[k] for k in ("temperature", "top_p", "stream", "model")},
    "max_output_tokens": st.integers(1, 6),
    "instructions": text,
    "store": st.booleans(),
}
RESPONSES_NAMES = sorted(set(RESPONSES_VALID) | {"input", "text", "tools", "tool_choice", "previous_response_id"})
responses = bodies("input", st.one_of(text, items), RESPONSES_VALID, RESPONSES_NAMES)
