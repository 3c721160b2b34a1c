"""Reliability against a real TorchServe: security, live fuzz, soak, KV exhaustion, client hang-ups
and faults (short versions; `python tests/reliability_suites.py` runs the long ones).

One server for the module, with fault injection enabled. Order matters: the metric-based suites
run before the fault suites, because once a worker is killed its replacement's metrics no longer
reach TorchServe (docs/reliability.md).
"""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import reliability_faults as faults
import reliability_server as serving
import reliability_suites as rs
import requests
from openai_http import COMPLETIONS, PROMPTS, call, expected, read_stream

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    server = serving.start_server(tmp_path_factory.mktemp("reliability"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def offline():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the server on 2 cores: see test_torchserve_e2e.offline
    try:
        yield serving.offline_engine()
    finally:
        torch.set_num_threads(threads)


def test_security(ts, tmp_path):
    shipped = serving.shipped_config()
    assert shipped["inference_address"].startswith("http://127.0.0.1:")
    assert shipped["management_address"].startswith("http://127.0.0.1:")
    assert "disable_token_authorization" not in shipped
    # Without the key: inference, management and metrics are refused.
    for url, api in ((ts.url(f"/predictions/{serving.MODEL}"), "inference"), (ts.url("/models", "management"), None)):
        r = requests.post(url, json={"prompt": "hi"}, timeout=30) if api else requests.get(url, timeout=30)
        assert r.status_code in (400, 401), r.text
    # The management API answers on loopback only.
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    for address in others:
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://{address}:{ts.ports['management']}/models", timeout=5)
    # Registration only from the model store (the shipped allowed_urls).
    outside = tmp_path / "elsewhere" / "x.mar"
    outside.parent.mkdir()
    outside.write_bytes(b"not an archive")
    for url in ("http://127.0.0.1:9/x.mar", f"file://{outside}", "file:///etc/passwd", "../x.mar"):
        r = requests.post(
            ts.url("/models", "management"),
            headers=ts.auth("management"),
            params={"url": url, "initial_workers": 1, "synchronous": "true"},
            timeout=60,
        )
        assert r.status_code >= 400, (url, r.status_code, r.text)
    listed = requests.get(ts.url("/models", "management"), headers=ts.auth("management"), timeout=30).json()
    assert [m["modelName"] for m in listed["models"]] == [serving.MODEL]
    # No request sees another's output: 16 different prompts at once, each gets its own answer.
    with ThreadPoolExecutor(16) as pool:
        texts = list(
            pool.map(
                lambda p: call(ts, serving.MODEL, COMPLETIONS, {"prompt": p, "max_tokens": 8, "temperature": 0}).json()[
                    "choices"
                ][0]["text"],
                PROMPTS,
            )
        )
    alone = [
        call(ts, serving.MODEL, COMPLETIONS, {"prompt": p, "max_tokens": 8, "temperature": 0}).json()["choices"][0][
            "text"
        ]
        for p in PROMPTS[:4]
    ]
    assert texts[:4] == alone


def test_live_fuzz_while_greedy_streams_run(ts, offline):
    r = rs.live_fuzz(ts, offline, 200)
    print(r)
    assert not r["failures"], r["failures"][:5]
    assert r["stream_mismatches"] == 0 and r["served_after"]
    assert r["answers"].get("200", 0) > 20 and sum(r["answers"].values()) > 150


def test_soak(ts, offline):
    r = rs.soak(ts, offline, clients=64, seconds=120)
    print(r)
    assert not r["failures"], r["failures"][:5]
    assert r.get("completed_exact", 0) > 50 and r.get("cancelled", 0) > 0
    assert r["kv_blocks_used_at_end"] == 0 and r["running_at_end"] == 0


def test_kv_exhaustion_preempts_and_stays_exact(ts, offline):
    r = rs.kv_exhaustion(ts, offline)
    print(r)
    assert r["exact"] == r["requests"] and r["preemptions"] > 0 and r["kv_blocks_used_at_end"] == 0


def test_a_hung_up_stream_runs_to_its_limit(ts):
    r = rs.abandoned_stream(ts)
    print(r)
    assert r["tokens_generated_after_hangup"] == r["max_tokens"] and r["kv_blocks_used_at_end"] == 0


def test_oversized_prompts_do_not_stop_other_streams(ts, offline):
    """Tokenizing 4 bodies of 1 MiB takes seconds; on the engine thread it stopped every stream
    for all of them (benchmarks/admission.py, retired at fc3a01a), now it runs beside the engine."""
    r = rs.oversized_prompts(ts, offline)
    print(r)
    assert r["statuses"] == [400] * 4 and set(r["params"]) == {"prompt"}
    assert max(r["bodies"]) < 1 << 20 and r["stream_mismatches"] == 0 and r["streams"] >= 2
    assert r["largest_gap_during_s"] < 0.25 * r["attack_s"], r


def test_a_failing_step_fails_its_request_only(ts, offline):
    want = expected(offline, [("completions", p) for p in PROMPTS[:2]], [32, 32])
    with ThreadPoolExecutor(3) as pool:
        streams = [
            pool.submit(
                lambda p: read_stream(
                    call(
                        ts,
                        serving.MODEL,
                        COMPLETIONS,
                        {"prompt": p, "max_tokens": 32, "temperature": 0, "stream": True},
                        stream=True,
                    )
                )["text"],
                p,
            )
            for p in PROMPTS[:2]
        ]
        bad = call(ts, serving.MODEL, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "user": "orcaserve-fault:step"})
        got = [s.result() for s in streams]
    assert bad.status_code == 500 and "injected step failure" in bad.json()["error"]["message"]
    assert got == [w.text for w in want]
    assert call(ts, serving.MODEL, COMPLETIONS, {"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("how", ["SIGKILL", "SIGKILL-again", "loop"])
def test_a_dead_worker_answers_its_requests_and_is_replaced(ts, how):
    r = faults.kill_worker(ts, how.split("-")[0])
    print(r)
    assert r["stream_ended_s"] < 15 and r["plain_answered_s"] < 15
    assert r["plain_status"] == (500 if how == "loop" else 503)
    assert r["replacement_pid"] != r["killed_pid"] and r["traffic_unanswered"] == 0


def test_sigterm_delivers_the_final_frames(ts):
    r = faults.sigterm_mid_stream(ts)
    print(r)
    assert r["stream_ended_s"] < 15 and "shutting down" in r["stream_last_event"]
    assert r["plain_status"] == 503
