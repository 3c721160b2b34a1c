"""OrcaHandler: TorchServe async-mode handler serving OpenAI-shaped requests from one engine loop.

TorchServe (with `asyncCommunication: true`) calls `async def handle` once per request on its
asyncio thread while earlier requests still stream. The handler only parses, submits to the
`EngineLoop` (whose thread owns the engine) and relays outputs; it never blocks that asyncio loop
and never touches the engine. Rules of the async backend this file follows (docs/serving.md):
- nothing may escape `handle`: an exception fails every in-flight request of the worker, so
  per-request errors are answered with `context.set_response_status`;
- a job is released only by a frame carrying `ts_stream_next: false`, so every final frame sets it;
- a worker that stops (SIGTERM, a dead engine loop) answers its requests before it exits; if it
  dies outright, its supervisor answers them and starts a replacement (`supervisor.py`).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from orcaserve.handler.config import HandlerConfig
from orcaserve.handler.edge import count_tokens, edge_for, relay
from orcaserve.handler.faults import FaultInjector
from orcaserve.handler.metrics import EngineMetrics
from orcaserve.handler.openai import reasoning_content
from orcaserve.handler.openai.body import check_size, decode_body
from orcaserve.handler.openai.choices import by_choice, usage
from orcaserve.handler.openai.errors import http_error
from orcaserve.handler.openai.logprobs import LogprobsRenderer
from orcaserve.handler.openai.protocol import (
    CHAT,
    COMPLETIONS,
    IGNORED_HEADER,
    MODELS,
    ParsedRequest,
    ProtocolError,
    error_body,
    parse_request,
    route,
)
from orcaserve.handler.openai.responses import (
    SSE_DONE,
    choice,
    engine_error_body,
    model_list,
    response_of,
    sse,
    stream_chunk,
    usage_of,
)
from orcaserve.handler.openai.tenancy import derive_cache_salt, header_value
from orcaserve.handler.openai.tools import shape_choice, stream_tail
from orcaserve.handler.reasoning import ReasoningStyle, reasoning_style
from orcaserve.handler.supervisor.link import SupervisorLink, start_supervisor
from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.reply import Reply
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.errors import EngineError, InternalError, ShuttingDown
from orcaserve.scheduler.model.logprobs import TokenLogprob
from orcaserve.scheduler.serving.engine_loop import EngineLoop
from orcaserve.scheduler.serving.request_stream import RequestStream

log = logging.getLogger(__name__)

# Seconds a stopping worker gives its requests to send their final frames.
_EXIT_GRACE_S = 5.0


class OrcaHandler:
    """TorchServe handler: `initialize(context)` once per worker, `await handle(data, context)`
    once per request, `shutdown()` to stop the engine loop and free the model."""

    def __init__(self) -> None:
        self.initialized = False
        self.engine_loop: EngineLoop | None = None
        self.config: HandlerConfig | None = None
        self.metrics: EngineMetrics | None = None
        self.model_name = "model"
        self._faults = FaultInjector()
        self._active = 0  # handle() calls in progress (asyncio thread)
        self._guard_worker = False  # a real TorchServe worker: exit on loop death, supervised
        self._link: SupervisorLink | None = None
        self._exiting = threading.Event()
        self._logprobs: LogprobsRenderer | None = None
        self._created = int(time.time())  # the model's `created` in `GET /v1/models`
        self._reasoning: ReasoningStyle | None = None  # the model's reasoning parser (reasoning.py)
        self._counter: Any = None  # a tokenizer for count_tokens (edge.py)

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
            engine = Engine.from_pretrained(config.model_path, **engine_args)
            if engine.config.tensor_parallel_size > 1:  # a rank gone: exit, TorchServe starts the worker again
                engine.runner.on_failure = self._on_loop_death
            if self._faults.enabled:
                engine.fault_hook = self._faults.hook
            log.info(
                "orcaserve: %s ready (max_model_len=%d, %d KV blocks, %d torch threads)",
                name,
                engine.max_model_len,
                engine.stats.num_blocks,
                torch.get_num_threads(),
            )
            return engine

        self._serve_loop(
            lambda on_step: EngineLoop.launch(build, on_step, config.max_waiting_requests, self._on_loop_death),
            config,
            getattr(context, "metrics", None),
            name,
        )
        self._guard_worker = True
        # A replacement worker's link is already on its socket (takeover.py); a worker TorchServe
        # started gets its supervisor now, while its socket is between messages.
        link = socket_lock.observer()
        self._link = link if isinstance(link, SupervisorLink) else start_supervisor(context, props)
        self._install_sigterm()

    def start(
        self, engine: Engine, config: HandlerConfig, metrics_cache: Any = None, model_name: str = "model"
    ) -> None:
        """Serve `engine` (already built): start the loop thread that owns it from now on."""
        self._serve_loop(
            lambda on_step: EngineLoop(engine, on_step, config.max_waiting_requests, self._on_loop_death).start(),
            config,
            metrics_cache,
            model_name,
        )

    def _serve_loop(
        self, make_loop: Callable[[Callable], EngineLoop], config: HandlerConfig, metrics_cache: Any, model_name: str
    ) -> None:
        self.config, self.model_name = config, model_name
        self.metrics = EngineMetrics(metrics_cache, model_name)
        self.engine_loop = make_loop(self.metrics.on_step)
        self.metrics.on_start(self.engine_loop.engine)
        tokenizer = copy.deepcopy(self.engine_loop.engine.tokenizer)
        self._logprobs = LogprobsRenderer(tokenizer)
        self._reasoning = reasoning_style(config.reasoning_parser, tokenizer)
        self._counter = copy.deepcopy(tokenizer)  # count_tokens', used off the asyncio thread
        self.initialized = True

    def _install_sigterm(self) -> None:
        # The frontend stops a worker (unregister, scale down) by terminating its process. The
        # signal arrives on the asyncio thread, which must keep running to send the final frames:
        # stop from another thread.
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, frame):  # noqa: ARG001
            if self._link is not None:
                self._link.stopping()  # stopped on purpose: the supervisor must not replace us
            threading.Thread(target=self.exit_process, args=(0, "SIGTERM"), daemon=True).start()

        signal.signal(signal.SIGTERM, on_term)

    def _on_loop_death(self, error: BaseException) -> None:
        # The loop has answered its requests already; a worker without an engine must not linger
        # answering 503: exit, and TorchServe starts a new worker.
        if self._guard_worker:  # from another thread: this one is the dying loop thread
            threading.Thread(
                target=self.exit_process, args=(1, f"engine loop died: {type(error).__name__}: {error}"), daemon=True
            ).start()

    def exit_process(self, code: int, reason: str) -> None:
        """Stop the loop (its requests end with 503), let their final frames go out, then exit."""
        if self._exiting.is_set():
            return
        self._exiting.set()
        log.warning("orcaserve: worker exiting (%s)", reason)
        if self.engine_loop is not None:
            self.engine_loop.shutdown(_EXIT_GRACE_S)
        deadline = time.monotonic() + _EXIT_GRACE_S
        while self._active and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # TorchServe's sender thread writes the final frames after handle() returns
        logging.shutdown()
        os._exit(code)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine loop (in-flight requests end with 503) and drop the model."""
        if self.engine_loop is not None:
            self.engine_loop.shutdown(timeout)
        self.engine_loop = None
        self.initialized = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- requests ----------------------------------------------------------------------------
    async def handle(self, data: list, context: Any) -> list:
        """Serve one request (TorchServe async mode sends batches of one)."""
        socket_lock.install(getattr(context, "cl_socket", None))
        request_id = context.get_request_id(0) or f"req-{time.time_ns()}"
        reply = Reply(context, (self.config or HandlerConfig).max_frame_bytes)
        edge = edge_for(context.get_request_header(0, "url_path"))  # errors in its protocol's shape
        shaped = edge.error if edge is not None else lambda status, body: body
        self._active += 1
        try:
            body = await self._serve(data[0] if data else {}, reply, request_id)
        except ProtocolError as e:
            body = reply.fail(e.status, shaped(e.status, e.body()))
        except EngineError as e:
            answer = http_error(e)
            body = reply.fail(answer.status, shaped(answer.status, answer.body), answer.retry_after)
        except Exception as e:  # the worker must survive anything one request does
            log.exception("request %s failed", request_id)
            failure = error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error")
            body = reply.fail(500, shaped(500, failure))
        finally:
            self._active -= 1
        return [reply.finish(body)]

    async def _serve(self, item: dict, reply: Reply, request_id: str) -> str:
        context = reply.context
        if not self.initialized or self.engine_loop is None or not self.engine_loop.alive:
            raise ShuttingDown("the engine is not running", retry_after=5)
        edge = edge_for(context.get_request_header(0, "url_path"))  # Anthropic's, Responses (edge.py)
        kind = CHAT if edge is not None else route(context.get_request_header(0, "url_path"))
        if kind == MODELS:  # whatever the method and body: the list is all there is to say
            context.set_response_content_type(0, "application/json")
            return json.dumps(model_list(self.model_name, self.engine_loop.engine.max_model_len, self._created))
        raw = item.get("body") if item.get("body") is not None else item.get("data")
        if raw is None:
            raise ProtocolError("request body must be a JSON object (send Content-Type: application/json)")
        cfg, metrics = self.config, self.metrics
        assert cfg is not None and metrics is not None  # set with `initialized`
        check_size(raw, context.get_request_header(0, "content-length"), cfg.max_body_bytes)
        body = decode_body(raw)
        body, edge_ignored = edge.to_chat(body) if edge is not None else (body, ())
        req = parse_request(body, kind, cfg.default_timeout, cfg.default_max_tokens, cfg.max_tokens_limit)
        req = reasoning_content.prepare(self._reasoning, req)
        if req.ignored or edge_ignored:
            context.set_response_header(0, IGNORED_HEADER, ",".join(sorted({*req.ignored, *edge_ignored})))
        if edge is not None and edge.counts_tokens:
            engine = self.engine_loop.engine
            return await count_tokens(self._counter, req, engine.vocab_size, engine.max_model_len)
        headers = context.get_all_request_header(0) or {}
        salt = derive_cache_salt(cfg.tenant_header, headers, req.cache_salt)  # refuses a missing tenant
        # Whose share the request uses (fair policy, per-tenant metrics): the tenant as named.
        tenant = header_value(headers, cfg.tenant_header) if cfg.tenant_header else None
        # Whose latency targets it gets (docs/latency-targets.md); an unknown class is the engine's 400.
        slo_class = header_value(headers, cfg.slo_class_header) if cfg.slo_class_header else None
        if slo_class is None and tenant is not None:
            slo_class = cfg.tenant_slo_class.get(tenant)
        self._faults.arm(request_id, body.get("user"))
        stream = self.engine_loop.submit(
            request_id,
            req.prompt,
            req.params,
            req.priority,
            req.timeout,
            asyncio.get_running_loop(),
            salt,
            tenant,
            slo_class,
        )
        try:
            if edge is not None:
                assert self._logprobs is not None
                answer = (edge, stream, req, reply, request_id, self.model_name, self._reasoning, self._logprobs.decode)
                return await relay(*answer, metrics.on_finish)
            if req.stream:
                return await self._relay(stream, req, reply, request_id, metrics)
            finals: dict[int, RequestOutput] = {}
            async for out in stream:
                if out.finished:
                    finals[out.index] = out
            if len(finals) != req.params.n:
                raise InternalError("the request ended without output")
            choices = []
            for i, final in sorted(finals.items()):
                metrics.on_finish(final)
                echo = self._echo(req)
                logprobs = self._render_logprobs(kind, final.logprobs, len(echo))[0]
                prompt_logprobs = self._echo_logprobs(final)
                if logprobs is not None and prompt_logprobs is not None:  # the prompt's, then the answer's
                    logprobs = {key: prompt_logprobs[key] + value for key, value in logprobs.items()}
                thinking, text = reasoning_content.split_text(self._reasoning, kind, final.text)
                shaped = shape_choice(choice(kind, i, echo + text, final.finish_reason, logprobs), req.tool_spec)
                choices.append(reasoning_content.with_reasoning(shaped, thinking))
            context.set_response_content_type(0, "application/json")
            return json.dumps(
                response_of(kind, request_id, self.model_name, choices, usage_of(*usage(finals.values())))
            )
        finally:
            self._faults.disarm(request_id)
            if not stream.finished:  # we are leaving early (error): free the engine's blocks
                self.engine_loop.abort(request_id)

    def _echo(self, req: ParsedRequest) -> str:
        """The prompt's text when the request asked for it back (`echo`), else ''."""
        if not req.echo:
            return ""
        if isinstance(req.prompt, str):
            return req.prompt
        assert self._logprobs is not None and isinstance(req.prompt, list)
        return self._logprobs.decode(req.prompt)

    def _echo_logprobs(self, out: RequestOutput) -> dict | None:
        """The completions `logprobs` of the echoed prompt, when the request asked for them."""
        if out.prompt_logprobs is None or out.prompt_token_ids is None or self._logprobs is None:
            return None
        return self._logprobs.echo(out.prompt_token_ids, out.prompt_logprobs)[0]

    async def _relay(
        self, stream: RequestStream, req: ParsedRequest, reply: Reply, request_id: str, metrics: EngineMetrics
    ) -> str:
        """Stream SSE chunks as tokens arrive; returns the last frame (ends with `[DONE]`).

        The HTTP status goes out with the first frame, so nothing is sent before the request has
        produced a token: a validation error or a deadline before it are still real 4xx answers."""
        created, model, kind = int(time.time()), self.model_name, req.kind
        started = False
        offsets: dict[int, int] = {}  # per choice: where its next token's text starts (`text_offset`)
        finals: list[RequestOutput] = []
        held: dict[int, str] = {}  # per choice: text held back to be parsed into tool calls (tools.py)
        thinking = reasoning_content.streamed(self._reasoning, req)  # the thinking apart (reasoning.py)
        try:
            async for outputs in stream.chunks():  # what has piled up goes out as one frame
                pieces = []
                if not started:
                    reply.context.set_response_content_type(0, "text/event-stream")
                    for i in range(req.params.n):  # every choice opens: chat's role, the echoed prompt
                        echo = self._echo(req)
                        offsets[i] = len(echo)
                        if kind == CHAT:
                            pieces.append(sse(stream_chunk(kind, request_id, model, created, "", role=True, index=i)))
                        elif echo:
                            logprobs = self._echo_logprobs(outputs[0])  # every choice's first output has them
                            chunk = stream_chunk(kind, request_id, model, created, echo, logprobs=logprobs, index=i)
                            pieces.append(sse(chunk))
                started = True
                for index, group in by_choice(outputs):
                    text = "".join(out.new_text for out in group)
                    new_logprobs = [lp for out in group for lp in out.new_logprobs or ()]
                    thought = ""
                    if thinking is not None:
                        thought, text = thinking.feed(index, text, group[-1].finished)
                    if req.tool_spec is not None and req.tool_spec.parses:  # parsed into tool calls at the end
                        held[index] = held.get(index, "") + text
                        text, new_logprobs = "", []
                    if text or new_logprobs or thought:  # a token's logprob goes out even while its text is held
                        logprobs, offsets[index] = self._render_logprobs(kind, new_logprobs or None, offsets[index])
                        chunk = stream_chunk(kind, request_id, model, created, text, logprobs=logprobs, index=index)
                        pieces.append(sse(reasoning_content.add_thinking(chunk, thought)))
                    last = group[-1]
                    if last.finished:
                        metrics.on_finish(last)
                        finals.append(last)
                        text_end = None if kind == CHAT else ""
                        chunk = stream_chunk(
                            kind, request_id, model, created, text_end, last.finish_reason, index=index
                        )
                        tail = [chunk] if index not in held else stream_tail(req.tool_spec, held.pop(index), chunk)
                        pieces += [sse(c) for c in tail]
                if len(finals) == req.params.n:
                    if req.include_usage:
                        pieces.append(sse(stream_chunk(kind, request_id, model, created, usage=usage(finals))))
                    pieces.append(SSE_DONE)
                    return "".join(pieces)
                if pieces:
                    reply.send("".join(pieces))
        except EngineError as e:
            if not started:
                raise
            # Headers (200) are gone already: report in-band, as OpenAI does, and end the stream.
            return sse(engine_error_body(e)) + SSE_DONE
        raise InternalError("the request stream ended without a final output")

    def _render_logprobs(self, kind: str, logprobs: list[TokenLogprob] | None, offset: int) -> tuple[dict | None, int]:
        """A choice's `logprobs` in `kind`'s shape (None when not asked), and the next text offset."""
        if logprobs is None or self._logprobs is None:
            return None, offset
        if kind == COMPLETIONS:
            return self._logprobs.completion(logprobs, offset)
        return self._logprobs.chat(logprobs), offset
