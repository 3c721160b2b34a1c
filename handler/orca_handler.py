"""OrcaHandler: TorchServe async-mode handler serving OpenAI-shaped requests from one engine loop.

TorchServe (with `asyncCommunication: true`) calls `async def handle` once per request on its
asyncio thread while earlier requests still stream. The handler only parses, submits to the
`EngineLoop` (whose thread owns the engine) and relays outputs; it never blocks that asyncio loop.
Rules of the async backend this file follows (see docs/serving.md):
- nothing may escape `handle`: an exception fails every in-flight request of the worker, so
  per-request errors are answered with `context.set_response_status`;
- a job is released only by a frame carrying `ts_stream_next: false`, so every final frame sets it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import torch

from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.engine_loop import EngineLoop, RequestError
from orcaserve.scheduler.outputs import RequestOutput

from . import socket_lock
from .config import HandlerConfig
from .metrics import EngineMetrics
from .protocol import (CHAT, HTTP_PHRASES, SSE_DONE, ParsedRequest, ProtocolError, decode_body, error_body,
                       final_response, parse_request, route, sse, stream_chunk)

log = logging.getLogger(__name__)



class OrcaHandler:
    """TorchServe handler: `initialize(context)` once per worker, `await handle(data, context)`
    once per request, `shutdown()` to stop the engine loop and free the model."""

    def __init__(self) -> None:
        self.initialized = False
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.config: HandlerConfig | None = None
        self.metrics: EngineMetrics | None = None
        self.model_name = "model"

    # ---- lifecycle ---------------------------------------------------------------------------
    def initialize(self, context: Any) -> None:
        """Build the engine from model-config.yaml's `handler:` section and start its loop."""
        props = getattr(context, "system_properties", {}) or {}
        yaml_config = getattr(context, "model_yaml_config", {}) or {}
        config = HandlerConfig.from_dict(yaml_config.get("handler") or {}, props.get("model_dir"))
        engine_args = config.engine_args(props.get("gpu_id"))
        name = config.served_model_name or getattr(context, "model_name", None) or "model"
        log.info("orcaserve: loading %s with %s", config.model_path, engine_args)

        def build() -> Engine:  # runs on the engine thread: all torch work stays on one thread
            if config.num_threads is not None:
                torch.set_num_threads(config.num_threads)
            return Engine.from_pretrained(config.model_path, **engine_args)

        self._serve_loop(lambda on_step: EngineLoop.launch(build, on_step), config,
                         getattr(context, "metrics", None), name)
        self._install_sigterm()
        log.info("orcaserve: %s ready (max_model_len=%d, %d KV blocks, %d torch threads)", self.model_name,
                 self.engine.max_model_len, self.engine.stats.num_blocks, torch.get_num_threads())

    def start(self, engine: Engine, config: HandlerConfig, metrics_cache: Any = None, model_name: str = "model") -> None:
        """Serve `engine` (already built): start the loop thread that owns it from now on."""
        self._serve_loop(lambda on_step: EngineLoop(engine, on_step).start(), config, metrics_cache, model_name)

    def _serve_loop(self, make_loop: Callable[[Callable], EngineLoop], config: HandlerConfig,
                    metrics_cache: Any, model_name: str) -> None:
        self.config, self.model_name = config, model_name
        self.metrics = EngineMetrics(metrics_cache, model_name)
        self.loop = make_loop(self.metrics.on_step)
        self.engine = self.loop.engine
        self.initialized = True

    def _install_sigterm(self) -> None:
        # The frontend stops a worker (unregister, scale down) by terminating its process; stop
        # the loop first so in-flight requests get a final answer instead of a dropped socket.
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, frame):  # noqa: ARG001
            self.shutdown(timeout=5.0)
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine loop (in-flight requests end with 503) and drop the model."""
        if self.loop is not None:
            self.loop.shutdown(timeout)
        self.loop = None
        self.engine = None
        self.initialized = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- requests ----------------------------------------------------------------------------
    async def handle(self, data: list, context: Any) -> list:
        """Serve one request (TorchServe async mode sends batches of one)."""
        socket_lock.install(getattr(context, "cl_socket", None))
        request_id = context.get_request_id(0) or f"req-{time.time_ns()}"
        reply = _Reply(context)
        try:
            body = await self._serve(data[0] if data else {}, reply, request_id)
        except ProtocolError as e:
            body = self._fail(reply, e.status, e.body())
        except RequestError as e:
            body = self._fail(reply, e.status, self._engine_error(e))
        except Exception as e:  # the worker must survive anything one request does
            log.exception("request %s failed", request_id)
            body = self._fail(reply, 500, error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error"))
        return [reply.finish(body)]

    async def _serve(self, item: dict, reply: "_Reply", request_id: str) -> str:
        context = reply.context
        if not self.initialized or self.loop is None or not self.loop.alive:
            raise RequestError(503, "the engine is not running")
        kind = route(context.get_request_header(0, "url_path"))
        raw = item.get("body") if item.get("body") is not None else item.get("data")
        if raw is None:
            raise ProtocolError("request body must be a JSON object (send Content-Type: application/json)")
        cfg = self.config
        req = parse_request(decode_body(raw), kind, self._render_chat, cfg.default_timeout, cfg.default_max_tokens)
        stream = self.loop.submit(request_id, req.prompt, req.params, req.priority, req.timeout,
                                  asyncio.get_running_loop())
        try:
            if req.stream:
                return await self._relay(stream, req, reply, request_id)
            final = None
            async for out in stream:
                final = out
            self._check_expired(final, req)
            self._finished(final)
            context.set_response_content_type(0, "application/json")
            return json.dumps(final_response(kind, request_id, self.model_name, final.text, final.finish_reason,
                                             final.prompt_tokens, final.completion_tokens))
        finally:
            if not stream.finished:  # we are leaving early (error): free the engine's blocks
                self.loop.abort(request_id)

    async def _relay(self, stream, req: ParsedRequest, reply: "_Reply", request_id: str) -> str:
        """Stream SSE chunks as tokens arrive; returns the last frame (ends with `[DONE]`)."""
        created, model, kind = int(time.time()), self.model_name, req.kind
        started = False
        try:
            async for out in stream:
                if not started:
                    # The HTTP status is fixed by the first frame: hold it until the request
                    # has produced a token, so validation errors and early expiry stay 4xx.
                    self._check_expired(out, req)
                    reply.context.set_response_content_type(0, "text/event-stream")
                pieces = []
                if not started and kind == CHAT:
                    pieces.append(sse(stream_chunk(kind, request_id, model, created, text="", role=True)))
                started = True
                if out.new_text:
                    pieces.append(sse(stream_chunk(kind, request_id, model, created, text=out.new_text)))
                if out.finished:
                    self._finished(out)
                    pieces.append(sse(stream_chunk(kind, request_id, model, created, text=None if kind == CHAT else "",
                                                   finish_reason=out.finish_reason)))
                    if req.include_usage:
                        usage = (out.prompt_tokens, out.completion_tokens)
                        pieces.append(sse(stream_chunk(kind, request_id, model, created, usage=usage)))
                    pieces.append(SSE_DONE)
                    return "".join(pieces)
                if pieces:
                    reply.send("".join(pieces))
        except RequestError as e:
            if not started:
                raise
            # Headers (200) are gone already: report in-band, as OpenAI does, and end the stream.
            return sse(self._engine_error(e)) + SSE_DONE
        raise RequestError(500, "the request stream ended without a final output")

    # ---- helpers -----------------------------------------------------------------------------
    def _render_chat(self, messages: list[dict]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _check_expired(self, out: RequestOutput | None, req: ParsedRequest) -> None:
        if out is None:
            raise RequestError(500, "the request ended without output")
        if out.finished and out.finish_reason == "abort" and out.completion_tokens == 0:
            self._finished(out)
            raise RequestError(408, f"request timed out after {req.timeout} s before its first token")

    def _finished(self, out: RequestOutput) -> None:
        try:
            self.metrics.on_finish(out, self.engine)
        except Exception:  # metrics must never fail a request
            log.exception("metrics emission failed")

    @staticmethod
    def _engine_error(e: RequestError) -> dict:
        if e.status == 400:
            return error_body(e.message, "prompt" if e.message.startswith("prompt") else None)
        if e.status == 408:
            return error_body(e.message, "timeout", "timeout_error")
        return error_body(e.message, None, "server_error")

    @staticmethod
    def _fail(reply: "_Reply", status: int, body: dict) -> str:
        if reply.started:  # mid-stream: the status line is gone, report in-band
            return sse(body) + SSE_DONE
        reply.context.set_response_status(status, HTTP_PHRASES.get(status, ""), 0)
        reply.context.set_response_content_type(0, "application/json")
        reply.send_complete(json.dumps(body))
        return ""


class _Reply:
    """The frames of one request's HTTP response.

    TorchServe's frontend (RestJob) writes the status line and headers with the first frame that
    carries `ts_stream_next: true`, and only a frame with `ts_stream_next: false` releases the job;
    a lone `false` frame would be written as a body chunk without any status line. So a 200
    response is at least one `true` frame followed by exactly one `false` frame. An error status
    cannot go that way (the frontend closes the connection right after an error status line, before
    the body chunk), so errors are one complete frame without the header, then the `false` frame
    that releases the job (its empty body lands on the closed connection and is dropped).
    """

    def __init__(self, context: Any) -> None:
        self.context = context
        self.started = False

    def send(self, text: str) -> None:
        """An intermediate frame (written now, from the asyncio thread)."""
        from ts.handler_utils.utils import send_intermediate_predict_response

        send_intermediate_predict_response([text], self.context.request_ids, "Intermediate Prediction success",
                                           200, self.context)
        self.started = True

    def send_complete(self, text: str) -> None:
        """A complete (non-chunked) response: status, headers and body in one frame."""
        from ts.protocol.otf_message_handler import create_predict_response

        frame = create_predict_response([text], self.context.request_ids, "Prediction error", 200, self.context)
        self.context.cl_socket.sendall(frame)
        self.started = True

    def finish(self, text: str) -> str:
        """The final frame's body; TorchServe sends it after `handle` returns."""
        if not self.started:
            self.send(text)
            text = ""
        self.context.set_response_header(0, "ts_stream_next", "false")
        return text
