"""The engine loop's table of requests in the engine: each one's stream, deadline and unfinished
choices, and the outputs queued for delivery once per round. The loop thread alone touches it."""

from __future__ import annotations

from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.errors import EngineError
from orcaserve.scheduler.serving.in_flight import InFlight
from orcaserve.scheduler.serving.request_stream import RequestStream


class StreamTable:
    """Requests admitted into the engine, by id; what they are sent waits in an outbox that the
    loop delivers once per round (one wake-up per event loop for a whole step). Every finished
    sequence is released from `in_flight`; an error before a request's first output counts as a
    refusal."""

    def __init__(self, in_flight: InFlight) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.deadlines: dict[str, tuple[float, float]] = {}  # id -> (deadline, timeout)
        self._in_flight = in_flight
        self._outbox: list[tuple[RequestStream, RequestOutput | EngineError]] = []
        self._unfinished: dict[str, int] = {}  # request id -> its choices not yet finished
        self._begun: set[str] = set()  # request ids that have had an output: no longer refusable

    def add(self, stream: RequestStream, n: int, deadline: float | None, timeout: float | None) -> None:
        rid = stream.request_id
        self.streams[rid] = stream
        self._unfinished[rid] = n
        if deadline is not None:
            self.deadlines[rid] = (deadline, timeout or 0.0)

    def untouched(self, rid: str) -> bool:
        """Whether none of `rid`'s choices has finished."""
        stream = self.streams.get(rid)
        return stream is not None and self._unfinished.get(rid) == stream.n

    def nearest_deadline(self) -> float | None:
        return min((d for d, _ in self.deadlines.values()), default=None)

    def send(self, stream: RequestStream, out: RequestOutput) -> None:
        """Queue a non-final output: the request has begun, no longer refusable."""
        self._begun.add(stream.request_id)
        self._outbox.append((stream, out))

    def finish(self, stream: RequestStream, item: RequestOutput | EngineError, seqs: int | None = None) -> None:
        """Queue a stream's final item and release its `seqs` unfinished sequences (all of its
        choices by default) from the in-flight count; an error before any output is a refusal."""
        self._outbox.append((stream, item))
        refusal = item if isinstance(item, EngineError) and stream.request_id not in self._begun else None
        self._in_flight.release(stream.n if seqs is None else seqs, refusal)

    def end(self, rid: str, item: RequestOutput | EngineError) -> None:
        """Send `rid` its final item and forget it."""
        stream = self.streams.pop(rid, None)
        self.deadlines.pop(rid, None)
        seqs = self._unfinished.pop(rid, None)
        if stream is not None:
            self.finish(stream, item, seqs)
        self._begun.discard(rid)

    def choice_done(self, rid: str, out: RequestOutput) -> None:
        """A choice's final output: the request's final item once every choice has finished."""
        left = self._unfinished.get(rid, 1) - 1
        if left > 0:
            self._unfinished[rid] = left
            self._begun.add(rid)
            self._outbox.append((self.streams[rid], out))
            self._in_flight.release(1)  # its seat is free for the next arrival
        else:
            self.end(rid, out)

    def take(self) -> list[tuple[RequestStream, RequestOutput | EngineError]]:
        """What is queued for delivery (`request_stream.deliver`), emptying the outbox."""
        outbox, self._outbox = self._outbox, []
        return outbox
