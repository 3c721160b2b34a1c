"""Latency classes over the handler: the class a gateway's header or the tenant's default names,
a 400 naming an unknown class, and the 503 with Retry-After for a request its class refuses
(docs/latency-targets.md)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_orca_handler import make_backend  # noqa: F401  (the fixture)

from orcaserve.handler.config import HandlerConfig
from orcaserve.scheduler.core.slo_class import check_slo_classes

CLASSES = {"now": {"ttft_ms": 0.001, "slo_reject": True}, "fine": {"ttft_ms": 600000, "tpot_ms": 600000}}


def test_unknown_class_400_and_refused_class_503(make_backend):  # noqa: F811
    backend = make_backend(
        slo_class_header="X-Slo-Class", tenant_header="X-Tenant-Id", tenant_slo_class={"acme": "fine"}
    )
    backend.engine.slo_classes = check_slo_classes(CLASSES)  # before any request reaches the loop

    async def run():
        tenant = {"X-Tenant-Id": "acme"}
        await asyncio.gather(
            backend.request("unknown", {"prompt": [5, 6], "max_tokens": 2}, headers={**tenant, "X-Slo-Class": "gold"}),
            backend.request("refused", {"prompt": [5, 6], "max_tokens": 2}, headers={**tenant, "x-slo-class": "now"}),
            backend.request("default", {"prompt": [5, 6], "max_tokens": 3}, headers=tenant),
        )

    asyncio.run(run())
    frames = backend.frames()
    unknown = frames["unknown"][0]
    assert unknown["status"] == 400
    error = json.loads(unknown["body"])["error"]
    assert "'gold'" in error["message"] and error["param"] == "slo_class"
    refused = frames["refused"][0]
    assert refused["status"] == 503 and refused["headers"]["Retry-After"] == "1"
    assert frames["default"][0]["status"] == 200
    counts = backend.engine.stats.slo  # the loop thread is idle: every request answered
    assert counts["now"].rejected == 1 and counts["fine"].requests == counts["fine"].good == 1


def test_tenant_slo_class_must_name_a_class():
    section = {"model_path": "/m", "slo_classes": {"interactive": {"tpot_ms": 100}}}
    cfg = HandlerConfig.from_dict(
        {**section, "slo_class_header": "X-Slo-Class", "tenant_slo_class": {"a": "interactive"}}
    )
    assert cfg.slo_class_header == "X-Slo-Class" and cfg.tenant_slo_class == {"a": "interactive"}
    with pytest.raises(ValueError, match="tenant_slo_class"):
        HandlerConfig.from_dict({**section, "tenant_slo_class": {"a": "gold"}})
    with pytest.raises(ValueError, match="slo_class_header"):
        HandlerConfig.from_dict({**section, "slo_class_header": "bad header"})
