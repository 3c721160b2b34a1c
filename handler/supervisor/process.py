"""A process beside the model worker that keeps the worker's connection to TorchServe served.

TorchServe 0.12's async mode handles a dead worker badly (docs/reliability.md, "Worker death"):
the requests in flight on it are never answered, and the worker it starts instead takes queued
requests while its LOAD is still pending (`loadingFinished` is never reset after the first
load), which drops such a request and kills the new worker; under steady traffic every restart
fails the same way. So the worker must never look dead to the frontend.

The supervisor is started by the first worker and holds a copy of that worker's connection to the
frontend. It reads every message the frontend sends and hands it to the worker (`relay.Relay`);
the worker writes its frames to the connection itself and reports them on a pipe (`S id` status
line written, `E id` final frame written, `Q` stopping on request; see `SupervisorLink`). When the
pipe reaches EOF (the worker is gone, however it went):
- every request still open gets a final frame: an in-band SSE error if its 200 went out, else a
  503 JSON error;
- unless the worker stopped on request (`Q`) or the frontend has closed the connection, a
  replacement worker (`takeover.py`) starts on the same connection and loads the model; requests
  sent meanwhile wait for it, and so do those the dead worker never received. The supervisor then
  serves the replacement alike.
  The frontend stops reading a dead worker's stdout, so from then on the supervisor and the
  replacements log to files (`log_path`), and the engine's metrics no longer reach TorchServe.
- After `MAX_RESTARTS` replacements within `RESTART_WINDOW_S` it gives up: it answers what the
  frontend sends for `LINGER_S` with 503, closes the connection and leaves the worker to
  TorchServe.

Standard library only (no torch): it starts in milliseconds and costs a few MB.
Run as `python -m orcaserve.handler.supervisor.process` (see `supervisor_link.SupervisorLink.start`).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from orcaserve.handler.supervisor.link import ENV, FLAG_BYTES, new_flag_fd
from orcaserve.handler.supervisor.relay import Relay
from orcaserve.handler.torchserve.frames import final_frames

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
LINGER_S = 2.0
MAX_BACKLOG = 64 << 20  # bytes of messages held for a worker before the frontend is left to wait


# ---- the supervisor process ------------------------------------------------------------------
@dataclass
class _Watched:
    pid: int
    events: int  # the read end of its event pipe
    flag: mmap.mmap
    inbound: socket.socket  # the supervisor's end of its relay
    proc: subprocess.Popen | None  # None for the worker TorchServe started (not our child)


def _serve(sock: socket.socket, worker: _Watched, relay: Relay, frontend_open: bool) -> bool:
    """Relay the frontend's messages to the worker and follow its events until it exits;
    returns whether the frontend's connection is still open."""
    worker.inbound.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(worker.events, selectors.EVENT_READ, "events")
    watched = {"frontend": False, "inbound": False}
    broken = False  # the relay's socket failed: the worker is gone
    partial = b""
    while True:
        want = {
            "frontend": frontend_open and relay.backlog() < MAX_BACKLOG,
            "inbound": relay.backlog() > 0 and not broken,
        }
        for name, on in want.items():
            if on != watched[name]:
                watched[name] = on
                obj, mask = (
                    (sock, selectors.EVENT_READ) if name == "frontend" else (worker.inbound, selectors.EVENT_WRITE)
                )
                if on:
                    sel.register(obj, mask, name)
                else:
                    sel.unregister(obj)
        for key, _ in sel.select():
            if key.data == "events":
                data = os.read(worker.events, 65536)
                if not data:  # the worker is gone
                    sel.close()
                    os.close(worker.events)
                    worker.inbound.close()
                    if worker.proc is not None:
                        worker.proc.wait()
                    return frontend_open
                *lines, partial = (partial + data).split(b"\n")
                for line in lines:
                    relay.event(line)
            elif key.data == "frontend":
                data = sock.recv(65536)
                if data:
                    relay.from_frontend(data)
                else:  # TorchServe closed the connection: the worker sees its end, as without us
                    frontend_open = False
                    _shut(worker.inbound)
            else:
                try:
                    relay.hand_over(worker.inbound)
                except BlockingIOError:
                    pass
                except OSError:  # the worker is gone: its events' end comes next
                    broken = True


def _shut(inbound: socket.socket) -> None:
    try:
        inbound.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _frontend_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def log_path(model_name: str, role: str, pid: int) -> str:
    """Where the supervisor and replacement workers log once the first worker is gone: the
    frontend closes its end of a dead worker's stdout and stderr, so nothing written there
    arrives (and progress bars that write to a closed pipe can deadlock)."""
    folder = os.environ.get("LOG_LOCATION") or tempfile.gettempdir()
    return os.path.join(folder, f"orcaserve-{model_name}-{role}-{pid}.log")


