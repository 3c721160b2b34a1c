"""A request at the engine loop's edge, on the loop thread: a prepared submission taken into the
engine and the stream table, and a request ended early (an abort, its deadline, a failure, a
refusal by its latency class), answered with its final outputs or an error (engine_loop.py)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.errors import EngineError, InternalError, InvalidRequest, TimedOut
from orcaserve.scheduler.serving.admission import Submission
from orcaserve.scheduler.serving.stream_table import StreamTable

log = logging.getLogger(__name__)


def take_in(engine: Engine, table: StreamTable, item: Submission, notify: Callable[[], None]) -> None:
    """Add `item`'s request, tokenized by admission, to `engine` and its stream to `table`; a
    request admission failed, one whose id is in flight, or one the engine refuses is answered
    with its error instead."""
    rid = item.stream.request_id
    if rid in table.streams:
        table.finish(item.stream, InvalidRequest(f"request id {rid!r} is already in flight"))
        return
    if item.error is not None or item.ids is None:  # never tokenize here: admission did, or failed
        table.finish(item.stream, item.error or InternalError("internal error: prompt not prepared"))
        if isinstance(item.error, TimedOut):  # its deadline passed in admission:
            engine.stats.num_aborted += 1  # an abort by deadline, counted as the engine's own
            notify()
        return
    try:
        engine.add_request(dataclasses.replace(item.request, prompt=item.ids))  # tokenized
    except InvalidRequest as e:
        table.finish(item.stream, e)
        return
    except Exception as e:  # a bug or an input nobody foresaw: this request fails, not the loop
        log.exception("request %s could not be admitted", rid)
        table.finish(item.stream, InternalError(f"internal error while admitting the request: {type(e).__name__}: {e}"))
        return
    table.add(item.stream, item.request.params.n, item.deadline, item.request.timeout)


def end_early(
    engine: Engine, table: StreamTable, rid: str, reason: str, error: EngineError | None, notify: Callable[[], None]
) -> None:
    """Abort `rid` (every choice) in the engine, freeing its blocks, and answer it with the
    final outputs of its unfinished choices, or with `error` when given."""
    outs = engine.abort_all(rid, reason)
    if rid not in table.streams:
        return
    untouched = table.untouched(rid) and all(o.completion_tokens == 0 for o in outs)
    if error is None and outs and reason == "timeout" and untouched:
        timeout = table.deadlines[rid][1]
        error = TimedOut(timeout)
    if error is None and not outs:  # the engine no longer knows it: answer anyway
        error = InternalError(f"internal error: request {rid} was lost by the engine")
    if error is not None:
        table.end(rid, error)
    else:
        for out in outs:
            table.choice_done(rid, out)
    notify()
