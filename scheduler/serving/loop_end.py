"""How the engine loop ends: every request in flight and every one still queued is answered,
with `ShuttingDown` at a shutdown or `InternalError` after the thread died (docs/serving.md)."""

from __future__ import annotations

import logging
import queue

from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.errors import EngineError, InternalError, ShuttingDown
from orcaserve.scheduler.serving.admission import Submission
from orcaserve.scheduler.serving.in_flight import RESTART_S
from orcaserve.scheduler.serving.loop_call import LoopCall
from orcaserve.scheduler.serving.stream_table import StreamTable

log = logging.getLogger(__name__)


def answer_all(table: StreamTable, engine: Engine | None, inbox: queue.Queue, death: BaseException | None) -> None:
    """Answer the requests in `table` (aborted in `engine` first at a clean shutdown, freeing their
    blocks) and the submissions left in `inbox`, into its outbox; `death` is what ended the thread."""

    def error() -> EngineError:  # one per request: each reader raises its own
        if death is None:
            return ShuttingDown("the engine is shutting down", retry_after=RESTART_S)
        return InternalError(
            f"the engine stopped after an internal error: {type(death).__name__}", retry_after=RESTART_S
        )

    for rid in list(table.streams):
        try:
            if death is None and engine is not None:
                engine.abort(rid)
        except Exception:
            log.exception("abort of %s at shutdown failed", rid)
        table.end(rid, error())
    while True:
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            break
        if isinstance(item, Submission):
            table.finish(item.stream, ShuttingDown("the engine is shutting down", retry_after=RESTART_S))
        elif isinstance(item, LoopCall) and item.future.set_running_or_notify_cancel():
            item.future.set_exception(ShuttingDown("the engine is shutting down", retry_after=RESTART_S))
