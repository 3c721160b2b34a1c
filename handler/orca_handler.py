"""OrcaHandler: TorchServe async-mode handler serving the protocols of `protocols.py` (OpenAI's,
Anthropic's Messages, OpenAI's Responses) from one engine loop.

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
from orcaserve.handler.faults import FaultInjector
from orcaserve.handler.lora_admin import LOAD, UNLOAD, LoraAdmin
from orcaserve.handler.metrics import EngineMetrics
from orcaserve.handler.neighbours import lower_neighbours
from orcaserve.handler.openai.body import check_size, decode_body
from orcaserve.handler.openai.errors import http_error
from orcaserve.handler.openai.fields import IGNORED_HEADER, MODELS
from orcaserve.handler.openai.logprobs import LogprobsRenderer
from orcaserve.handler.openai.models import with_model
from orcaserve.handler.openai.protocol import ProtocolError
from orcaserve.handler.openai.responses import model_list
from orcaserve.handler.openai.tenancy import with_tenancy
from orcaserve.handler.protocols import Endpoint, Shapes, count_tokens, endpoint_for
from orcaserve.handler.reasoning import ReasoningStyle, reasoning_style
from orcaserve.handler.stream_relay import StreamRelay
from orcaserve.handler.supervisor.link import SupervisorLink, start_supervisor
from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.reply import Reply
from orcaserve.handler.torchserve.stream_frames import StreamFrames
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.errors import EngineError, InternalError, ShuttingDown
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
        self._counter: Any = None  # a tokenizer of count_tokens' own (protocols.py), used off this thread
        self._adapters: list[str] = []  # the LoRA adapters served, read once the engine is built
        self._lora_admin: LoraAdmin | None = None  # their runtime loads and unloads (lora_admin.py)
        self._frames: StreamFrames | None = None  # every stream's chunks of a round in one frame

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
            if name in engine.lora_names:  # `model` would name both (handler/openai/models.py)
                raise ValueError(f"a LoRA adapter is named {name!r}, the served model's name: rename it")
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
            lambda on_step, on_refused: EngineLoop.launch(
                build, on_step, config.max_waiting_requests, self._on_loop_death, on_refused
            ),
            config,
            getattr(context, "metrics", None),
            name,
        )
        self._guard_worker = True
        lower_neighbours(config.neighbour_nice)  # the engine's threads started at the worker's
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
            lambda on_step, on_refused: EngineLoop(
                engine, on_step, config.max_waiting_requests, self._on_loop_death, on_refused
            ).start(),
            config,
            metrics_cache,
            model_name,
        )

    def _serve_loop(
        self,
        make_loop: Callable[[Callable, Callable], EngineLoop],
        config: HandlerConfig,
        metrics_cache: Any,
        model_name: str,
    ) -> None:
        self.config, self.model_name = config, model_name
        self._frames = StreamFrames(config.max_frame_bytes)
        self.metrics = EngineMetrics(metrics_cache, model_name)
        self.engine_loop = make_loop(self.metrics.on_step, self.metrics.on_refused)
        engine = self.engine_loop.engine  # its cache's shape is fixed: safe to read from this thread
        self.metrics.on_start(engine.config.block_size, engine.stats.num_blocks)
        tokenizer = copy.deepcopy(engine.tokenizer)
        self._logprobs = LogprobsRenderer(tokenizer)
        self._reasoning = reasoning_style(config.reasoning_parser, tokenizer)
        self._counter = copy.deepcopy(tokenizer)
        self._lora_admin = LoraAdmin(config.lora_runtime_updates, model_name, self.engine_loop)
        self._adapters = self._lora_admin.adapters
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
        reply = Reply(context, (self.config or HandlerConfig).max_frame_bytes, self._frames)
        endpoint: Endpoint | None = None
        self._active += 1
        try:
            endpoint = endpoint_for(context.get_request_header(0, "url_path"))
            body = await self._serve(data[0] if data else {}, reply, request_id, endpoint)
        except Exception as e:  # the worker must survive anything one request does
            if not isinstance(e, (ProtocolError, EngineError)):
                log.exception("request %s failed", request_id)
            error = http_error(e)  # the one error path (openai/errors.py), in the protocol's shape
            body = reply.fail(endpoint.error(error) if endpoint is not None else error)
        finally:
            self._active -= 1
        return [reply.finish(body)]

    async def _serve(self, item: dict, reply: Reply, request_id: str, endpoint: Endpoint) -> str:
        context = reply.context
        if not self.initialized or self.engine_loop is None or not self.engine_loop.alive:
            raise ShuttingDown("the engine is not running", retry_after=5)
        if endpoint.kind == MODELS:  # whatever the method and body: the list is all there is to say
            context.set_response_content_type(0, "application/json")
            max_len = self.engine_loop.engine.max_model_len
            return json.dumps(model_list(self.model_name, max_len, self._created, self._adapters))
        raw = item.get("body") if item.get("body") is not None else item.get("data")
        if raw is None:
            raise ProtocolError("request body must be a JSON object (send Content-Type: application/json)")
        cfg, metrics = self.config, self.metrics
        assert cfg is not None and metrics is not None  # set with `initialized`
        check_size(raw, context.get_request_header(0, "content-length"), cfg.max_body_bytes)
        body = decode_body(raw)
        if endpoint.kind in (LOAD, UNLOAD) and self._lora_admin is not None:
            answer = await self._lora_admin.serve(endpoint.kind, body, context.get_all_request_header(0) or {})
            self._adapters = self._lora_admin.adapters
            context.set_response_content_type(0, "text/plain")
            return answer
        req = endpoint.parse(body, request_id, cfg, self._reasoning)
        if req.ignored:
            context.set_response_header(0, IGNORED_HEADER, ",".join(req.ignored))
        if endpoint.counts_tokens:
            engine = self.engine_loop.engine  # its vocabulary and context length are fixed: safe to read
            context.set_response_content_type(0, "application/json")
            return await count_tokens(self._counter, req, engine.vocab_size, engine.max_model_len)
        request = with_tenancy(req, context.get_all_request_header(0) or {}, cfg)  # refuses a missing tenant
        request = with_model(request, req.model, self.model_name, self._adapters, cfg.lora_runtime_updates)
        self._faults.arm(request_id, body.get("user"))
        stream = self.engine_loop.submit(request, event_loop=asyncio.get_running_loop())
        shaper = endpoint.shaper(req, request_id, self.model_name, self._logprobs, self._reasoning)
        try:
            if req.stream:
                return await self._relay(stream, shaper, reply, metrics)
            finals: dict[int, RequestOutput] = {}
            async for out in stream:
                if out.finished:
                    finals[out.index] = out
            answer = shaper.response(finals)
            for _, final in sorted(finals.items()):
                metrics.on_finish(final)
            context.set_response_content_type(0, "application/json")
            return answer
        finally:
            self._faults.disarm(request_id)
            if not stream.finished:  # we are leaving early (error): free the engine's blocks
                self.engine_loop.abort(request_id)

    async def _relay(self, stream: RequestStream, shaper: Shapes, reply: Reply, metrics: EngineMetrics) -> str:
        """Send each step's SSE events as tokens arrive, from the callback that dispatches the
        step's outputs (stream_relay.py); returns the last frame's body. After the first frame an
        error travels in-band, as the shaper's protocol tells it (`Reply.fail`)."""
        relay = StreamRelay(shaper, reply, metrics)
        await stream.follow(relay)
        if relay.final is None:
            raise InternalError("the request stream ended without a final output")
        return relay.final
