"""A request whose LoRA adapter can take no slot (every slot holds an adapter a running request
uses) keeps its place in the waiting queue and lets the requests behind it pass: the base model's
and those of adapters already stacked (docs/lora.md "More adapters than a step holds"). Requests
behind it that would need a slot of their own wait too, so the first slot freed goes to the
earliest waiting adapter request: nobody starves."""

from __future__ import annotations

import pytest
from test_fair_share import step as fake_model_step

from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.lora.slots import LoraSlots
from orcaserve.scheduler.sampling_params import SamplingParams


def req(rid: str, lora: str | None, max_tokens: int = 4, priority: int = 0, tenant: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(
        EngineRequest(rid, [1, 2, 3, 4], params, arrival_time=0.0, lora=lora, priority=priority, tenant=tenant)
    )


def step(s: Scheduler) -> list[str]:
    """One step with a fake model; the ids given rows, in batch order."""
    return list(fake_model_step(s).num_scheduled_tokens)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_blocked_adapter_request_lets_the_others_pass_and_keeps_its_place(policy):
    slots = LoraSlots(1)
    s = Scheduler(KVCacheManager(64, 4), 8, 256, policy, lora_slots=slots)
    s.add_request(req("a1", "a", max_tokens=3))  # takes the one slot and holds it while it runs
    assert step(s) == ["a1"]
    for r in (req("b1", "b"), req("base1", None), req("a2", "a"), req("c1", "c"), req("base2", None)):
        s.add_request(r)
    # "b1" and "c1" can take no slot: the base requests and "a2" (its adapter stacked) pass them.
    assert step(s) == ["a1", "base1", "a2", "base2"]
    assert slots.names == ["a"] and [r.request_id for r in _waiting(s)] == ["b1", "c1"]
    while "a" in {r.lora for r in s.running.values()}:
        ran = step(s)
        assert "b1" not in ran and "c1" not in ran
    # The slot is free of running requests: the earliest waiting adapter request ("b1") takes it,
    # "c1" (later, another adapter) keeps waiting behind it.
    assert "b1" in step(s) and slots.names == ["b"] and "c1" not in s.running
    while s.has_unfinished():
        step(s)
    assert slots.names == ["c"] and slots.num_evictions == 2


def test_a_request_of_a_stacked_adapter_behind_a_blocked_one_still_runs():
    """Two slots: "b1" waits for one, "a2" behind it (stacked) runs; when a slot frees, "b1" takes
    it and "c1", which would need one too, keeps waiting behind it."""
    slots = LoraSlots(2)
    s = Scheduler(KVCacheManager(64, 4), 8, 256, "fcfs", lora_slots=slots)
    s.add_request(req("a1", "a", max_tokens=6))
    s.add_request(req("x1", "x", max_tokens=2))
    step(s)
    for r in (req("b1", "b"), req("a2", "a"), req("c1", "c")):
        s.add_request(r)
    assert step(s) == ["a1", "x1", "a2"]
    assert step(s) == ["a1", "a2", "b1"]  # "x1" finished: "b1", the earliest, took its slot
    assert slots.names == ["a", "b"] and [r.request_id for r in _waiting(s)] == ["c1"]


def test_fair_a_blocked_adapter_request_lets_other_tenants_pass():
    """Under `fair` the tenant whose next request's adapter can take no slot is skipped for the
    step (its own later requests wait behind it, in its order); the other tenants are admitted."""
    slots = LoraSlots(1)
    s = Scheduler(KVCacheManager(64, 4), 8, 256, "fair", lora_slots=slots)
    s.add_request(req("heavy", None, max_tokens=2, tenant="t2"))  # t2's counter above t1's from here on
    while s.has_unfinished():
        step(s)
    s.add_request(req("a1", "a", max_tokens=8, tenant="t0"))  # holds the one slot while it runs
    step(s)
    s.add_request(req("b1", "b", tenant="t1"))  # t1: the smallest counter, its adapter blocked
    s.add_request(req("base1", None, tenant="t2"))
    assert step(s) == ["a1", "base1"]
    assert [r.request_id for r in _waiting(s)] == ["b1"]
    while "a" in {r.lora for r in s.running.values()}:
        assert "b1" not in step(s)
    assert "b1" in step(s) and slots.names == ["b"]


def _waiting(s: Scheduler) -> list[Request]:
    return [r for r in s.requests.values() if r.request_id not in s.running]
