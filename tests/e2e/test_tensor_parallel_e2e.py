"""A real TorchServe serving the default model split over 2 ranks (`tensor_parallel_size: 2` in
the handler section: the worker starts its second rank), registered through the management API,
over REST: answers equal to one process; a rank killed mid-stream takes the worker down, the
stream ends instead of hanging, and TorchServe starts the worker again (docs/tensor-parallel.md,
"Over TorchServe")."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from orcaserve.bench.serve.harness import TorchServe, registered
from orcaserve.scheduler import Engine, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2tp"
TP = {"tensor_parallel_size": 2, "dtype": "float32"}  # the worker starts its second rank itself


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    from orcaserve.handler.archive import build

    root = tmp_path_factory.mktemp("tp")
    build("default", MODEL, str(root / "model-store"), fmt="default", overrides=TP)
    server = TorchServe(root / "work", root / "model-store")
    with registered(server, [f"{MODEL}.mar"]):
        yield server


def _complete(ts, prompt: str, max_tokens: int = 12, stream: bool = False, timeout: float = 300):
    return requests.post(
        ts.url(f"/predictions/{MODEL}/1.0/v1/completions"),
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream},
        headers=ts.auth(),
        timeout=timeout,
        stream=stream,
    )


def _other_ranks(ts) -> list[int]:
    """The worker's rank 1: a process torch.multiprocessing spawned in the server's session."""
    assert ts.proc is not None
    session, out = os.getsid(ts.proc.pid), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"spawn_main" in cmd and os.getsid(int(pid)) == session:
                out.append(int(pid))
        except OSError:
            continue
    return out


def test_answers_equal_one_process(ts, smollm2_path):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    one = Engine.from_pretrained(smollm2_path, dtype="float32", quantization="none")  # the ranks serve it dense
    ref = one.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, expected in zip(prompts, ref):
        r = _complete(ts, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected.text


def test_a_rank_killed_mid_stream(ts):
    r = _complete(ts, "Once upon a time", max_tokens=400, stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    next(lines)  # the stream has started
    ranks = _other_ranks(ts)
    assert ranks, "no rank 1 under the worker"
    os.kill(ranks[0], signal.SIGKILL)
    started = time.time()
    body = b"".join(lines)  # ends: no hang
    assert time.time() - started < 120
    assert b"[DONE]" not in body or b"error" in body
    deadline = time.time() + 300
    while time.time() < deadline:  # TorchServe starts the worker again
        try:
            again = _complete(ts, "The capital of France is", timeout=60)
            if again.status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(5)
    pytest.fail("the worker did not come back")
