"""llama.cpp's server as the third peer (benchmarks/peers/setup_llamacpp.sh builds it): the same
HTTP load as the other systems, on the GGUF file itself. Its settings mirror ENGINE_LIMITS: 32
parallel slots of 1,024 tokens (`-np 32 -c 32768`), 512-token batches, continuous batching (on by
default), one thread per core. Recipe and trap: docs/peers.md "llama.cpp recipe"."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import requests

from orcaserve.bench.peers.parts import ENGINE_LIMITS, HERE, running, serve_and_load

BIN = HERE / ".llamacpp" / "bin"


def llamacpp_env() -> dict:
    if not (BIN / "llama-server").exists():
        raise SystemExit("peers: llama.cpp is not set up: run benchmarks/peers/setup_llamacpp.sh first")
    env = dict(os.environ)
    # The build's RUNPATH names its build folder; the copy keeps its libraries beside the binary.
    env["LD_LIBRARY_PATH"] = ":".join([str(BIN)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    return env


def server_command(gguf: str, port: int, threads: int) -> list[str]:
    seqs, batch, ctx = (ENGINE_LIMITS[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    flags = f"-np {seqs} -c {seqs * ctx} -t {threads} -b {batch} -ub {batch} --host 127.0.0.1 --port {port} --no-ui"
    return [str(BIN / "llama-server"), "-m", gguf, *flags.split()]


def llamacpp_http(args, model, dtype: str, work: Path) -> dict:
    """Only the `gguf` cell: llama.cpp serves the file's own quantized weights."""
    if dtype != "gguf":
        raise ValueError("llama.cpp runs the gguf cell only (the file's own weights)")
    from orcaserve.bench.serve.harness import free_ports

    [port] = free_ports(1)
    cmd = server_command(model.gguf_path(), port, len(os.sched_getaffinity(0)))
    return serve_and_load(args, f"llamacpp-{model.name}-gguf", cmd, llamacpp_env(), port, "/health", model.name, work)


def greedy_next(gguf: str, prefixes: list[list[int]]) -> list[int]:
    """llama.cpp's greedy next token after each prefix (token ids as they are, BOS included), from
    its server's /completion (one token, temperature 0, its top-1 log-probability, the prompt's
    cache reused): what
    `orcaserve-bench quality --llamacpp` compares with the fp32 model's top-1."""
    from orcaserve.bench.serve.harness import free_ports

    [port] = free_ports(1)
    work = Path(tempfile.mkdtemp(prefix="orcaserve-llamacpp."))
    cmd = server_command(gguf, port, len(os.sched_getaffinity(0)))
    with running("llamacpp-quality", cmd, llamacpp_env(), port, "/health", work, timeout=600):
        out = []
        for ids in prefixes:
            # n_probs: the most likely token of the raw distribution (EOS too, which ends a completion)
            body = {"prompt": ids, "n_predict": 1, "temperature": 0, "n_probs": 1, "cache_prompt": True}
            r = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=300)
            r.raise_for_status()
            out.append(r.json()["completion_probabilities"][0]["top_logprobs"][0]["id"])
    return out
