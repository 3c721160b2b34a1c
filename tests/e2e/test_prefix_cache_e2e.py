"""Prefix caching through a real TorchServe: tenants named by a gateway header share cached prompt
blocks among themselves and never with each other; `usage.prompt_tokens_details.cached_tokens`
and the answers are held to the offline engine fed the same requests in the same order."""

from __future__ import annotations

import time

import openai_http
import pytest
from openai_http import CHAT, COMPLETIONS, EXACT, read_stream

from orcaserve.bench.serve.harness import TorchServe, serving
from orcaserve.handler.openai.tenancy import derive_cache_salt
from orcaserve.scheduler import Engine, SamplingParams, default_model_path

pytestmark = pytest.mark.slow

MODEL = "smollm2-tenants"
HEADER = "X-Tenant-Id"
ENGINE_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 512, **EXACT}
SYSTEM = (
    "You are the help desk of the Orca Hotel. Check-in is from 3 pm, check-out until 11 am. Breakfast "
    "is served from 7 to 10 in the garden room. The pool opens at 8 and closes at 20. Pets are welcome "
    "for a fee of 15 euros per night. Parking costs 12 euros per day. Answer briefly and politely."
)
# (tenant, cache_salt, question, stream): the order matters, each sees the cache its predecessors left.
REQUESTS = [
    ("alpha", None, "When is breakfast?", False),
    ("alpha", None, "Can I bring my dog?", True),  # alpha's system prompt is cached now
    ("beta", None, "When is breakfast?", False),  # the same prompt, another tenant: nothing shared
    ("alpha", "private", "When is breakfast?", True),  # alpha subdivided by the body's cache_salt
    ("beta", None, "Is there a pool?", False),  # beta's own earlier request is shared
]


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    overrides = {**ENGINE_ARGS, "default_timeout": 300, "tenant_header": HEADER}
    with serving(tmp_path_factory.mktemp("torchserve-tenants"), MODEL, overrides) as server:
        yield server


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def offline_answers() -> list[tuple[str, int]]:
    """(text, cached prompt tokens) of REQUESTS run one after the other by the offline engine."""
    engine = Engine.from_pretrained(default_model_path(), **ENGINE_ARGS)
    got = []
    for i, (tenant, salt, question, _) in enumerate(REQUESTS):
        prompt = engine.tokenizer.apply_chat_template(messages(question), tokenize=False, add_generation_prompt=True)
        engine.add_request(
            f"r{i}",
            prompt,
            SamplingParams(temperature=0, max_tokens=12),
            cache_salt=derive_cache_salt(HEADER, {HEADER: tenant}, salt),
        )
        final = None
        while engine.has_unfinished():
            final = next((o for o in engine.step() if o.finished), final)
        got.append((final.text, final.num_cached_tokens))
    return got


def ask(ts: TorchServe, tenant: str | None, body: dict, stream: bool = False):
    headers = {HEADER: tenant} if tenant is not None else {}
    return openai_http.call(ts, MODEL, CHAT, {**body, "stream": stream}, stream=stream, headers=headers)


def test_tenants_share_within_and_never_across(ts):
    want = offline_answers()
    for (tenant, salt, question, stream), (text, cached) in zip(REQUESTS, want):
        body = {"messages": messages(question), "max_tokens": 12, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        if stream:
            body["stream_options"] = {"include_usage": True}
        resp = ask(ts, tenant, body, stream)
        if stream:
            got = read_stream(resp)
            got_text, usage = got["text"], got["usage"]
        else:
            assert resp.status_code == 200, resp.text
            obj = resp.json()
            got_text, usage = obj["choices"][0]["message"]["content"], obj["usage"]
        assert got_text == text, (tenant, salt, question)
        assert usage["prompt_tokens_details"] == {"cached_tokens": cached}, (tenant, salt, question)
    hits = [cached for _, cached in want]
    # The shared system prompt spans several 16-token blocks: the second request of a tenant hits them,
    # the first of a tenant (or of a salt) finds nothing.
    assert hits[0] == 0 and hits[1] >= 64 and hits[2] == 0 and hits[3] == 0 and hits[4] >= 64, hits

    deadline = time.time() + 20
    while True:  # metrics travel through the frontend's log parser
        m = ts.metrics()
        hit_total = openai_http.metric(m, "orca_prefix_cache_hits_total", MODEL)
        if hit_total == sum(hits):
            break
        assert time.time() < deadline, (hit_total, sum(hits))
        time.sleep(0.5)
    assert openai_http.metric(m, "orca_prefix_cache_queries_total", MODEL) > hit_total
    assert openai_http.metric(m, "orca_prefix_cache_free_blocks", MODEL) > 0


def test_a_request_without_the_tenant_header_is_refused(ts):
    body = {"prompt": "Hello", "max_tokens": 2}
    for headers in ({}, {HEADER: ""}):
        r = openai_http.call(ts, MODEL, COMPLETIONS, body, headers=headers)
        assert r.status_code == 400 and HEADER in r.json()["error"]["message"], r.text
    # A query parameter of the header's name is not a header.
    r = openai_http.call(ts, MODEL, COMPLETIONS + f"?{HEADER}=alpha", body)
    assert r.status_code == 400, r.text
    r = openai_http.call(ts, MODEL, COMPLETIONS, body, headers={HEADER: "alpha"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
