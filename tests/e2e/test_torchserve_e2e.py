"""End to end: a real TorchServe, the model registered through the management API, HTTP clients.

On the suites' shared server (conftest.py: loading the model is the slow part); scaling and
unregistering act on a spare archive registered beside its model. Greedy outputs over HTTP are held
to the engine's offline `generate` with the same engine arguments.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai_http
import pytest
import requests
from openai_http import CHAT, MAX_RESPONSE_SIZE, PROMPTS, SHARED_ARGS, SHARED_MODEL, expected, read_stream

from orcaserve.bench.serve.harness import TorchServe
from orcaserve.scheduler import SamplingParams

pytestmark = pytest.mark.slow

# The shared server's (openai_http.SHARED_ARGS, EXACT: greedy answers over HTTP are held to the
# offline engine token for token; the default weights are served in test_deploy_e2e). SPARE: the
# same model under another name, for the tests that scale and unregister a worker.
MODEL, SPARE = SHARED_MODEL, "smollm2-spare"
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello."]


@pytest.fixture(scope="module")
def ts(shared_ts):
    return shared_ts


@pytest.fixture(scope="module")
def spare(registered_archive) -> str:
    return registered_archive(SPARE, "default", SHARED_ARGS)


def call(ts: TorchServe, path: str, body, stream: bool = False, headers=None, timeout: float = 300, model=MODEL):
    return openai_http.call(ts, model, path, body, stream, headers, timeout)


def result(ts: TorchServe, kind: str, prompt: str, max_tokens: int, stream: bool, model=MODEL, **extra) -> dict:
    return openai_http.result(ts, model, kind, prompt, max_tokens, stream, **extra)


def test_requests_without_token_are_refused(ts):
    r = requests.post(ts.url(f"/predictions/{MODEL}"), json={"prompt": "hi"}, timeout=30)
    assert r.status_code in (400, 401) and "Token" in r.text
    r = requests.post(
        ts.url(f"/predictions/{MODEL}"),
        json={"prompt": "hi"},
        timeout=30,
        headers={"Authorization": "Bearer not-the-key"},
    )
    assert r.status_code in (400, 401)
    r = requests.get(ts.url("/models", "management"), timeout=30)
    assert r.status_code in (400, 401)


def test_16_concurrent_mixed_requests_match_offline(ts, offline):
    items = [
        ("chat" if i % 4 == 3 else "completions", QUESTIONS[i // 4] if i % 4 == 3 else PROMPTS[i]) for i in range(16)
    ]
    max_tokens = [12 + (i % 5) * 4 for i in range(16)]
    want = expected(offline, items, max_tokens)

    def one(i):
        time.sleep(0.12 * i)  # staggered arrivals join the running batch between iterations
        kind, prompt = items[i]
        return result(ts, kind, prompt, max_tokens[i], stream=i % 2 == 0)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["text"] == w.text, (i, items[i], g["text"], w.text)
        assert g["finish_reason"] == w.finish_reason, i
        if g["usage"]:
            assert g["usage"]["completion_tokens"] == w.completion_tokens


def test_stream_chunks_arrive_before_the_end(ts):
    started = time.time()
    r = result(
        ts, "completions", "Once upon a time", 48, stream=True, ignore_eos=True, stream_options={"include_usage": True}
    )
    assert r["usage"]["completion_tokens"] == 48 and r["finish_reason"] == "length"
    first, last = r["times"][0], r["times"][-1]
    # Tokens are relayed as they are sampled: the first chunk long before the stream ends.
    assert last - first > 0.4 * (last - started), (first - started, last - started)
    assert len({round(t, 2) for t in r["times"]}) > 10


def test_32_concurrent_streams_never_interleave(ts, offline):
    prompts = PROMPTS[:8]
    want = expected(offline, [("completions", p) for p in prompts], [20] * 8)
    with ThreadPoolExecutor(32) as pool:
        got = list(
            pool.map(
                lambda i: result(
                    ts, "completions", prompts[i % 8], 20, stream=True, stream_options={"include_usage": True}
                ),
                range(32),
            )
        )
    assert len({g["id"] for g in got}) == 32
    for i, g in enumerate(got):
        assert g["text"] == want[i % 8].text, (i, g["text"])
        assert g["usage"]["completion_tokens"] == want[i % 8].completion_tokens


BAD = [
    ({"prompt": "hi", "max_token": 5}, "max_token"),
    ({"prompt": "hi", "temperature": "warm"}, "temperature"),
    ({"prompt": "hi", "top_p": 7}, "top_p"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hello " * 3000}, "prompt"),  # longer than max_model_len
    (b'{"prompt": "hi",', None),  # bad JSON
]


def test_bad_requests_between_running_streams(ts, offline):
    want = expected(offline, [("completions", p) for p in PROMPTS[:4]], [40] * 4)
    first_chunk = threading.Barrier(5, timeout=120)

    def stream(i):
        resp = call(
            ts,
            "/1.0/v1/completions",
            {"prompt": PROMPTS[i], "max_tokens": 40, "temperature": 0, "stream": True},
            stream=True,
        )
        lines = resp.iter_lines()
        head = next(line for line in lines if line)
        first_chunk.wait()

        class Rest:  # the already-read line followed by the rest of the stream
            status_code, headers = resp.status_code, resp.headers

            @staticmethod
            def iter_lines(decode_unicode=False):
                yield head
                yield from lines

        return read_stream(Rest)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        first_chunk.wait()  # every stream is running now
        for body, param in BAD:
            r = call(ts, "/1.0/v1/completions", body)
            assert r.status_code == 400, (param, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
        got = [f.result() for f in futures]
    for g, w in zip(got, want):
        assert g["text"] == w.text and g["finish_reason"] == w.finish_reason


def _metric(text: str, name: str) -> float:
    return openai_http.metric(text, name, MODEL)


def test_timeout_aborts_and_frees_blocks(ts):
    aborts = _metric(ts.metrics(), "orca_aborts_total")  # the shared server's count so far
    r = result(ts, "completions", "Count to a thousand:", 1000, stream=False, ignore_eos=True, timeout=1.5)
    # A deadline cuts the answer short as max_tokens does: OpenAI's "length" (docs/serving.md).
    assert r["finish_reason"] == "length" and 0 < r["usage"]["completion_tokens"] < 1000
    s = result(ts, "chat", "Tell me a long story.", 1000, stream=True, ignore_eos=True, timeout=1.5)
    assert s["finish_reason"] == "length"
    # Expired before its first token: 408.
    late = call(ts, "/1.0/v1/completions", {"prompt": "hi", "max_tokens": 5, "timeout": 1e-6})
    assert late.status_code == 408 and late.json()["error"]["type"] == "timeout_error"
    deadline = time.time() + 20
    while True:  # metrics travel through the frontend's log parser: allow a moment
        m = ts.metrics()
        if _metric(m, "orca_kv_blocks_used") == 0 and _metric(m, "orca_aborts_total") >= aborts + 3:
            break
        assert time.time() < deadline, m[-3000:]
        time.sleep(0.5)


def test_openai_client(ts, offline):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=ts.keys["inference"])
    want = expected(offline, [("completions", "The capital of France is"), ("chat", QUESTIONS[0])], [16, 24])

    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    assert c.choices[0].text == want[0].text and c.usage.completion_tokens == want[0].completion_tokens
    pieces = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == want[0].text

    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ch = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert ch.choices[0].message.content == want[1].text and "Paris" in want[1].text
    assert ch.choices[0].finish_reason == want[1].finish_reason
    pieces = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == want[1].text

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.status_code == 400


def test_logprobs_through_the_openai_client(ts, offline):
    """Completions' `logprobs: k` and chat's `logprobs` / `top_logprobs`, streamed and not: the
    offline engine's tokens and log-probabilities, in the shapes the client parses."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=ts.keys["inference"])
    prompt, chat = "The capital of France is", [{"role": "user", "content": QUESTIONS[0]}]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    want, want_chat = offline.generate([prompt, openai_http.render(offline, QUESTIONS[0])], params)
    text = [offline.tokenizer.decode([t]) for t in want.output_token_ids]
    values = [lp.logprob for lp in want.logprobs]

    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    got = c.choices[0].logprobs
    assert c.choices[0].text == want.text and got.tokens == text
    assert got.token_logprobs == pytest.approx(values, abs=1e-3)
    assert got.text_offset == [sum(len(t) for t in text[:i]) for i in range(len(text))]
    for top, lp in zip(got.top_logprobs, want.logprobs):
        assert {offline.tokenizer.decode([t]) for t, _ in lp.top} <= set(top) and len(top) in (3, 4)
    pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True)
    streamed = [p.choices[0].logprobs for p in pieces if p.choices and p.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == text
    assert [o for lp in streamed for o in lp.text_offset] == got.text_offset

    ch = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = ch.choices[0].logprobs.content
    assert ch.choices[0].message.content == want_chat.text
    assert [e.token for e in content] == [offline.tokenizer.decode([t]) for t in want_chat.output_token_ids]
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in want_chat.logprobs], abs=1e-3)
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    pieces = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=8, temperature=0, logprobs=True, stream=True
    )
    streamed = [e for p in pieces if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content] and all(e.top_logprobs == [] for e in streamed)

    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logit_bias_through_the_openai_client(ts, offline):
    """`logit_bias` with token ids as JSON keys: the offline engine's answer under the same bias
    (the greedy answer's first token banned); an id outside the vocabulary is a 400 naming it."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=ts.keys["inference"])
    prompt = "The capital of France is"
    first = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].output_token_ids[0]
    bias = {first: -100.0}
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))[0]
    assert want.output_token_ids[0] != first

    c = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(first): -100}
    )
    assert c.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logit_bias={str(offline.vocab_size): 1})
    assert e.value.status_code == 400 and e.value.body["param"] == "logit_bias"


def test_an_answer_longer_than_the_frontends_frame_limit_arrives_whole(ts, offline):
    """64 tokens with 20 alternatives each make a chat answer of about 100 KB, more than this
    server's max_response_size: the worker sends it in frames of max_frame_bytes. In one frame (the
    split turned off) TorchServe refused it and the request was never answered (300 s timeout);
    here it arrives whole, a stream beside it ends token-exact and the same worker serves on."""
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=20)
    want = offline.generate([openai_http.render(offline, QUESTIONS[0])], params)[0]
    beside = expected(offline, [("completions", PROMPTS[0])], [48])[0]
    pid = ts.worker_pids(MODEL)
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(result, ts, "completions", PROMPTS[0], 48, True)
        body = {"messages": chat, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        r = call(ts, CHAT, {**body, "logprobs": True, "top_logprobs": 20})
        assert r.status_code == 200 and len(r.content) > MAX_RESPONSE_SIZE, len(r.content)
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == [offline.tokenizer.decode([t]) for t in want.output_token_ids]
        assert all(len(e["top_logprobs"]) == 20 for e in content)
        assert stream.result()["text"] == beside.text
    assert result(ts, "completions", PROMPTS[1], 4, False)["finish_reason"] == "length"
    assert ts.worker_pids(MODEL) == pid


def test_metrics_are_scraped(ts):
    m = ts.metrics()
    for name in (
        "orca_time_to_first_token_seconds",
        "orca_time_per_output_token_seconds",
        "orca_queue_time_seconds",
        "orca_e2e_latency_seconds",
    ):
        assert _metric(m, name + "_count") > 10, name
    for name in (
        "orca_num_requests_running",
        "orca_num_requests_waiting",
        "orca_kv_blocks_used",
        "orca_kv_cache_usage_ratio",
        "orca_step_tokens",
        "orca_step_tokens_total",
        "orca_steps_total",
        "orca_preemptions_total",
        "orca_aborts_total",
        "orca_generation_tokens_total",
    ):
        _metric(m, name)
    assert _metric(m, "orca_step_tokens_total") > _metric(m, "orca_steps_total") > 10


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.3)
    return False


def test_scaling_replaces_the_worker(ts, spare):
    old = ts.worker_pids(spare)
    r = ts.scale(spare, 0)
    assert r.status_code == 200, r.text
    assert _gone(old[0], 60), "worker process survived scaling to zero"
    r = ts.scale(spare, 1)
    assert r.status_code == 200, r.text
    new = ts.worker_pids(spare)
    assert len(new) == 1 and new != old
    out = result(ts, "chat", QUESTIONS[0], 24, stream=False, model=spare)
    assert "Paris" in out["text"]


def test_unregister_stops_the_worker(ts, spare):
    pids = ts.worker_pids(spare)
    assert len(pids) == 1
    r = ts.unregister(spare)
    assert r.status_code == 200, r.text
    assert _gone(pids[0], 60), "worker process survived unregistration"
    r = call(ts, "", {"prompt": "hi"}, model=spare)
    assert r.status_code == 404
    assert result(ts, "completions", PROMPTS[1], 4, False)["finish_reason"] == "length"  # its neighbour serves on
