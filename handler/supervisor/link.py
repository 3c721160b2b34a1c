"""The worker's side of the supervisor (process.py): starting it beside a worker TorchServe
started, and the link that reports to it what crosses the worker's socket.

Standard library only, like the supervisor, which imports its constants from here.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import subprocess
import sys
from types import FrameType
from typing import Any

from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.frames import InboundParser, written_requests

log = logging.getLogger(__name__)

ENV = "ORCASERVE_SUPERVISED"  # "EVENTS_FD,FLAG_FD" in a replacement worker's environment
FLAG_BYTES = 2


class SupervisorLink:
    """The worker's end: tells the supervisor what crosses the worker's socket.

    It observes the socket (`socket_lock.observe`): a request is open from the moment the worker
    has read its message (`B`) until its final frame is on the socket (`E`); `S` marks its first
    frame (the 200 status line). Events precede the bytes they describe, and a shared flag
    covers each write and each half-read message, so that after a death the supervisor knows
    whether its picture is exact. Event writes are single `os.write` calls under PIPE_BUF bytes
    (atomic); if the supervisor is gone or its pipe is full, reporting stops rather than block.
    """

    def __init__(self, events_fd: int, flag: mmap.mmap, proc: subprocess.Popen | None = None) -> None:
        self._fd = events_fd
        os.set_blocking(self._fd, False)
        self.flag = flag  # [0]: a frame is being written; [1]: a message is half read
        self._proc = proc
        self._ok = True
        self._inbound = InboundParser()
        self._lost = False
        self._started: set[str] = set()  # requests with a frame on the socket, not yet final

    @classmethod
    def start(cls, sock: socket.socket, load: dict, metrics_config: str) -> SupervisorLink:
        """Start the supervisor beside this worker (the one TorchServe started), while the socket
        is between messages. `load`: how a replacement loads the model, as TorchServe's LOAD did."""
        read_fd, write_fd = os.pipe()
        flag_fd = new_flag_fd()
        fds = (sock.fileno(), read_fd, flag_fd)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orcaserve.handler.supervisor.process",
                "--sock-fd",
                str(fds[0]),
                "--events-fd",
                str(read_fd),
                "--flag-fd",
                str(flag_fd),
                "--worker-pid",
                str(os.getpid()),
                "--load",
                json.dumps(load),
                "--metrics-config",
                metrics_config,
            ],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
        )
        os.close(read_fd)
        flag = mmap.mmap(flag_fd, FLAG_BYTES)
        os.close(flag_fd)
        log.info("orcaserve: supervisor %d watches worker %d", proc.pid, os.getpid())
        return cls(write_fd, flag, proc)

    @classmethod
    def attach(cls, spec: str) -> SupervisorLink:
        """In a replacement worker: the pipe and flag its supervisor passed (`ENV`)."""
        events_fd, flag_fd = (int(x) for x in spec.split(","))
        flag = mmap.mmap(flag_fd, FLAG_BYTES)
        os.close(flag_fd)
        return cls(events_fd, flag)

    def _send(self, event: str) -> None:
        if not self._ok:
            return
        try:
            os.write(self._fd, f"{event}\n".encode())
        except OSError as e:
            self._ok = False
            log.error("orcaserve: supervisor unreachable (%s); a dead worker's requests will not be answered", e)

    def read(self, data: bytes) -> None:
        if self._lost:
            return
        try:
            for rid in self._inbound.feed(data):
                self._send(f"B {rid}")
            self.flag[1] = self._inbound.mid_message
        except Exception:  # a message it cannot follow: from now on it cannot vouch for anything
            self.flag[1] = 1
            self._lost = True
            log.exception("orcaserve: cannot follow the frontend's messages; a takeover will not be tried")

    def writing(self, frame: bytes) -> None:
        self.flag[0] = 1
        try:
            updates = written_requests(frame)
        except Exception:  # not a predict frame: nothing to report
            return
        for rid, final in updates:
            if final:
                self._started.discard(rid)
                self._send(f"E {rid}")
            elif rid not in self._started:
                self._started.add(rid)
                self._send(f"S {rid}")

    def written(self) -> None:
        self.flag[0] = 0

    def stopping(self) -> None:
        """This worker stops on request (SIGTERM): do not replace it."""
        self._send("Q")


def new_flag_fd() -> int:
    fd = os.memfd_create("orcaserve-socket-flags")
    os.ftruncate(fd, FLAG_BYTES)
    return fd


def start_supervisor(context: Any, props: dict) -> SupervisorLink | None:
    """Lock and observe the connection to the frontend and start the supervisor beside it.

    The connection is not handed to handlers: during `initialize` it is the `cl_socket` local of
    TorchServe's `handle_connection_async`, up the stack (ts 0.12). Finding it there means
    observing from the first request on, at a message boundary."""
    frame: FrameType | None = sys._getframe()
    while frame is not None and not isinstance(frame.f_locals.get("cl_socket"), socket.socket):
        frame = frame.f_back
    if frame is None:
        log.warning("orcaserve: no TorchServe connection found; a dead worker's requests will not be answered")
        return None
    sock = frame.f_locals["cl_socket"]
    try:
        socket_lock.install(sock)
        link = SupervisorLink.start(sock, _load_spec(context, props), _metrics_config())
    except Exception:
        log.exception("orcaserve: could not start the supervisor; a dead worker's requests will not be answered")
        return None
    socket_lock.observe(link)
    return link


def _load_spec(context: Any, props: dict) -> dict:
    """What TorchServe's LOAD message said, so that a replacement worker loads the same way."""
    manifest = getattr(context, "manifest", None) or {}
    return {
        "model_name": getattr(context, "model_name", None),
        "model_dir": props.get("model_dir"),
        "batch_size": props.get("batch_size") or 1,
        "handler": (manifest.get("model") or {}).get("handler"),
        "gpu": props.get("gpu_id"),
        "limit_max_image_pixels": props.get("limit_max_image_pixels", True),
    }


def _metrics_config() -> str:
    """The metrics config TorchServe gave this worker (`--metrics-config`), for a replacement."""
    argv = sys.argv
    if "--metrics-config" in argv[:-1]:
        return argv[argv.index("--metrics-config") + 1]
    import ts

    return os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml")
