"""The serving benchmark (benchmarks/serve.py): a smoke run against a live TorchServe (slow), and
its client and report logic against an in-process stub server (fast).

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
from pathlib import Path

import pytest

from torchserve_harness import TorchServe

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / "benchmarks" / "serve.py"


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    from orcaserve.handler.baseline_archive import build_archive

    store = tmp_path / "model-store"
    build_archive(str(store), "smollm2-baseline")
    models = ["smollm2-baseline"]
    if importlib.util.find_spec("orcaserve.handler.archive") is not None:
        subprocess.run([sys.executable, "-m", "orcaserve.handler.archive", "--name", "smollm2", "--export-path",
                        str(store), "--format", "no-archive"], check=True)
        models.insert(0, "smollm2")
    work = tmp_path / "ts"
    with TorchServe(work, store, extra_config={"job_queue_size": "1000"}) as ts:  # bursts queue
        for name in models:
            ts.register(name)
        out = tmp_path / "bench.json"
        cmd = [sys.executable, str(SERVE), "--url", ts.url(""), f"--key={ts.keys['inference']}", "--rate", "4",  # keys may start with "-"
               "--num-requests", "4", "--input-len", "8:32", "--output-len", "2:6", "--warmup", "1",
               "--timeout", "120", "--out", str(out), "--no-progress"]
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


def test_serve_bench_against_stub(tmp_path):
    """The load generator's client, sweep and report logic against a tiny in-process SSE server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.headers.get("Authorization") != "Bearer k" or not body.get("ignore_eos") or not body["stream"]:
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(obj):
                data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            for _ in range(body["max_tokens"]):
                chunk({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
            chunk({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "stub.json"
        doc = tmp_path / "doc.md"
        doc.write_text("# x\n<!-- serve-results:begin -->\nold\n<!-- serve-results:end -->\ntail\n")
        cmd = [sys.executable, str(SERVE), "--url", f"http://127.0.0.1:{server.server_address[1]}", "--key", "k",
               "--model", "a", "--model", "b", "--rates", "50,100", "--num-requests", "8", "--input-len", "4:8",
               "--output-len", "1:4", "--out", str(out), "--update-doc", str(doc), "--no-progress"]
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
