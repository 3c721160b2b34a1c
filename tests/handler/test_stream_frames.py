"""One frame per event-loop round: the chunks of several streams queued in the same round go out
in one `sendall`, each prediction byte for byte what TorchServe's `create_predict_response` writes
for that chunk alone, and `flush` writes at once what is queued (before a final frame)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

pytest.importorskip("ts")

from ts.context import Context, RequestProcessor  # noqa: E402
from ts.protocol.otf_message_handler import create_predict_response  # noqa: E402

from orcaserve.handler.torchserve import socket_lock  # noqa: E402
from orcaserve.handler.torchserve.frames import written_requests  # noqa: E402
from orcaserve.handler.torchserve.stream_frames import StreamFrames, prediction_head  # noqa: E402

MESSAGE = "Intermediate Prediction success"


class Socket:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.writes.append(bytes(data))


def context(rid: str) -> Context:
    ctx = Context("m", "/tmp", {}, 1, None, None, "0.12")
    ctx.request_ids = {0: rid}
    ctx.request_processor = [RequestProcessor({})]
    ctx.set_response_content_type(0, "text/event-stream")
    ctx.set_response_header(0, "x-orcaserve-ignored", "seed")
    return ctx


def alone(rid: str, body: bytes) -> bytes:
    """TorchServe's own frame for one intermediate chunk."""
    return bytes(create_predict_response([body], {0: rid}, MESSAGE, 200, context(rid), True))


def predictions(frame: bytes) -> bytes:
    """A frame's predictions: what follows its code and message, before the closing -1."""
    head = struct.calcsize("!ii") + len(MESSAGE)
    assert frame[:head] == struct.pack("!ii", 200, len(MESSAGE)) + MESSAGE.encode()
    assert frame[-4:] == struct.pack("!i", -1)
    return frame[head:-4]


def test_a_rounds_chunks_share_one_frame_and_keep_their_bytes():
    sock, frames = Socket(), StreamFrames(1 << 20)
    chunks = [("a", b'data: {"x":1}\n\n'), ("b", "data: é\n\n".encode()), ("c", b"")]

    async def round_then_next() -> None:
        for rid, body in chunks:
            frames.add(sock, prediction_head(context(rid)), body)
        assert sock.writes == []  # nothing before the round ends
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(round_then_next())
    assert len(sock.writes) == 1
    assert predictions(sock.writes[0]) == b"".join(predictions(alone(rid, body)) for rid, body in chunks)


def test_flush_writes_at_once_and_frames_stay_under_the_limit():
    sock = Socket()
    body = b"x" * 100
    frames = StreamFrames(len(predictions(alone("a", body))) * 2)  # two chunks a frame

    async def five_then_flush() -> None:
        for _ in range(5):
            frames.add(sock, prediction_head(context("a")), body)
        frames.flush()  # what a final frame waits for

    asyncio.run(five_then_flush())
    assert [len(predictions(w)) // len(predictions(alone("a", body))) for w in sock.writes] == [2, 2, 1]


def test_the_sockets_observer_is_told_the_ids_it_would_parse():
    """The supervisor's link sees which requests a frame starts (supervisor/link.py): a round's
    frame hands it the ids it holds, the same as parsing the frame gives, none of them final."""
    worker, peer = socket.socketpair()
    socket_lock.install(worker)
    seen = []

    class Observer:
        def writing(self, frame: bytes, intermediate: list[str] | None = None) -> None:
            seen.append((written_requests(frame), intermediate))

        def written(self) -> None:
            pass

    async def one_round() -> None:
        frames = StreamFrames(1 << 20)
        for rid in ("a", "b", "c"):
            frames.add(worker, prediction_head(context(rid)), b"data: x\n\n")
        frames.flush()

    socket_lock.observe(Observer())
    try:
        asyncio.run(one_round())
    finally:
        socket_lock.observe(None)
        worker.close()
        peer.close()
    assert seen == [([("a", False), ("b", False), ("c", False)], ["a", "b", "c"])]
