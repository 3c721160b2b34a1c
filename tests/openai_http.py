"""HTTP client helpers for the end-to-end suites: OpenAI-shaped calls against a TorchServe and a
strict reader of its Server-Sent Events."""

from __future__ import annotations

import json
import time

import requests

from orcaserve.bench.serve.harness import TorchServe
from orcaserve.scheduler import Engine, SamplingParams

# Greedy prompts of the end-to-end suites.
PROMPTS = [
    # Non-ASCII prompts stream multi-byte characters (tokens that end mid-character included).
    "The capital of France is",
    "Once upon a time",
    "日本の首都は",
    "The three primary colors are",
    "Water boils at",
    "My favourite food is",
    "Emoji weather report: ☀️",
    "The quick brown fox",
    "In 1492, Columbus",
    "Photosynthesis is",
    "The largest planet in the solar system",
    "To be or not to be,",
    "A haiku about autumn:",
    "SELECT * FROM",
    "The speed of light is",
    "Dear diary, today",
]

# The configuration the suites' exact answers and block counts are proven in, named: the dense path
# in fp32 (a GGUF left to the engine is served from its own blocks with int8 activations, whose
# answers depend on how requests are batched: docs/quantized-weights.md "Defaults"), where greedy
# answers over HTTP are the offline engine's token for token.
EXACT = {"dtype": "float32", "quantization": "none"}

# The server the read-only suites share (tests/e2e/conftest.py `shared_ts`): the default model as
# SHARED_MODEL with SHARED_ARGS, the offline engine's arguments too. A small KV cache (91 blocks of 16
# tokens) keeps memory low and makes block accounting visible. The frontend's frame limit is far
# below its default (6,553,500 bytes) so that an answer with log-probabilities outgrows it and goes
# out in frames of max_frame_bytes (test_torchserve_e2e).
SHARED_MODEL = "smollm2"
SHARED_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 32, "max_num_batched_tokens": 512, **EXACT}
MAX_RESPONSE_SIZE = 65536
SHARED_SERVING = {"default_timeout": 300, "max_frame_bytes": MAX_RESPONSE_SIZE // 2}

COMPLETIONS = "/1.0/v1/completions"
CHAT = "/1.0/v1/chat/completions"


def call(
    ts: TorchServe, model: str, path: str, body, stream: bool = False, headers=None, timeout: float = 300
) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    h = {"Content-Type": "application/json", **ts.auth(), **(headers or {})}
    return requests.post(ts.url(f"/predictions/{model}{path}"), data=data, headers=h, stream=stream, timeout=timeout)


def read_stream(resp, allow_error: bool = False) -> dict:
    """Parse an SSE response strictly (every line an event, one id, [DONE] last); returns text,
    finish_reason, usage, arrival times, and the in-band error if `allow_error`."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    text, finish, usage, times, ids, done, error = "", None, None, [], set(), False, None
    for line in resp.iter_lines(decode_unicode=False):
        if not line:
            continue
        line = line.decode("utf-8")  # raises on a split multi-byte character
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line[6:]
        times.append(time.time())
        if payload == "[DONE]":
            done = True
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            assert allow_error and error is None, chunk
            error = chunk["error"]
            continue
        assert error is None, "data after an error"
        ids.add(chunk["id"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice["finish_reason"] or finish
    assert done and len(ids) <= 1 and (ids or error), (done, ids)
    return {
        "text": text,
        "finish_reason": finish,
        "usage": usage,
        "times": times,
        "id": ids.pop() if ids else None,
        "error": error,
    }


def result(ts: TorchServe, model: str, kind: str, prompt: str, max_tokens: int, stream: bool, **extra) -> dict:
    """A greedy request's text, finish reason and usage, streamed or not."""
    if kind == "chat":
        path, body = CHAT, {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = COMPLETIONS, {"prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0, stream=stream, **extra)
    resp = call(ts, model, path, body, stream=stream)
    if stream:
        return read_stream(resp)
    assert resp.status_code == 200, resp.text
    obj = resp.json()
    choice = obj["choices"][0]
    assert obj["object"] == ("chat.completion" if kind == "chat" else "text_completion")
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return {"text": text, "finish_reason": choice["finish_reason"], "usage": obj["usage"]}


def render(engine: Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def expected(offline: Engine, items, max_tokens) -> list:
    """What the offline engine answers for (kind, prompt) items, greedy."""
    prompts = [render(offline, p) if kind == "chat" else p for kind, p in items]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    return offline.generate(prompts, params)


def metric(text: str, name: str, model: str) -> float:
    """The last value of a Prometheus series of `model` in a /metrics scrape."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'ModelName="{model}"' in line
    ]
    assert values, f"{name} not in /metrics"
    return values[-1]
