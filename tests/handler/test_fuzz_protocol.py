"""Property-based fuzzing of everything a request body can carry, at unit level.

Each generated body goes the way a real one does: JSON-encoded (as the client sends it), decoded
(`decode_body`, TorchServe's dict or raw bytes), parsed (`parse_request`; Anthropic's Messages and
OpenAI's Responses bodies by their protocol's `parse`, handler/protocols.py), admitted
(`Engine.add_request`) and run for two engine steps. The only acceptable outcomes are a 4xx
`ProtocolError`, a `ValueError` from admission (the loop answers it with 400), or a request that
runs without the engine failing it. Nothing else may escape, and no step may report an error.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from fuzz_bodies import anthropic_messages, chats, completions, responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orcaserve.handler.openai.body import decode_body
from orcaserve.handler.openai.protocol import CHAT, COMPLETIONS, ProtocolError, parse_request
from orcaserve.handler.protocols import MESSAGES, RESPONSES, Endpoint
from orcaserve.scheduler import Engine

pytestmark = pytest.mark.slow  # thousands of generated bodies through parse_request and the engine

EXAMPLES = 1500  # per test; each runs two engine steps


@pytest.fixture(scope="module")
def engine(tokenizer):
    from orcaserve.bench.models.tiny import stub_model

    torch.manual_seed(0)
    model = stub_model(len(tokenizer))
    return Engine.from_model(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory=8 << 20)


_ids = itertools.count()


class Limits:
    default_timeout, default_max_tokens, max_tokens_limit = 300.0, None, 2048


def check(engine, tokenizer, kind: str | Endpoint, body: object, as_bytes: bool) -> None:
    try:
        raw = json.dumps(body).encode() if as_bytes else json.loads(json.dumps(body))
    except (ValueError, RecursionError):
        return  # not representable as JSON: a client cannot send it
    try:
        decoded = decode_body(raw)
        if isinstance(kind, Endpoint):
            req = kind.parse(decoded, "fuzz", Limits, None)
        else:
            req = parse_request(decoded, kind, 300.0, None, 2048)
    except ProtocolError as e:
        assert 400 <= e.status < 500 and e.message
        json.dumps(e.body())  # the answer itself must be sendable
        return
    rid = f"fuzz-{next(_ids)}"
    try:
        engine.add_request(dataclasses.replace(req.request, request_id=rid))
    except ValueError:
        return
    try:
        for _ in range(2):
            for out in engine.step():
                assert out.error is None, out.error
    finally:
        engine.abort(rid)
    assert engine.kv.pool.num_used == 0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=completions, as_bytes=st.booleans())
def test_completions_bodies(engine, tokenizer, body, as_bytes):
    check(engine, tokenizer, COMPLETIONS, body, as_bytes)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=chats, as_bytes=st.booleans())
def test_chat_bodies(engine, tokenizer, body, as_bytes):
    check(engine, tokenizer, CHAT, body, as_bytes)


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=anthropic_messages, as_bytes=st.booleans())
def test_anthropic_messages_bodies(engine, tokenizer, body, as_bytes):
    check(engine, tokenizer, MESSAGES, body, as_bytes)


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=responses, as_bytes=st.booleans())
def test_responses_bodies(engine, tokenizer, body, as_bytes):
    check(engine, tokenizer, RESPONSES, body, as_bytes)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_raw_bytes_bodies(raw):
    try:
        decode_body(raw)
    except ProtocolError as e:
        assert e.status == 400
