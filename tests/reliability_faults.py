"""The reliability suites' faults: a worker killed or stopped mid-request, with traffic running
(docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests
from openai_http import COMPLETIONS, call  # noqa: E402
from reliability_server import MODEL, serving_pid  # noqa: E402

from orcaserve.bench.serve.harness import TorchServe  # noqa: E402


class Traffic:
    """A client sending a short request every `period` s, recording (sent, answered, status)."""

    def __init__(self, ts: TorchServe, model: str = MODEL, period: float = 0.5) -> None:
        self.ts, self.model, self.period = ts, model, period
        self.log: list[tuple[float, float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                status: object = call(
                    self.ts, self.model, COMPLETIONS, {"prompt": "hi", "max_tokens": 2}, timeout=300
                ).status_code
            except requests.RequestException as e:
                status = type(e).__name__
            self.log.append((sent, time.time(), status))
            time.sleep(self.period)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(320)

    def first_ok_after(self, t: float, timeout: float = 300.0) -> float:
        """Seconds from `t` until a request sent after `t` got 200."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            ok = [answered for sent, answered, status in list(self.log) if sent > t and status == 200]
            if ok:
                return round(ok[0] - t, 1)
            time.sleep(0.2)
        raise AssertionError(f"no 200 within {timeout} s after the fault: {self.log[-5:]}")


def in_flight(ts: TorchServe, model: str = MODEL) -> tuple[ThreadPoolExecutor, list]:
    """A long stream (status line sent; returned as its iterator of lines) and a long
    non-streamed request in flight: slowed down (at least 3 s each), so they still are when the
    caller acts."""
    body = {
        "prompt": "Count to one hundred:",
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 0,
        "user": "orcaserve-fault:slow",
    }
    resp = call(ts, model, COMPLETIONS, {**body, "stream": True}, stream=True, timeout=120)
    lines = (line for line in resp.iter_lines(chunk_size=None) if line)  # each HTTP chunk as it comes
    first = next(lines)
    assert first.startswith(b"data: {"), first
    pool = ThreadPoolExecutor(1)
    plain = pool.submit(call, ts, model, COMPLETIONS, body, False, None, 120)
    time.sleep(0.3)
    return pool, [lines, plain]


def kill_worker(ts: TorchServe, how: str, model: str = MODEL) -> dict:
    """Kill the serving process mid-request (`how`: SIGKILL, or "loop" to kill its engine loop),
    with traffic running; returns how the requests in flight ended and when service came back."""
    pid = serving_pid(ts, model)
    with Traffic(ts, model) as traffic:
        pool, (stream, plain) = in_flight(ts, model)
        t = time.time()
        if how == "loop":
            killer = call(ts, model, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "user": "orcaserve-fault:loop"})
            assert killer.status_code == 500, killer.text
        else:
            os.kill(pid, signal.SIGKILL)
        rest = list(stream)
        stream_end = round(time.time() - t, 2)
        plain_resp = plain.result(timeout=120)
        plain_end = round(time.time() - t, 2)
        pool.shutdown()
        recovery = traffic.first_ok_after(t)
        time.sleep(1)
    statuses = Counter(str(s) for _, _, s in traffic.log)
    assert len(rest) >= 2 and b"error" in rest[-2] and rest[-1] == b"data: [DONE]", rest[-3:]
    return {
        "fault": how,
        "killed_pid": pid,
        "replacement_pid": serving_pid(ts, model),
        "stream_ended_s": stream_end,
        "stream_error": json.loads(rest[-2][6:])["error"]["message"],
        "plain_status": plain_resp.status_code,
        "plain_answered_s": plain_end,
        "recovery_s": recovery,
        "traffic": dict(statuses),
        "traffic_unanswered": sum(not isinstance(s, int) for _, _, s in traffic.log),
    }


def sigterm_mid_stream(ts: TorchServe, model: str = MODEL) -> dict:
    """SIGTERM (how TorchServe stops a worker): the stream in flight still gets its last frames."""
    pid = serving_pid(ts, model)
    pool, (stream, plain) = in_flight(ts, model)
    t = time.time()
    os.kill(pid, signal.SIGTERM)
    rest = list(stream)
    stream_end = round(time.time() - t, 2)
    plain_resp = plain.result(timeout=120)
    pool.shutdown()
    assert len(rest) >= 2 and rest[-1] == b"data: [DONE]", rest[-3:]
    return {
        "stream_ended_s": stream_end,
        "stream_last_event": rest[-2].decode()[:120],
        "plain_status": plain_resp.status_code,
        "plain_error": plain_resp.json()["error"]["message"],
    }
