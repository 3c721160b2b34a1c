"""OrcaHandler inside TorchServe's real backend code path, without the Java frontend.

Requests go through `ts.async_service.predict` (the coroutine TorchServe's async worker runs per
request) over a real socket pair; the test decodes the frames the frontend would read. The engine
wraps a tiny random model, so greedy outputs are checked against the engine run offline.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import struct
import threading
import time
import types

import pytest

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.handler.config import HandlerConfig
from orcaserve.handler.orca_handler import OrcaHandler
from orcaserve.scheduler import Engine, SamplingParams

ts_async = pytest.importorskip("ts.async_service")
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl  # noqa: E402
from ts.service import Service  # noqa: E402

ENGINE_ARGS = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "kv_cache_memory": 64 * 2 * 2 * 16 * 2 * 16 * 4,
    "dtype": "float32",
}


def _int(buf: memoryview, pos: int) -> tuple[int, int]:
    return struct.unpack_from("!i", buf, pos)[0], pos + 4


def _str(buf: memoryview, pos: int) -> tuple[bytes, int]:
    n, pos = _int(buf, pos)
    return bytes(buf[pos : pos + max(n, 0)]), pos + max(n, 0)


def parse_frames(data: bytes) -> list[dict]:
    """Decode predict-response frames into their predictions (one per request and frame; a
    streamed round's frame carries several), in arrival order."""
    frames, buf, pos = [], memoryview(data), 0
    while pos < len(data):
        _code, pos = _int(buf, pos)
        _msg, pos = _str(buf, pos)
        while True:
            n, _ = _int(buf, pos)
            if n == -1:
                pos += 4
                break
            rid, pos = _str(buf, pos)
            ctype, pos = _str(buf, pos)
            status, pos = _int(buf, pos)
            _phrase, pos = _str(buf, pos)
            nh, pos = _int(buf, pos)
            headers = {}
            for _ in range(nh):
                k, pos = _str(buf, pos)
                v, pos = _str(buf, pos)
                headers[k.decode()] = v.decode()
            body, pos = _str(buf, pos)
            prediction = {"id": rid.decode(), "type": ctype.decode(), "status": status, "headers": headers}
            frames.append({**prediction, "body": body})
    return frames


class Backend:
    """A handler behind TorchServe's async predict, writing frames to one socket like the worker."""

    def __init__(self, tokenizer, model=None, **config) -> None:
        model = tiny_model("llama") if model is None else model
        engine = Engine.from_model(copy.deepcopy(model), tokenizer, **ENGINE_ARGS)
        # Expectations come from an engine of their own: the served one belongs to the loop thread.
        self.reference = Engine.from_model(copy.deepcopy(model), tokenizer, **ENGINE_ARGS)
        self.engine = engine
        self.handler = OrcaHandler()
        self.handler.start(engine, HandlerConfig("unused", {}, **{"default_timeout": 60, **config}), None, "tiny")
        cache = MetricsCacheYamlImpl(
            config_file_path=ts_async.__file__.replace("async_service.py", "configs/metrics.yaml")
        )
        cache.initialize_cache()
        self.service = Service("tiny", "/tmp", None, self.handler.handle, None, 1, metrics_cache=cache)
        self.service.predict = types.MethodType(ts_async.predict, self.service)
        self.writer, self.reader = socket.socketpair()
        self.service.set_cl_socket(self.writer)
        self.received = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.reader.recv(65536):
            self.received.extend(chunk)

    async def request(self, rid: str, body, path: str = "v1/completions", headers: dict | None = None) -> None:
        value = body if isinstance(body, bytes) else body  # dict: as TorchServe decodes JSON bodies
        size = len(body) if isinstance(body, bytes) else len(json.dumps(body))
        given = {"url_path": path, "content-length": str(size), **(headers or {})}
        entries = [{"name": k.encode(), "value": v.encode()} for k, v in given.items()]
        batch = [
            {
                "requestId": rid.encode(),
                "headers": entries,
                "parameters": [{"name": "body", "contentType": "application/json", "value": value}],
            }
        ]
        final = await self.service.predict(batch)
        self.service.cl_socket.sendall(final)  # what AsyncService.send_responses does

    def frames(self) -> dict[str, list[dict]]:
        self.writer.shutdown(socket.SHUT_WR)
        self._reader.join(10)
        by_id: dict[str, list[dict]] = {}
        for f in parse_frames(bytes(self.received)):
            by_id.setdefault(f["id"], []).append(f)
        return by_id

    def close(self) -> None:
        self.handler.shutdown(5)
        self.writer.close()
        self.reader.close()


@pytest.fixture
def make_backend(tokenizer):
    import torch

    # One thread: spin-waiting OpenMP threads on a busy 2-core machine make steps 20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = []

    def make(**config) -> Backend:
        made.append(Backend(tokenizer, **config))
        return made[-1]

    try:
        yield make
    finally:
        for b in made:
            b.close()
        torch.set_num_threads(threads)


@pytest.fixture
def backend(make_backend):
    return make_backend()


def body_of(frames: list[dict]) -> bytes:
    return b"".join(f["body"] for f in frames)


def check_release(frames: list[dict]) -> None:
    """Exactly one final frame, last, marked ts_stream_next: false."""
    flags = [f["headers"].get("ts_stream_next") for f in frames]
    assert flags[-1] == "false" and flags.count("false") == 1, flags


def test_frames_statuses_and_errors(backend):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = backend.reference.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    # The handler sends what has piled up as one frame, by design: on a loaded machine 6 tiny-model
    # steps can outrun the event loop. To see that a token is relayed as it comes, each step
    # waits until the frame carrying the stream's previous token has reached the socket.
    real_step, sent = backend.engine.step, [0]

    def step():
        deadline = time.monotonic() + 10
        while backend.received.count(b"ok-sse") < sent[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        outputs = real_step()
        if any(o.request_id == "ok-sse" and o.new_text and not o.finished for o in outputs):
            sent[0] = backend.received.count(b"ok-sse") + 1
        return outputs

    backend.engine.step = step

    async def run():
        await asyncio.gather(
            backend.request("ok-json", {"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
            backend.request(
                "ok-sse", {"prompt": prompts[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
            ),
            backend.request("bad-field", {"prompt": [1], "bogus": 1}),
            backend.request("bad-json", b"{nope"),
            backend.request("too-long", {"prompt": [3] * 5000}),
            backend.request("no-path", {"prompt": [1]}, path="v1/embeddings"),
            backend.request("expired", {"prompt": [1, 2], "timeout": 1e-9}),
        )

    asyncio.run(run())
    frames = backend.frames()
    assert set(frames) == {"ok-json", "ok-sse", "bad-field", "bad-json", "too-long", "no-path", "expired"}
    for fs in frames.values():
        check_release(fs)

    ok = frames["ok-json"]
    assert (
        ok[0]["status"] == 200 and ok[0]["headers"]["ts_stream_next"] == "true" and ok[0]["type"] == "application/json"
    )
    obj = json.loads(body_of(ok))
    assert obj["choices"][0]["text"] == want[0].text and obj["usage"]["completion_tokens"] == 6

    sse = frames["ok-sse"]
    assert sse[0]["type"] == "text/event-stream" and len(sse) >= 3  # tokens relayed one by one
    events = [e for e in body_of(sse).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == want[1].text

    for rid, status, param in (
        ("bad-field", 400, "bogus"),
        ("bad-json", 400, None),
        ("too-long", 400, "prompt"),
        ("no-path", 404, None),
        ("expired", 408, "timeout"),
    ):
        first = frames[rid][0]
        # A complete response (no ts_stream_next): the frontend sends status and body together.
        assert first["status"] == status and "ts_stream_next" not in first["headers"], (rid, first)
        err = json.loads(first["body"])["error"]
        assert err["param"] == param and err["message"], rid
        assert frames[rid][-1]["body"] == b""


def test_internal_failure_is_a_500_for_that_request_only(backend):
    real_submit = backend.handler.engine_loop.submit

    def submit(request, *args, **kwargs):
        if request.request_id == "broken":
            raise RuntimeError("injected failure")
        return real_submit(request, *args, **kwargs)

    backend.handler.engine_loop.submit = submit

    async def run():
        await asyncio.gather(
            backend.request("fine", {"prompt": [4, 5, 6], "max_tokens": 8, "temperature": 0, "stream": True}),
            backend.request("broken", {"prompt": [4, 5, 6]}),
        )
        await backend.request("after", {"prompt": [4, 5, 6], "max_tokens": 3})

    asyncio.run(run())
    frames = backend.frames()
    assert frames["broken"][0]["status"] == 500
    assert json.loads(frames["broken"][0]["body"])["error"]["type"] == "server_error"
    assert body_of(frames["fine"]).endswith(b"data: [DONE]\n\n") and frames["fine"][0]["status"] == 200
    assert frames["after"][0]["status"] == 200
    for fs in frames.values():
        check_release(fs)


def test_shutdown_stops_the_loop_thread(backend):
    loop = backend.handler.engine_loop
    assert loop.alive
    backend.handler.shutdown(5)
    assert not loop.alive and backend.handler.engine_loop is None

    async def run():
        await backend.request("late", {"prompt": [1, 2]})

    asyncio.run(run())
    late = backend.frames()["late"]
    assert late[0]["status"] == 503


def test_limits_and_unusable_values_are_4xx(make_backend):
    backend = make_backend(max_body_bytes=2000, max_tokens_limit=50)
    admission = backend.handler.engine_loop._admission  # tokenizes for the handler, beside the engine
    assert admission._tokenizer is not backend.engine.tokenizer  # never shared across threads

    async def run():
        await asyncio.gather(
            backend.request("huge", {"prompt": "x" * 3000}),
            backend.request("surrogate", {"prompt": "\ud800"}),
            backend.request(
                "surrogate-chat", {"messages": [{"role": "user", "content": "a\udfff"}]}, path="v1/chat/completions"
            ),
            backend.request("deep", b"[" * 900 + b"]" * 900),
            backend.request("deep-field", {"prompt": "hi", "stop": json.loads("[" * 40 + '"x"' + "]" * 40)}),
            backend.request("seed", {"prompt": "hi", "seed": 2**64}),
            backend.request("neg-seed", {"prompt": "hi", "seed": -1}),
            backend.request("too-many", {"prompt": "hi", "max_tokens": 51}),
            backend.request("nan", b'{"prompt": "hi", "temperature": NaN}'),
            backend.request("ok", {"prompt": [5, 6], "max_tokens": 2}),
        )

    asyncio.run(run())
    frames = backend.frames()
    for rid, status, param in (
        ("huge", 413, None),
        ("surrogate", 400, "prompt"),
        ("surrogate-chat", 400, "messages"),
        ("deep", 400, None),
        ("deep-field", 400, "stop"),
        ("seed", 400, "seed"),
        ("neg-seed", 400, "seed"),
        ("too-many", 400, "max_tokens"),
        ("nan", 400, "temperature"),
    ):
        first = frames[rid][0]
        assert first["status"] == status, (rid, first)
        assert json.loads(first["body"])["error"]["param"] == param, (rid, first["body"])
        check_release(frames[rid])
    assert frames["ok"][0]["status"] == 200


def test_a_full_queue_answers_503_with_retry_after(make_backend):
    backend = make_backend(max_waiting_requests=1)
    gate = threading.Event()
    backend.engine.fault_hook = lambda sched: gate.wait(10)  # the engine stays in its first step

    async def run():
        # Nine sequences: the engine's eight seats and the one place to wait.
        first = asyncio.ensure_future(backend.request("first", {"prompt": [5, 6], "max_tokens": 2, "n": 9}))
        await asyncio.sleep(0.2)
        await backend.request("second", {"prompt": [5, 6], "max_tokens": 2})
        backend.engine.fault_hook = None
        gate.set()
        await first

    asyncio.run(run())
    frames = backend.frames()
    assert frames["first"][0]["status"] == 200
    second = frames["second"][0]
    assert second["status"] == 503 and second["headers"]["Retry-After"] == "1"
    assert "max_waiting_requests" in json.loads(second["body"])["error"]["message"]


def test_a_body_longer_than_a_frame_goes_out_in_frames(make_backend):
    """TorchServe's frontend drops the worker's connection on a frame above its max_response_size;
    answers longer than `max_frame_bytes` (here log-probabilities, 20 per token) are split."""
    limit = 4096
    backend = make_backend(max_frame_bytes=limit)
    prompt = [5, 6, 7, 8]
    want = backend.reference.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20)
    )[0]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 20}

    async def run():
        await asyncio.gather(backend.request("json", body), backend.request("sse", {**body, "stream": True}))

    asyncio.run(run())
    frames = backend.frames()
    for fs in frames.values():
        check_release(fs)
        assert all(len(f["body"]) <= limit for f in fs)
    assert len(body_of(frames["json"])) > 2 * limit  # three frames at least
    choice = json.loads(body_of(frames["json"]))["choices"][0]
    assert choice["text"] == want.text and len(choice["logprobs"]["tokens"]) == 24
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    events = [json.loads(e[6:]) for e in body_of(frames["sse"]).decode().split("\n\n") if e and e != "data: [DONE]"]
    assert [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]] == choice[
        "logprobs"
    ]["tokens"]


def test_the_tenant_header_names_whose_share_a_request_uses(make_backend):
    """The engine serves each request for the tenant its header names (fair share, per-tenant
    metrics), as named and matched case-insensitively like the cache salt."""
    backend = make_backend(tenant_header="X-Tenant-Id")

    async def run():
        await asyncio.gather(
            backend.request("a", {"prompt": [5, 6], "max_tokens": 3}, headers={"X-Tenant-Id": "acme"}),
            backend.request("b", {"prompt": [7, 8], "max_tokens": 2}, headers={"x-tenant-id": "beta"}),
            backend.request("none", {"prompt": [7, 8], "max_tokens": 2}),
        )

    asyncio.run(run())
    frames = backend.frames()
    assert frames["a"][0]["status"] == frames["b"][0]["status"] == 200
    assert frames["none"][0]["status"] == 400  # no tenant, no service: not pooled into a shared one
    tenants = backend.engine.scheduler.shares.tenants  # the loop thread is idle: every request answered
    assert set(tenants) == {"acme", "beta"}
    assert (tenants["acme"].output_tokens, tenants["beta"].output_tokens) == (3, 2)
