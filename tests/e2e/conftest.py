"""Fixtures the end-to-end suites share: one real TorchServe per distinct configuration, started
once for the suites that only read from it (a server start and a model load are the slow part),
and the offline engine their answers are held to. Package scope: stopped after the last test of
tests/e2e. A suite that needs its own configuration, or kills or unregisters a worker, starts its
own server or registers its own archive on the shared one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai_http import MAX_RESPONSE_SIZE, SHARED_ARGS, SHARED_MODEL, SHARED_SERVING

from orcaserve.bench.serve.harness import TorchServe, serving
from orcaserve.scheduler import Engine, default_model_path


@pytest.fixture(scope="package")
def shared_ts(tmp_path_factory) -> Iterator[TorchServe]:
    """The default model served as SHARED_MODEL with SHARED_ARGS. Tests read from it: they send
    requests and read metrics as deltas; nothing scales, kills or unregisters its worker."""
    with serving(
        tmp_path_factory.mktemp("torchserve-shared"),
        SHARED_MODEL,
        {**SHARED_ARGS, **SHARED_SERVING},
        {"max_response_size": str(MAX_RESPONSE_SIZE)},
    ) as server:
        yield server


@pytest.fixture(scope="package")
def shared_engine() -> Engine:
    """The offline engine with the shared server's engine arguments (use `offline`)."""
    return Engine.from_pretrained(default_model_path(), **SHARED_ARGS)


@pytest.fixture(scope="module")
def offline(shared_engine) -> Iterator[Engine]:
    """The shared offline engine, run on one intra-op thread while a module uses it: beside the
    server's worker on a small shared machine, two OpenMP threads that spin-wait for a busy core
    make generation 20x slower, not faster."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield shared_engine
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def registered_archive(shared_ts) -> Iterator[object]:
    """register(name, source, overrides): an archive of `source` ("default" or a model directory)
    built into the shared server's store and registered there; unregistered after the module."""
    from orcaserve.handler.archive import build

    names: list[str] = []

    def register(name: str, source: str, overrides: dict) -> str:
        build(source, name, str(shared_ts.model_store), overrides=overrides)
        shared_ts.register(f"{name}.mar")
        names.append(name)
        return name

    yield register
    for name in names:
        shared_ts.unregister(name)  # a 404 where a test unregistered it already
