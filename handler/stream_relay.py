"""A streamed answer's outputs to its client, from the callback that hands a step's outputs to
every stream (`RequestStream.follow`): the request's coroutine sleeps until its stream ends, and
no task wakes per token (docs/serving.md, "The asyncio thread per streamed token")."""

from __future__ import annotations

from orcaserve.handler.metrics import EngineMetrics
from orcaserve.handler.protocols import Shapes
from orcaserve.handler.torchserve.reply import Reply
from orcaserve.scheduler.core.outputs import RequestOutput


class StreamRelay:
    """`follow`'s callback for one streamed request. The HTTP status goes out with the first chunk,
    so the reply is opened at the first outputs (before them, a validation error or a deadline is
    still a real 4xx answer); each batch's events are queued as one chunk (`Reply.send`) until the
    shaper is `done`: its last text is then `final`, the final frame's body, which TorchServe sends
    once `handle` returns."""

    __slots__ = ("shaper", "reply", "metrics", "final")

    def __init__(self, shaper: Shapes, reply: Reply, metrics: EngineMetrics) -> None:
        self.shaper, self.reply, self.metrics = shaper, reply, metrics
        self.final: str | None = None

    def __call__(self, outputs: list[RequestOutput]) -> None:
        if self.final is not None:
            return
        reply, shaper = self.reply, self.shaper
        if not reply.opened:
            reply.open("text/event-stream", shaper.error_event)
        text = shaper.events(outputs)
        for out in outputs:
            if out.finished:
                self.metrics.on_finish(out)
        if shaper.done:
            self.final = text
        elif text:
            reply.send(text)
