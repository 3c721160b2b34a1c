"""The supervisor process at unit level: this test plays the worker over a real socket pair.

It starts the real supervisor (`SupervisorLink.start`), reads the frontend's messages through its
relay and writes frames through the locked socket like the handler does, then "dies" (closes its
end of the event pipe and of the relay); the frames the supervisor writes for the open requests
are read back and decoded. The relay's bookkeeping is checked on its own too. The replacement
path needs TorchServe and a model: tests/e2e/test_reliability_e2e.py covers it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import pytest
from test_orca_handler import parse_frames

from orcaserve.handler.supervisor.link import SupervisorLink
from orcaserve.handler.supervisor.relay import Relay
from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.frames import InboundParser, response_frame, written_requests

LOAD = {
    "model_name": "m",
    "model_dir": "/nonexistent",
    "batch_size": 1,
    "handler": "h.py",
    "gpu": None,
    "limit_max_image_pixels": True,
}


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def worker_socket():
    worker, frontend = socket.socketpair()
    socket_lock.install(worker)
    yield worker, frontend
    socket_lock.observe(None)
    socket_lock.relay(None)
    frontend.close()


def inference_message(*request_ids: str) -> bytes:
    """What the frontend sends: b"I", then per request its id, headers and parameters."""

    def s(b: bytes) -> bytes:
        return struct.pack("!i", len(b)) + b

    end = struct.pack("!i", -1)
    msg = b"I"
    for rid in request_ids:
        msg += s(rid.encode()) + s(b"url_path") + s(b"v1/completions") + end
        msg += s(b"body") + s(b"application/json") + s(b'{"prompt": "hi"}') + end
    return msg + end


def _died(link: SupervisorLink, worker: socket.socket, frontend: socket.socket) -> dict[str, list[dict]]:
    """The worker is gone: its event pipe and relay close; what the supervisor wrote, by request."""
    os.close(link._fd)
    link.inbound.close()
    worker.close()
    assert link._proc is not None
    link._proc.wait(20)
    by_id: dict[str, list[dict]] = {}
    for f in parse_frames(_read_all(frontend)):
        by_id.setdefault(f["id"], []).append(f)
    return by_id


def _assert_503(frames: list[dict]) -> None:
    error, release = frames  # nothing went out: a 503, then the frame that releases the job
    assert error["status"] == 503 and "ts_stream_next" not in error["headers"]
    assert json.loads(error["body"])["error"]["type"] == "server_error"
    assert release["headers"]["ts_stream_next"] == "false"


def test_the_supervisor_answers_what_the_worker_left_open(worker_socket):
    worker, frontend = worker_socket
    link = SupervisorLink.start(worker, LOAD, "unused.yaml")
    link.attach_to_socket()
    message = inference_message("done", "streaming", "waiting")
    frontend.sendall(message)
    got = b""
    while len(got) < len(message):  # read in small pieces, as TorchServe's worker does
        got += worker.recv(7)
    assert got == message  # through the relay, byte for byte
    worker.sendall(response_frame("streaming", b"data: {}\n\n", 200, "text/event-stream", {"ts_stream_next": "true"}))
    worker.sendall(response_frame("done", b"ok", 200, "application/json", {"ts_stream_next": "true"}))
    worker.sendall(response_frame("done", b"", 200, "", {"ts_stream_next": "false"}))
    link.stopping()  # no replacement: there is no model here to load
    by_id = _died(link, worker, frontend)
    assert len(by_id["done"]) == 2  # its own two frames, nothing added
    last = by_id["streaming"][-1]  # its 200 went out: the error is in-band and ends the stream
    assert last["status"] == 200 and last["headers"]["ts_stream_next"] == "false"
    events = last["body"].decode().split("\n\n")
    assert "worker stopped" in json.loads(events[0][6:])["error"]["message"] and events[1] == "data: [DONE]"
    _assert_503(by_id["waiting"])


def test_a_worker_dead_in_the_middle_of_a_message_leaves_no_request_unanswered(worker_socket):
    """Killed with a message half read (the case the supervisor once had to give up on): its
    requests are answered, and so is a message sent after it, which no worker will read."""
    worker, frontend = worker_socket
    link = SupervisorLink.start(worker, LOAD, "unused.yaml")
    link.attach_to_socket()
    first = inference_message("half-read-1", "half-read-2")
    frontend.sendall(first)
    assert worker.recv(len(first) // 2)  # the worker has begun to read it, and dies
    frontend.sendall(inference_message("later"))
    time.sleep(0.2)  # the supervisor has read both
    link.stopping()
    by_id = _died(link, worker, frontend)
    assert sorted(by_id) == ["half-read-1", "half-read-2", "later"]
    for frames in by_id.values():
        _assert_503(frames)


class _Takes:
    """A worker's relay socket that takes `n` more bytes, then would block."""

    def __init__(self, n: int) -> None:
        self.n, self.got = n, b""

    def send(self, data: bytes) -> int:
        if not self.n:
            raise BlockingIOError
        taken = bytes(data[: self.n])
        self.n -= len(taken)
        self.got += taken
        return len(taken)


def test_the_relay_answers_what_a_dead_worker_may_have_seen_and_requeues_the_rest():
    one, two, three = inference_message("a"), inference_message("b", "c"), inference_message("d")
    stream = one + two + three
    relay = Relay()
    relay.from_frontend(stream[:5])  # messages arrive in any pieces
    relay.from_frontend(stream[5:])
    assert relay.backlog() == len(stream) and sorted(relay.open) == ["a", "b", "c", "d"]
    relay.hand_over(_Takes(len(stream)))  # the worker's socket takes all of it...
    relay.event(b"S a")
    relay.event(b"E b")
    assert relay.worker_gone() == {"a": True, "c": False, "d": False}  # ...so it may have seen all

    relay = Relay()
    relay.from_frontend(stream)
    first = _Takes(len(one) + 3)
    relay.hand_over(first)  # one message and 3 bytes of the next...
    with pytest.raises(BlockingIOError):
        relay.hand_over(first)
    assert relay.worker_gone() == {"a": False, "b": False, "c": False}  # ...which are answered
    nxt = _Takes(1 << 20)
    relay.hand_over(nxt)
    assert nxt.got == three and list(relay.open) == ["d"]  # the rest goes to the next worker, whole
    relay.from_frontend(one)  # sent while no worker runs: answered if none will read it
    assert relay.unsent() == {"a": False} and relay.backlog() == 0


def test_frames_are_read_and_parsed_both_ways():
    frame = response_frame("a", b"body", 200, "text/plain", {"ts_stream_next": "false", "x": "y"})
    assert written_requests(frame) == [("a", True)]
    assert written_requests(response_frame("b", b"", 503, "", {})) == [("b", False)]
    parser = InboundParser()
    one, two = inference_message("req-1", "req-2"), inference_message("req-3")
    assert parser.feed((one + two)[:-3]) == [(one, ["req-1", "req-2"])]
    assert parser.feed((one + two)[-3:]) == [(two, ["req-3"])] and parser.take() == b""
    with pytest.raises(ValueError):
        parser.feed(b"L")  # not an inference message
