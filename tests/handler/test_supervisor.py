"""The supervisor process at unit level: this test plays the worker over a real socket pair.

It starts the real supervisor (`SupervisorLink.start`), reports requests and writes frames through
the locked socket like the handler does, then "dies" (closes its end of the event pipe); the
frames the supervisor writes for the open requests are read back and decoded. The replacement
path needs TorchServe and a model: tests/e2e/test_reliability_e2e.py covers it.
"""

from __future__ import annotations

import json
import os
import socket
import struct

import pytest
from test_orca_handler import parse_frames

from orcaserve.handler.supervisor.link import SupervisorLink
from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.frames import read_request_ids, response_frame, written_requests

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


def test_the_supervisor_answers_what_the_worker_left_open(worker_socket):
    worker, frontend = worker_socket
    link = SupervisorLink.start(worker, LOAD, "unused.yaml")
    socket_lock.observe(link)
    message = inference_message("done", "streaming", "waiting")
    frontend.sendall(message)
    got = b""
    while len(got) < len(message):  # read in small pieces, as TorchServe's worker does
        got += worker.recv(7)
    assert not link.flag[1]  # the whole message was read: nothing half read
    worker.sendall(response_frame("streaming", b"data: {}\n\n", 200, "text/event-stream", {"ts_stream_next": "true"}))
    worker.sendall(response_frame("done", b"ok", 200, "application/json", {"ts_stream_next": "true"}))
    worker.sendall(response_frame("done", b"", 200, "", {"ts_stream_next": "false"}))
    link.stopping()  # no replacement: there is no model here to load
    os.close(link._fd)  # the worker is gone
    worker.close()
    link._proc.wait(20)
    frames = parse_frames(_read_all(frontend))
    by_id: dict[str, list[dict]] = {}
    for f in frames:
        by_id.setdefault(f["id"], []).append(f)
    assert len(by_id["done"]) == 2  # its own two frames, nothing added
    last = by_id["streaming"][-1]  # its 200 went out: the error is in-band and ends the stream
    assert last["status"] == 200 and last["headers"]["ts_stream_next"] == "false"
    events = last["body"].decode().split("\n\n")
    assert "worker stopped" in json.loads(events[0][6:])["error"]["message"] and events[1] == "data: [DONE]"
    error, release = by_id["waiting"]  # nothing went out: a 503, then the frame that releases the job
    assert error["status"] == 503 and "ts_stream_next" not in error["headers"]
    assert json.loads(error["body"])["error"]["type"] == "server_error"
    assert release["headers"]["ts_stream_next"] == "false"


def test_frames_are_read_and_parsed_both_ways():
    frame = response_frame("a", b"body", 200, "text/plain", {"ts_stream_next": "false", "x": "y"})
    assert written_requests(frame) == [("a", True)]
    assert written_requests(response_frame("b", b"", 503, "", {})) == [("b", False)]
    a, b = socket.socketpair()
    a.sendall(inference_message("req-1", "req-2") + inference_message("req-3"))
    assert read_request_ids(b) == ["req-1", "req-2"] and read_request_ids(b) == ["req-3"]
    a.close()
    b.close()
