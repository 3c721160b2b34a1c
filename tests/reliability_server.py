"""The TorchServe the reliability suites run against, and what they read from it (docs/reliability.md)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
from openai_http import EXACT, metric  # noqa: E402

from orcaserve.bench.serve.harness import REPO, TorchServe  # noqa: E402
from orcaserve.handler.archive import build  # noqa: E402
from orcaserve.scheduler import Engine, default_model_path  # noqa: E402

MODEL = "smollm2"
# EXACT: greedy answers match the offline engine to the token, through preemptions; a small cache
# keeps blocks visible.
ENGINE_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 32, "max_num_batched_tokens": 512, **EXACT}
SERVING = {"default_timeout": 120, "max_tokens_limit": 64}


def shipped_config() -> dict[str, str]:
    """config.properties as `make serve` uses it."""
    lines = (REPO / "config.properties").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def start_server(root: Path, faults: bool = True) -> TorchServe:
    """A TorchServe with the shipped security settings and the test archive registered."""
    store = root / "model-store"
    build("default", MODEL, str(store), fmt="default", overrides={**ENGINE_ARGS, **SERVING})
    env = {"ORCASERVE_TEST_FAULTS": "1"} if faults else {}
    ts = TorchServe(root / "work", store, extra_config={"allowed_urls": shipped_config()["allowed_urls"]}, env=env)
    ts.start()
    try:
        ts.register(f"{MODEL}.mar")
    except Exception:
        ts.stop()
        raise
    return ts


def offline_engine(**overrides) -> Engine:
    return Engine.from_pretrained(default_model_path(), **{**ENGINE_ARGS, "kv_cache_memory": 256 << 20, **overrides})


def serving_pid(ts: TorchServe, model: str = MODEL) -> int:
    """The process serving the model now: a replacement worker if one took over, else TorchServe's."""
    takeovers = [
        p
        for p in psutil.process_iter(["pid", "cmdline", "create_time"])
        if "orcaserve.handler.supervisor.takeover" in " ".join(p.info["cmdline"] or [])
        and f'"model_name": "{model}"' in " ".join(p.info["cmdline"] or [])
    ]
    if takeovers:
        return max(takeovers, key=lambda p: p.info["create_time"]).pid
    return ts.worker_pids(model)[0]


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def wait_idle(ts: TorchServe, model: str = MODEL, timeout: float = 120.0) -> dict:
    """Wait until the engine reports no running request and no KV block in use (via /metrics)."""
    deadline = time.time() + timeout
    while True:
        m = ts.metrics()
        used, running = metric(m, "orca_kv_blocks_used", model), metric(m, "orca_num_requests_running", model)
        if used == 0 and running == 0 or time.time() > deadline:
            return {"kv_blocks_used": used, "running": running}
        time.sleep(0.5)
