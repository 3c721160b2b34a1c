"""A peer's OpenAI-compatible server for as long as a `with` block runs: started in its own
process group in a scratch folder, waited for until a URL answers 200, stopped whole after."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from orcaserve.bench.peers.parts import log, stop_group


@contextmanager
def running(cmd: list[str], env: dict, ready_url: str, logfile: Path, timeout: float) -> Iterator[float]:
    """Yields the seconds start-up took. Runs in `logfile`'s folder, never the repository root
    (parts.run_logged says why)."""
    log("$ " + shlex.join(cmd) + f"   (log: {logfile})")
    t = time.perf_counter()
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=logfile.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while True:  # start-up compiles (vLLM) or loads: minutes on a busy machine
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {logfile.read_text(errors='replace')[-1500:]}")
            if time.perf_counter() - t > timeout:
                raise RuntimeError(f"server not up after {timeout} s (log: {logfile})")
            try:
                if requests.get(ready_url, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        yield time.perf_counter() - t
    finally:
        stop_group(proc)