def _spawn(sock: socket.socket, load: str, metrics_config: str) -> _Watched:
    read_fd, write_fd = os.pipe()
    flag_fd = new_flag_fd()
    inbound, theirs = socket.socketpair()
    env = dict(os.environ, **{ENV: f"{write_fd},{flag_fd},{theirs.fileno()}"}, TQDM_DISABLE="1")
    out = open(log_path(json.loads(load)["model_name"], "worker", os.getpid()), "ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orcaserve.handler.supervisor.takeover",
            "--sock-fd",
            str(sock.fileno()),
            "--load",
            load,
            "--metrics-config",
            metrics_config,
        ],
        pass_fds=(sock.fileno(), write_fd, flag_fd, theirs.fileno()),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    os.close(write_fd)
    theirs.close()
    flag = mmap.mmap(flag_fd, FLAG_BYTES)
    os.close(flag_fd)
    return _Watched(proc.pid, read_fd, flag, inbound, proc)


def _answer(sock: socket.socket, requests: dict[str, bool]) -> None:
    try:
        for rid, started in requests.items():
            sock.sendall(final_frames(rid, started))
    except OSError as e:
        log.error("orcaserve supervisor: could not answer: %s", e)


def _linger(sock: socket.socket, relay: Relay, seconds: float) -> int:
    """Answer every request with 503 for `seconds`, so that none reaches a closing connection."""
    answered = 0
    deadline = time.monotonic() + seconds
    try:
        while True:
            unsent = relay.unsent()
            _answer(sock, unsent)
            answered += len(unsent)
            if (left := deadline - time.monotonic()) <= 0:
                break
            sock.settimeout(left)
            data = sock.recv(65536)
            if not data or not relay.exact:
                break
            relay.from_frontend(data)
    except OSError:
        pass  # time is up or the frontend closed
    return answered


def _log_to_file(path: str) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(logging.FileHandler(path))
    for stream in (1, 2):  # nothing may reach the dead worker's pipes any more
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream)


def supervise(sock: socket.socket, worker: _Watched, load: str, metrics_config: str) -> None:
    restarts: deque[float] = deque()
    relay = Relay()
    frontend_open = True
    first = True
    while True:
        frontend_open = _serve(sock, worker, relay, frontend_open)
        if first and not relay.stopping:
            path = log_path(json.loads(load)["model_name"], "supervisor", os.getpid())
            log.warning("orcaserve supervisor: worker %d is gone; logging to %s from now on", worker.pid, path)
            _log_to_file(path)
            first = False
        if worker.flag[0] or not relay.exact:
            log.error(
                "orcaserve supervisor: worker %d died while %s; %d requests cannot be answered, and the "
                "connection goes back to TorchServe",
                worker.pid,
                "writing a frame" if worker.flag[0] else "the frontend's messages could not be followed",
                len(relay.open),
            )
            return
        left = relay.worker_gone()
        if left:
            log.warning(
                "orcaserve supervisor: worker %d is gone; answering its %d requests in flight", worker.pid, len(left)
            )
            _answer(sock, left)
        if relay.stopping or not frontend_open or _frontend_closed(sock):
            _answer(sock, relay.unsent())  # no worker will read them
            return
        now = time.monotonic()
        while restarts and now - restarts[0] > RESTART_WINDOW_S:
            restarts.popleft()
        if len(restarts) >= MAX_RESTARTS:
            log.error(
                "orcaserve supervisor: %d replacements in %.0f s; leaving the worker to TorchServe",
                len(restarts),
                RESTART_WINDOW_S,
            )
            _linger(sock, relay, LINGER_S)
            return
        restarts.append(now)
        old = worker.pid
        worker = _spawn(sock, load, metrics_config)
        log.warning("orcaserve supervisor: replacement %d takes over the connection of worker %d", worker.pid, old)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="orcaserve worker supervisor (started by the handler)")
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--events-fd", type=int, required=True)
    p.add_argument("--flag-fd", type=int, required=True)
    p.add_argument("--inbound-fd", type=int, required=True, help="the supervisor's end of the worker's relay")
    p.add_argument("--worker-pid", type=int, required=True)
    p.add_argument("--load", required=True, help="JSON: how a replacement loads the model")
    p.add_argument("--metrics-config", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
    sock = socket.socket(fileno=args.sock_fd)
    inbound = socket.socket(fileno=args.inbound_fd)
    first = _Watched(args.worker_pid, args.events_fd, mmap.mmap(args.flag_fd, FLAG_BYTES), inbound, None)
    try:
        supervise(sock, first, args.load, args.metrics_config)
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
