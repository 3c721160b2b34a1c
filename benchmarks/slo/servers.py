"""The servers `orcaserve-bench slo-http` (benchmarks/slo/over_http.py) drives, each a context manager
that starts it, says how a request of a class is marked, and stops it whole: orcaserve inside a
fresh TorchServe (serve_local.torchserve), vLLM's OpenAI server from its own venv (peers/parts.py
`running`). Both run with slo.ENGINE_ARGS (the peers' limits, bf16), prefix caching off."""

from __future__ import annotations

import argparse
import shlex
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

from orcaserve.bench.serve.harness import free_ports
from orcaserve.bench.serve.local import orcaserve_archive, torchserve
from orcaserve.bench.slo.slo import ENGINE_ARGS

CLASS_HEADER, TENANT_HEADER = "X-Slo-Class", "X-Tenant-Id"
MODEL = "smollm2"


class Server(Protocol):
    """A started server (a context manager): its completions URL, and what marks a request of a
    class: `request_for(cls, classes)` -> (headers, extra body fields) of a request of class `cls`
    ("interactive" or "batch"; `classes` False: the run without them)."""

    LABEL: str
    url: str
    model_name: str | None

    def request_for(self, cls: str, classes: bool) -> tuple[dict, dict | None]: ...

    def label(self, classes: bool) -> str: ...

    def describe(self) -> dict: ...


class Orcaserve:
    """The default model (SmolLM2's GGUF, served in bf16) archived with two classes: `interactive`
    with the targets, `batch` without. A request names its class in the class header; under
    `fair` each class is a tenant instead (the tenant header), and `tenant_slo_class` gives the
    interactive tenant its class."""

    LABEL = "orcaserve+slo"
    model_name = None

    def __init__(
        self, args: argparse.Namespace, targets: dict, work: Path, model: str = "default", engine: dict | None = None
    ) -> None:
        """`model`, `engine`: what the archive serves and its engine arguments (tests: a tiny model)."""
        self.policy, self.model = args.policy, model
        self.overrides: dict = {
            **(ENGINE_ARGS if engine is None else engine),
            "enable_prefix_caching": False,
            "scheduling_policy": args.policy,
            "slo_classes": {"interactive": {"ttft_ms": targets["ttft_ms"], "tpot_ms": targets["tpot_ms"]}, "batch": {}},
            "default_timeout": args.timeout,
        }
        if args.threads:
            self.overrides["num_threads"] = args.threads
        self.overrides["slo_class_header"] = CLASS_HEADER
        if args.policy == "fair":  # each class a tenant; the interactive one's class is its tenant's
            self.overrides.update(tenant_header=TENANT_HEADER, tenant_slo_class={"interactive": "interactive"})
        self.root = work / f"orcaserve-{args.policy}"
        self.timeout = args.server_timeout
        self._stack = ExitStack()

    def __enter__(self) -> Orcaserve:
        orcaserve_archive(self.root, MODEL, self.overrides, self.model)
        t = time.perf_counter()
        self.ts = self._stack.enter_context(torchserve(self.root, [MODEL]))
        self.startup_s = time.perf_counter() - t
        self.url = self.ts.url(f"/predictions/{MODEL}/1.0/v1/completions")
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def request_for(self, cls: str, classes: bool) -> tuple[dict, dict | None]:
        headers = dict(self.ts.auth())
        if self.policy == "fair":  # each class is a tenant; without classes, tenants without one
            headers[TENANT_HEADER] = cls if classes else f"{cls}-plain"
        elif classes:
            headers[CLASS_HEADER] = cls
        return headers, None

    def label(self, classes: bool) -> str:
        return self.LABEL if classes else f"orcaserve-{self.policy}"

    def describe(self) -> dict:
        return {"overrides": self.overrides, "startup_s": round(self.startup_s, 1)}


class Vllm:
    """vLLM's OpenAI server, `--scheduling-policy priority`, the same limits; the interactive
    requests' `priority` 0, the flood's 1."""

    LABEL = "vllm+priority"

    def __init__(self, args: argparse.Namespace, targets: dict, work: Path) -> None:
        from orcaserve.bench.peers.models import MODELS, prepare
        from orcaserve.bench.peers.parts import vllm_env, vllm_server_cmd

        self.env = vllm_env()  # fails early when setup_vllm.sh has not run
        model = MODELS["smollm2"]
        prepare(model, ["vllm"], ["bf16"], work)  # the HF conversion vLLM reads, made once
        [self.port] = free_ports(1)
        policy = ["--scheduling-policy", "priority", "--no-enable-prefix-caching"]
        self.cmd = vllm_server_cmd(model.hf_dir, MODEL, self.port, "bfloat16", 0, *policy)
        self.model_name = MODEL
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"
        self.work, self.timeout = work, args.server_timeout
        self._stack = ExitStack()

    def __enter__(self) -> Vllm:
        from orcaserve.bench.peers.parts import running

        server = running("vllm", self.cmd, self.env, self.port, "/v1/models", self.work, self.timeout)
        self.startup_s = self._stack.enter_context(server).startup_s
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def request_for(self, cls: str, classes: bool) -> tuple[dict, dict | None]:
        return {}, {"priority": (0 if cls == "interactive" else 1) if classes else 0}

    def label(self, classes: bool) -> str:
        return self.LABEL if classes else "vllm"

    def describe(self) -> dict:
        return {"command": shlex.join(self.cmd[1:]), "startup_s": round(self.startup_s, 1)}


SERVERS: dict[str, type] = {"orcaserve": Orcaserve, "vllm": Vllm}
