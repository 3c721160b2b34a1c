"""A step's delivery waiting for its readers (`deliver(..., settle_s)`): it returns once the
readers' coroutines and what they queued (a round's frame) have run, and no later than
`settle_s` when the event loop is held up (docs/serving.md, "The step waits for its frames")."""

from __future__ import annotations

import asyncio
import threading
import time

from orcaserve.scheduler.core.outputs import RequestOutput, RequestTimes
from orcaserve.scheduler.serving.request_stream import RequestStream, deliver


def _output(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [token], [], f"t{token}", "", finished, None, 1, token + 1, RequestTimes(0.0))


class _Readers:
    """An event loop on its own thread; each stream's reader queues a 'frame write' for the end of
    its round, as the handler's frames do (handler/torchserve/stream_frames.py)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.written: list[tuple[str, int]] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def read(self, stream: RequestStream) -> None:
        async def reader() -> None:
            async for outputs in stream.chunks():
                for out in outputs:
                    self.loop.call_soon(self.written.append, (out.request_id, out.new_token_ids[0]))

        asyncio.run_coroutine_threadsafe(reader(), self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_delivery_returns_after_the_readers_wrote():
    readers = _Readers()
    try:
        streams = [RequestStream(f"r{i}", readers.loop) for i in range(4)]
        for s in streams:
            readers.read(s)
        for step in range(3):
            deliver([(s, _output(s.request_id, step, finished=step == 2)) for s in streams], settle_s=5.0)
            assert sorted(readers.written[-4:]) == [(f"r{i}", step) for i in range(4)]
        assert all(s.finished for s in streams)
    finally:
        readers.stop()


def test_delivery_waits_no_longer_than_settle_s():
    readers = _Readers()
    try:
        stream = RequestStream("r", readers.loop)
        readers.read(stream)
        readers.loop.call_soon_threadsafe(time.sleep, 0.5)  # the event loop is busy elsewhere
        t = time.monotonic()
        deliver([(stream, _output("r", 1))], settle_s=0.05)
        assert time.monotonic() - t < 0.4
        t = time.monotonic()
        deliver([(stream, _output("r", 2, finished=True))])  # no wait asked: returns at once
        assert time.monotonic() - t < 0.05
        deadline = time.monotonic() + 5
        while len(readers.written) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert readers.written == [("r", 1), ("r", 2)]
    finally:
        readers.stop()


def test_frame_wait_ms_is_read_and_checked():
    import pytest

    from orcaserve.handler.config import HandlerConfig

    assert HandlerConfig.from_dict({}).frame_wait_ms == 0
    assert HandlerConfig.from_dict({"frame_wait_ms": 5}).frame_wait_ms == 5
    for bad in (-1, True, "5", 2000):
        with pytest.raises(ValueError, match="frame_wait_ms"):
            HandlerConfig.from_dict({"frame_wait_ms": bad})
