"""Start, call and stop a real TorchServe for tests and benchmarks.

    with TorchServe(tmp_path, model_store) as ts:        # free loopback ports, own TMPDIR
        ts.register("smollm2.mar")                      # management API, synchronous
        requests.post(ts.url("/predictions/smollm2/1.0/v1/completions"), json=..., headers=ts.auth())

Everything TorchServe writes (key_file.json, logs/, the pid file, Java temp files, extracted
archives) stays inside `workdir`. `stop()` kills the whole process group (frontend and workers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (bound together so they cannot repeat)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def shipped_vmargs() -> str:
    """The frontend's JVM flags of the repository's config.properties (docs/serving.md, "The
    frontend's JVM"): the benchmarks' and tests' servers run the frontend that `make serve` runs."""
    path = Path(__file__).resolve().parents[2] / "config.properties"
    lines = path.read_text().splitlines() if path.is_file() else []
    return next((line.partition("=")[2].strip() for line in lines if line.startswith("vmargs=")), "")


class TorchServeError(RuntimeError):
    pass


class TorchServe:
    """A TorchServe process on free loopback ports with a generated config.properties."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        model_store: str | os.PathLike,
        extra_config: dict[str, str] | None = None,
        token_auth: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.model_store = Path(model_store).resolve()
        self.extra_config = dict(extra_config or {})
        self.env = dict(env or {})  # extra environment for the frontend and its workers
        self.token_auth = token_auth
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.keys: dict[str, str] = {}

    # ---- lifecycle ---------------------------------------------------------------------------
    def write_config(self) -> Path:
        inf, mgmt, met, grpc_inf, grpc_mgmt = free_ports(5)
        self.ports = {"inference": inf, "management": mgmt, "metrics": met}
        lines = {
            # Two servers on one machine collide on gRPC's default ports and on worker sockets in
            # Java's temp dir (TMPDIR does not move java.io.tmpdir), so isolate both.
            "grpc_inference_port": str(grpc_inf),
            "grpc_management_port": str(grpc_mgmt),
            "vmargs": f"{shipped_vmargs()} -Xmx1g -XX:+ExitOnOutOfMemoryError -Djava.io.tmpdir={self.workdir / 'tmp'}",
            "inference_address": f"http://127.0.0.1:{inf}",
            "management_address": f"http://127.0.0.1:{mgmt}",
            "metrics_address": f"http://127.0.0.1:{met}",
            "model_store": str(self.model_store),
            "metrics_mode": "prometheus",
            "model_metrics_auto_detect": "true",
            "enable_model_api": "true",
            "allowed_urls": f"file://{self.model_store}/[^/?#]+",
            "default_workers_per_model": "1",
            "install_py_dep_per_model": "false",
        }
        if not self.token_auth:
            lines["disable_token_authorization"] = "true"
        lines.update(self.extra_config)
        path = self.workdir / "config.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        return path

    def start(self, timeout: float = 120.0) -> TorchServe:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        config = self.write_config()
        # A key file left by an earlier server in this workdir would be read before the new one is
        # written: its stale token answers every /ping with 400 until the timeout.
        (self.workdir / "key_file.json").unlink(missing_ok=True)
        self.keys = {}
        env = dict(
            os.environ,
            TMPDIR=str(tmp),
            LOG_LOCATION=str(self.workdir / "logs"),
            METRICS_LOCATION=str(self.workdir / "logs"),
            **self.env,
        )
        torchserve = str(Path(sys.executable).parent / "torchserve")
        cmd = [torchserve, "--start", "--foreground", "--ncs", "--ts-config", str(config)]
        cmd += ["--model-store", str(self.model_store)]
        self._stdout = open(self.workdir / "torchserve.out", "wb")
        # Own session: stop() signals the group, which holds the frontend JVM and all workers.
        self.proc = subprocess.Popen(
            cmd, cwd=self.workdir, env=env, stdout=self._stdout, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_ready(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise TorchServeError(f"torchserve exited with {self.proc.returncode}\n{self.logs()}")
            if self.token_auth and not self.keys:
                self._read_keys()
            if self.keys or not self.token_auth:
                try:
                    r = requests.get(self.url("/ping"), headers=self.auth(), timeout=2)
                    if r.status_code == 200:
                        return
                except requests.RequestException:
                    pass
            time.sleep(0.3)
        raise TorchServeError(f"torchserve not ready after {timeout} s\n{self.logs()}")

    def _read_keys(self) -> None:
        try:
            data = json.loads((self.workdir / "key_file.json").read_text())
        except (OSError, ValueError):
            return
        self.keys = {kind: data[kind]["key"] for kind in ("management", "inference", "API") if kind in data}

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                # The JVM may exit before its workers: make sure nothing of the group survives.
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        self.proc = None
        self._stdout.close()

    def __enter__(self) -> TorchServe:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- calls -------------------------------------------------------------------------------
    def url(self, path: str, api: str = "inference") -> str:
        return f"http://127.0.0.1:{self.ports[api]}{path}"

    def auth(self, api: str = "inference") -> dict[str, str]:
        key = self.keys.get(api)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def register(self, url: str, initial_workers: int = 1, timeout: float = 600.0) -> requests.Response:
        r = requests.post(
            self.url("/models", "management"),
            headers=self.auth("management"),
            timeout=timeout,
            params={"url": url, "initial_workers": str(initial_workers), "synchronous": "true"},
        )
        if r.status_code != 200:
            raise TorchServeError(f"register {url}: {r.status_code} {r.text}\n{self.logs()}")
        return r

    def unregister(self, name: str, timeout: float = 120.0) -> requests.Response:
        return requests.delete(
            self.url(f"/models/{name}", "management"), headers=self.auth("management"), timeout=timeout
        )

    def scale(self, name: str, workers: int, timeout: float = 600.0) -> requests.Response:
        return requests.put(
            self.url(f"/models/{name}", "management"),
            headers=self.auth("management"),
            timeout=timeout,
            params={"min_worker": str(workers), "max_worker": str(workers), "synchronous": "true"},
        )

    def worker_pids(self, name: str) -> list[int]:
        r = requests.get(self.url(f"/models/{name}", "management"), headers=self.auth("management"), timeout=30)
        r.raise_for_status()
        return [int(w["pid"]) for m in r.json() for w in m.get("workers", []) if w.get("pid")]

    def metrics(self) -> str:
        r = requests.get(self.url("/metrics", "metrics"), headers=self.auth("inference"), timeout=30)
        r.raise_for_status()
        return r.text

    def logs(self, tail: int = 6000) -> str:
        """The end of every log TorchServe wrote (for failure messages)."""
        parts = []
        for path in [self.workdir / "torchserve.out", *sorted((self.workdir / "logs").glob("*.log"))]:
            if path.exists():
                text = path.read_text(errors="replace")
                parts.append(f"==== {path.name} ====\n{text[-tail:]}")
        return "\n".join(parts)


@contextmanager
def serving(
    root: Path, model: str, overrides: dict, extra_config: dict[str, str] | None = None
) -> Iterator[TorchServe]:
    """A TorchServe under `root` with the default model archived as `model` (with `overrides` of
    its `handler:` section) and registered; its log is printed if start-up or a test fails.
    `extra_config`: config.properties entries of this server."""
    from orcaserve.handler.archive import build

    store = root / "model-store"
    build("default", model, str(store), fmt="default", overrides=overrides)
    with registered(TorchServe(root / "work", store, extra_config=extra_config), [f"{model}.mar"]) as server:
        yield server


@contextmanager
def registered(server: TorchServe, archives: list[str]) -> Iterator[TorchServe]:
    """`server` started with `archives` registered, stopped after; its log is printed if start-up
    or a test fails."""
    server.start()
    try:
        for archive in archives:
            started = time.time()
            server.register(archive)
            print(f"registration of {archive} took {time.time() - started:.1f} s")
        yield server
    except Exception:
        print(server.logs())
        raise
    finally:
        server.stop()
