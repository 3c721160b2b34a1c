"""The serving benchmark (`orcaserve-bench serve`): a smoke run against a live TorchServe (slow), and its
client and report logic against an in-process stub server (fast).

Starts TorchServe on free loopback ports (token auth on) with the request-level baseline archive
and, when the orcaserve archive builder is available, the orcaserve archive too; sends a few
streamed requests per system and checks the JSON report: every request answered, no errors.
No performance figure is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orcaserve.bench.cli import command
from orcaserve.bench.serve.harness import TorchServe

pytestmark = pytest.mark.slow  # starts HTTP servers and runs the load generator against them

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    from orcaserve.bench.baseline.baseline_archive import build_archive

    store = tmp_path / "model-store"
    build_archive(str(store), "smollm2-baseline")
    models = ["smollm2-baseline"]
    if importlib.util.find_spec("orcaserve.handler.archive") is not None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "orcaserve.handler.archive",
                "--name",
                "smollm2",
                "--export-path",
                str(store),
                "--format",
                "no-archive",
            ],
            check=True,
        )
        models.insert(0, "smollm2")
    work = tmp_path / "ts"
    with TorchServe(work, store, extra_config={"job_queue_size": "1000"}) as ts:  # bursts queue
        for name in models:
            ts.register(name)
        out = tmp_path / "bench.json"
        cmd = [
            *command("serve"),
            "--url",
            ts.url(""),
            f"--key={ts.keys['inference']}",
            "--rate",
            "4",  # keys may start with "-"
            "--num-requests",
            "4",
            "--input-len",
            "8:32",
            "--output-len",
            "2:6",
            "--warmup",
            "1",
            "--timeout",
            "120",
            "--out",
            str(out),
            "--no-progress",
        ]
        for name in models:
            cmd += ["--model", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stdout + proc.stderr + ts.logs()
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [s["system"] for s in report["summaries"]] == models
    for s in report["summaries"]:
        assert s["errors"] == 0 and s["completed"] == 4, s
    for r in report["requests"]:
        assert r["error"] is None and r["output_tokens"] == r["max_tokens"], r
        assert 0 < r["ttft"] <= r["e2e"]
        if r["system"] == "smollm2-baseline":  # answered when its whole batch is done
            assert r["batch"] and r["batch"]["size"] >= 1


def _stub_server(check=None):
    """A tiny in-process SSE server answering any POST like a streaming OpenAI completions
    endpoint. `check(path, headers, body)` returns True to accept a request (else 400). Returns
    (server, log): log holds every accepted (path, body) and the peak number of open requests."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    log = {"requests": [], "open": 0, "peak": 0}
    lock = threading.Lock()

    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if (
                check is not None
                and not check(self.path, self.headers, body)
                or not body.get("ignore_eos")
                or not body["stream"]
            ):
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with lock:
                log["requests"].append((self.path, body))
                log["open"] += 1
                log["peak"] = max(log["peak"], log["open"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(obj):
                data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            closed = []

            def close():
                with lock:
                    if not closed:
                        closed.append(True)
                        log["open"] -= 1

            try:
                for _ in range(body["max_tokens"]):
                    time.sleep(0.01)  # long enough for closed-loop clients to overlap
                    chunk({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
                # Closed before the client can read the end: it may send its next request at once,
                # before this thread runs again, and that must not count as one more open.
                close()
                chunk({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
            finally:
                close()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, log


def test_serve_bench_against_stub(tmp_path):
    """The load generator's client, sweep and report logic against a tiny in-process SSE server."""
    server, _ = _stub_server(lambda path, headers, body: headers.get("Authorization") == "Bearer k")
    try:
        out = tmp_path / "stub.json"
        doc = tmp_path / "doc.md"
        doc.write_text("# x\n<!-- serve-results:begin -->\nold\n<!-- serve-results:end -->\ntail\n")
        cmd = [
            *command("serve"),
            "--url",
            f"http://127.0.0.1:{server.server_address[1]}",
            "--key",
            "k",
            "--model",
            "a",
            "--model",
            "b",
            "--rates",
            "50,100",
            "--num-requests",
            "8",
            "--input-len",
            "4:8",
            "--output-len",
            "1:4",
            "--out",
            str(out),
            "--update-doc",
            str(doc),
            "--no-progress",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        server.shutdown()
    report = json.loads(out.read_text())
    assert len(report["summaries"]) == 4 and all(s["errors"] == 0 for s in report["summaries"])
    assert all(r["output_tokens"] == r["max_tokens"] for r in report["requests"])
    assert "$KEY" in report["command"] and " k " not in report["command"]
    assert report["verdict"]["errors"] == 0
    text = doc.read_text()
    assert "old" not in text and "| a | 50.0 |" in text and text.endswith("tail\n")


def test_serve_bench_openai_endpoint_closed_loop(tmp_path):
    """--endpoint drives any OpenAI completions URL (vLLM's server in benchmarks/peers/run.py):
    the URL as given, no Authorization header with `--key none` (even beside a key file), the
    body's `model` from --model-name, token-id prompts; a closed loop of --concurrency clients
    sends exactly --num-requests requests and never has more than that many open, after the
    --warmup-load requests, which are not recorded."""

    def check(path, headers, body):
        return (
            path == "/v1/completions"
            and "Authorization" not in headers
            and body.get("model") == "served"
            and all(isinstance(t, int) and 100 <= t < 200 for t in body["prompt"])
        )

    server, log = _stub_server(check)
    (tmp_path / "key_file.json").write_text(json.dumps({"inference": {"key": "ts-key"}}))
    try:
        out = tmp_path / "vllm.json"
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
        cmd = [
            *command("serve"),
            "--endpoint",
            endpoint,
            "--key",
            "none",
            "--model",
            "vllm-bf16",
            "--model-name",
            "served",
            "--concurrency",
            "3",
            "--num-requests",
            "10",
            "--input-len",
            "4:8",
            "--output-len",
            "4:12",
            "--token-range",
            "100:200",
            "--warmup",
            "1",
            "--warmup-load",
            "6",
            "--out",
            str(out),
            "--no-progress",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        server.shutdown()
    report = json.loads(out.read_text())
    # the warm-up request, the warm-up load (same clients, other prompts), then the measured ones
    assert len(log["requests"]) == 1 + 6 + 10
    warm = [body["prompt"] for _, body in log["requests"][1:7]]
    measured = [body["prompt"] for _, body in log["requests"][7:]]
    assert all(4 <= len(p) <= 8 for p in warm) and not set(map(tuple, warm)) & set(map(tuple, measured))
    assert 2 <= log["peak"] <= 3, log["peak"]
    [summary] = report["summaries"]
    assert summary["system"] == "vllm-bf16" and summary["concurrency"] == 3
    assert summary["completed"] == summary["requests"] == 10 and summary["errors"] == 0
    assert report["endpoints"] == {"vllm-bf16": endpoint} and report["model_name"] == "served"
    assert "closed loop, 3 clients, 10 requests" in report["workload"]["description"]
    assert all(r["output_tokens"] == r["max_tokens"] for r in report["requests"])
