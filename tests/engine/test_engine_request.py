"""One request object end to end: `EngineRequest` is frozen and checked, and what it carries (a
field added to it included) reaches the scheduler's `Request` from the offline API, the engine
loop and the OpenAI parser, with no signature in between changed."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.handler.config import HandlerConfig
from orcaserve.handler.openai.protocol import COMPLETIONS, parse_request
from orcaserve.handler.openai.tenancy import derive_cache_salt, with_tenancy
from orcaserve.scheduler import EngineLoop, EngineRequest, InvalidRequest, SamplingParams
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.slo_class import check_slo_classes

CLASSES = {"interactive": {"ttft_ms": 60_000, "tpot_ms": 60_000}}


@dataclasses.dataclass(frozen=True, eq=False)
class WithAdapter(EngineRequest):
    """A field the engine does not know yet (an adapter's name): only the object and its reader change."""

    adapter: str | None = None


def test_the_request_is_frozen_and_checked_at_construction():
    req = EngineRequest("a", [5, 6], SamplingParams(max_tokens=2), priority=3, tenant="t", slo_class="interactive")
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.priority = 0  # type: ignore[misc]
    with pytest.raises(TypeError):  # past the parameters, every field is by keyword
        EngineRequest("a", [5], SamplingParams(), 3)  # type: ignore[misc]
    for field, bad in (("priority", True), ("priority", 1.5), ("timeout", -1.0), ("timeout", float("nan"))):
        with pytest.raises(InvalidRequest) as e:
            EngineRequest("a", [5], **{field: bad})
        assert e.value.param == field
    for field in ("cache_salt", "tenant", "slo_class"):
        with pytest.raises(InvalidRequest) as e:
            EngineRequest("a", [5], **{field: b"x"})
        assert e.value.param == field
    with pytest.raises(TypeError, match="token ids"):  # the engine tokenizes before it builds a Request
        Request(EngineRequest("a", "text"))


def test_every_field_reaches_the_request_offline(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=32, slo_classes=CLASSES)
    asked = WithAdapter(
        "a", [5, 6, 7], SamplingParams(max_tokens=2, n=2), priority=2, tenant="t", cache_salt="s", adapter="lora-1"
    )
    engine.add_request(asked)
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=2), tenant="u", slo_class="interactive")  # offline form
    reqs = {r.request_id: r for r in engine.scheduler.requests.values()}
    first = reqs["a#0"]  # choice 0 is scheduled; choice 1 waits for the prompt's blocks
    assert isinstance(first.engine_request, WithAdapter) and first.engine_request.adapter == "lora-1"
    assert (first.priority, first.tenant, first.cache_salt) == (2, "t", "s")
    assert first.engine_request.prompt == [5, 6, 7] and first.engine_request.arrival_time is not None
    assert asked.prompt == [5, 6, 7] and asked.arrival_time is None  # the caller's object is untouched
    b = reqs["b"]
    assert (
        b.tenant == "u" and b.slo is engine.slo_classes["interactive"] and b.engine_request.slo_class == "interactive"
    )
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(TypeError):
        engine.add_request(asked, [1])  # an object, or an id with a prompt: not both


def test_every_field_reaches_the_request_through_the_loop(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=32)
    engine.slo_classes = check_slo_classes(CLASSES)
    seen: list[EngineRequest] = []
    lock = threading.Lock()

    def hook(sched) -> None:  # on the engine thread, before the model runs
        with lock:
            seen.extend(r.engine_request for r in sched.requests.values())

    engine.fault_hook = hook
    loop = EngineLoop(engine).start()
    try:
        asked = WithAdapter(
            "x", (5, 6, 7), SamplingParams(max_tokens=2), tenant="t", slo_class="interactive", adapter="lora-2"
        )
        outs = list(loop.submit(asked))
        assert outs[-1].finished and outs[-1].error is None
    finally:
        loop.shutdown()
    got = seen[0]
    assert isinstance(got, WithAdapter) and got.adapter == "lora-2" and got.tenant == "t"
    assert got.slo_class == "interactive" and got.prompt == [5, 6, 7]  # admitted: its ids


def test_the_parser_builds_the_request_and_tenancy_completes_it():
    parsed = parse_request(
        {"prompt": [5, 6], "priority": 4, "timeout": 3, "cache_salt": "mine"}, COMPLETIONS, 10.0, request_id="r1"
    )
    req = parsed.request
    assert (req.request_id, req.prompt, req.priority, req.timeout) == ("r1", [5, 6], 4, 3)
    assert req.cache_salt is None and parsed.cache_salt == "mine"  # the client's salt is not the engine's
    cfg = HandlerConfig.from_dict(
        {
            "model_path": "/m",
            "tenant_header": "X-Tenant",
            "slo_class_header": "X-Class",
            "slo_classes": {"batch": {}, "interactive": {"tpot_ms": 100}},
            "tenant_slo_class": {"acme": "batch"},
        }
    )
    served = with_tenancy(parsed, {"x-tenant": "acme"}, cfg)
    assert served.tenant == "acme" and served.slo_class == "batch"
    assert served.cache_salt == derive_cache_salt("X-Tenant", {"x-tenant": "acme"}, "mine")
    assert with_tenancy(parsed, {"X-Tenant": "acme", "X-Class": "interactive"}, cfg).slo_class == "interactive"
    assert (served.request_id, served.prompt, served.priority) == ("r1", [5, 6], 4)
