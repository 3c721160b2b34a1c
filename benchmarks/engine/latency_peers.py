"""The peers of `orcaserve-bench latency` over HTTP, on the same model: llama.cpp's server on the
GGUF file (one slot per stream: `-np 1` at one stream) and vLLM's OpenAI server on the model's HF
directory (benchmarks/peers/models.py). Each is started with the peers' own launchers
(benchmarks/peers/parts.py) where its install exists; otherwise the reason it is skipped."""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path


def _llamacpp(model: str, streams: int, port: int) -> tuple[list[str], dict]:
    from orcaserve.bench.peers.llamacpp import BIN, llamacpp_env

    if not model.endswith(".gguf"):
        raise SystemExit("llama.cpp serves a .gguf file: pass --model FILE.gguf")
    env = llamacpp_env()  # SystemExit where it is not set up
    threads = len(os.sched_getaffinity(0))
    flags = f"-np {streams} -c {streams * 1024} -t {threads} --host 127.0.0.1 --port {port} --no-ui"
    return [str(BIN / "llama-server"), "-m", model, *flags.split()], env


def _vllm(model: str, streams: int, port: int) -> tuple[list[str], dict]:
    from orcaserve.bench.peers.models import MODELS
    from orcaserve.bench.peers.parts import vllm_env, vllm_server_cmd

    env = vllm_env()  # SystemExit where it is not set up
    peer = next((m for m in MODELS.values() if m.gguf_path() == model or str(m.hf_dir) == model), None)
    if peer is None or not peer.hf_dir.exists():
        raise SystemExit(f"no HF directory for {model} (benchmarks/peers/models.py prepares the peers' models)")
    return vllm_server_cmd(peer.hf_dir, "latency", port, "bfloat16", 0, "--max-num-seqs", str(streams)), env


def _send(url: str, output_len: int, served: str | None, prompts: list[list[int]]) -> dict:
    from orcaserve.bench.engine.latency import http_point

    return http_point(url, None, prompts, output_len, served)


PEERS = {"llamacpp": (_llamacpp, "/health", None), "vllm": (_vllm, "/v1/models", "latency")}


def peer_rows(name: str, model: str, streams: list[int], args, vocab: int) -> tuple[list[dict] | None, str]:
    """(the rows of each stream count, "") or (None, why it was skipped)."""
    from orcaserve.bench.engine.latency import _points
    from orcaserve.bench.peers.parts import running
    from orcaserve.bench.serve.harness import free_ports

    if name not in PEERS:
        return None, f"unknown peer (one of {', '.join(PEERS)})"
    launch, ready, served = PEERS[name]
    work = Path(tempfile.mkdtemp(prefix=f"orcaserve-latency-{name}-"))
    rows = []
    for n in streams:  # a server per stream count: its slots are its streams
        [port] = free_ports(1)
        try:
            cmd, env = launch(model, n, port)
        except SystemExit as e:
            return None, str(e)
        with running(f"{name}-{n}", cmd, env, port, ready, work, timeout=900):
            url = f"http://127.0.0.1:{port}/v1/completions"
            rows += _points(partial(_send, url, args.output_len, served), [n], args, vocab)
    return rows, ""
