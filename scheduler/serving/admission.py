"""Admission: what happens to a submitted request before the engine thread sees it."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import EngineError, InternalError, InvalidRequest, TimedOut
from orcaserve.scheduler.model.grammar import Grammars
from orcaserve.scheduler.prompt import encode_prompt
from orcaserve.scheduler.serving.os_thread import name_this_thread
from orcaserve.scheduler.serving.request_stream import RequestStream

log = logging.getLogger(__name__)

_QUIT = object()


@dataclass
class Submission:
    """A request on its way to the engine, and its `deadline` (from its timeout); admission sets
    its prompt's `ids`, or `error` to answer it with."""

    stream: RequestStream
    request: EngineRequest
    deadline: float | None
    ids: list[int] | None = None
    error: EngineError | None = None


@dataclass
class Abort:
    request_id: str


class Admission:
    """A thread that turns submissions' prompts into token ids and hands them on, in arrival order.

    Tokenizing a prompt (or rendering a chat template) costs about 2.5 s per MiB of text on the
    2-core machine. On the engine thread, 8 prompts of 1 MiB, each refused in the end,
    stopped every stream for 20 s (docs/performance-log.md, "Reliability: oversized prompts against
    other streams"). Here it runs beside the engine with
    a tokenizer of its own (fast tokenizers are not thread-safe; they release the GIL while they
    encode), `nice` steps lower in CPU priority, so the cores go to the engine's threads first.
    Structured outputs' grammars compile here too, into the engine's cache (model/grammar.py).

    Aborts pass through the same queue, so one never overtakes the request it is for. After
    `close`, submissions are handed on unprepared: the owner refuses them.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        forward: Callable[[Submission | Abort], None],
        nice: int = 10,
        grammars: Grammars | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._forward = forward
        self._nice = nice
        self._grammars = grammars  # the engine's: what compiles here, its thread finds cached
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="orcaserve-admission", daemon=True)

    def start(self) -> Admission:
        """Prepare what was put before the start on this thread, so that those requests reach
        the owner together, then start the admission thread for the rest."""
        while not self._queue.empty():
            if not self._handle(self._queue.get()):
                return self
        self._thread.start()
        return self

    def put(self, item: Submission | Abort) -> None:
        self._queue.put(item)

    def close(self, timeout: float = 10.0) -> None:
        """Hand on what is queued without preparing it, then stop. Waits for a prompt being
        tokenized: a few seconds at most at the default body-size limit."""
        self._closing = True
        self._queue.put(_QUIT)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self._nice:
            try:
                os.nice(self._nice)  # on Linux, the niceness of the calling thread only
            except OSError:
                log.warning("admission thread: could not lower its CPU priority")
        name_this_thread("orca-admission")
        while self._handle(self._queue.get()):
            pass

    def _handle(self, item: Submission | Abort | object) -> bool:
        if item is _QUIT:
            return False
        if isinstance(item, Submission) and not self._closing:
            self._prepare(item)
        self._forward(item)  # type: ignore[arg-type]  # not _QUIT
        return True

    def _prepare(self, item: Submission) -> None:
        request = item.request
        if item.deadline is not None and time.time() >= item.deadline:
            item.error = TimedOut(request.timeout or 0.0)
            return
        try:
            item.ids = encode_prompt(self._tokenizer, request.prompt, self._vocab_size, self._max_model_len)
            constraint = request.params.structured_outputs
            if constraint is not None and self._grammars is not None:
                self._grammars.compile(constraint)  # a new schema: off the engine thread
        except InvalidRequest as e:  # GrammarError included
            item.error = e
        except Exception as e:  # a bug or an input nobody foresaw: this request fails, not the thread
            log.exception("request %s could not be prepared", item.stream.request_id)
            item.error = InternalError(f"internal error while admitting the request: {type(e).__name__}: {e}")
