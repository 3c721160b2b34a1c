"""Latency targets in the scheduler, on CPU without a model: the step-cost model's fit, and
steps planned with a known cost model on a simulated clock (docs/latency-targets.md)."""

from __future__ import annotations

import random

import pytest

from orcaserve.scheduler.core import scheduler as scheduler_module
from orcaserve.scheduler.core.fair_share import TenantShares, vtc_bound
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.core.slo_budget import tpot_slack
from orcaserve.scheduler.core.slo_class import SloClass, check_slo_classes
from orcaserve.scheduler.core.step_cost import StepCostModel, StepShape
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.sampling_params import SamplingParams

# A step of this machine's shape: 10 ms, 0.7 ms per prompt token, 0.5 ms per decode row, 0.2 ms
# per thousand token pairs of attention.
TRUE = [0.010, 0.0007, 0.0005, 0.0002]
INTERACTIVE = SloClass("interactive", ttft_ms=400.0, tpot_ms=60.0)


def true_time(shape: StepShape) -> float:
    return sum(c * x for c, x in zip(TRUE, shape.row()))


def test_the_cost_model_fits_recorded_steps():
    rng = random.Random(0)
    model = StepCostModel(window=128, refresh=4, warm=8)
    shapes = [StepShape(rng.choice([0, 0, 48, 240, 496]), rng.randint(1, 32), rng.uniform(0, 300)) for _ in range(200)]
    for i, shape in enumerate(shapes):
        if i < 7:
            assert model.predict(shape) is None  # before the warm start: no model
        model.observe(shape, true_time(shape) * rng.uniform(0.97, 1.03))
    assert model.coefficients is not None
    for got, want in zip(model.coefficients, TRUE):
        assert got == pytest.approx(want, rel=0.15, abs=2e-4)
    assert model.relative_error is not None and model.relative_error < 0.05
    assert all(c >= 0 for c in model.coefficients)


def test_decode_only_steps_leave_the_prompt_coefficient_at_zero():
    model = StepCostModel(warm=4)
    for d in range(1, 20):
        model.observe(StepShape(0, d, d * 0.1), 0.01 + 0.001 * d)
    assert model.coefficients is not None and model.coefficients[1] == 0.0


def test_slo_classes_are_validated():
    classes = check_slo_classes({"interactive": {"ttft_ms": 1000, "tpot_ms": 120}, "batch": {}})
    assert classes["interactive"].targeted and not classes["batch"].targeted
    for bad in ({"a": {"tpot_ms": 0}}, {"a": {"tpot": 5}}, {"a": {"slo_reject": "yes"}}, ["a"]):
        with pytest.raises(ValueError, match="slo_classes"):
            check_slo_classes(bad)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def make_req(rid: str, n: int, out: int, slo: SloClass | None, now: float, tenant: str | None = None) -> Request:
    prompt = [hash((rid, i)) % 30000 for i in range(n)]
    return Request(EngineRequest(rid, prompt, SamplingParams(max_tokens=out), tenant=tenant, arrival_time=now), slo=slo)


def simulate(s: Scheduler, clock: Clock, steps: int, arrivals, check) -> None:
    """Run `steps` steps on the simulated clock, each taking its true time; `arrivals(i)` adds
    requests before step i, `check(out, slacks)` sees each step and the slacks it was planned with."""
    for i in range(steps):
        arrivals(i)
        slacks = {r.request_id: tpot_slack(r, clock.now) for r in s.running.values()}
        out = s.schedule()
        check(out, slacks)
        clock.now += true_time(out.shape) if out.shape is not None else 0.001
        s.record_step_time(out, true_time(out.shape) if out.shape is not None else 0.001)
        s.update_after_step(out)
        for r in out.sampling:
            r.append_token(1)
            if r.times.first_token is None:
                r.times.first_token = clock.now
            if len(r.output_token_ids) >= r.params.max_tokens:
                r.times.finished = clock.now
                s.finish_request(r, "length")


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_the_budget_keeps_targeted_requests_on_course_and_never_benches_them(policy, monkeypatch):
    """A flood of long untargeted prompts beside interactive requests with a TPOT target: no
    step is planned longer than a targeted decode's slack, no targeted decode sits out, and every
    targeted request ends within its TPOT target."""
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    kv = KVCacheManager(4096, 16)
    s = Scheduler(kv, 32, 512, policy, TenantShares())
    rng = random.Random(1)
    ended: list[Request] = []
    count = [0]

    def arrivals(i: int) -> None:
        flood = sum(1 for r in s.requests.values() if r.slo is None)
        for _ in range(8 - flood):
            s.add_request(make_req(f"batch-{count[0]}", 900, 16, None, clock.now, "batch"))
            count[0] += 1
        if i >= 30 and i % 10 == 0:  # after the cost model's warm start on the flood's steps
            r = make_req(f"chat-{count[0]}", rng.randint(16, 48), 24, INTERACTIVE, clock.now, "chat")
            ended.append(r)
            s.add_request(r)
            count[0] += 1

    benched = []

    def check(out, slacks) -> None:
        predicted = s.cost.predict(out.shape)
        for r in s.running.values():
            decode = r.num_tokens - r.num_computed_tokens == 1 and r.num_computed_tokens >= r.num_prompt_tokens
            if r.targeted and decode and r.request_id not in out.num_scheduled_tokens:
                benched.append(r.request_id)
        for rid, slack in slacks.items():
            if slack is not None and predicted is not None and rid in out.num_scheduled_tokens:
                assert predicted <= slack + 1e-9, (rid, predicted, slack)

    simulate(s, clock, 600, arrivals, check)
    assert not benched
    done = [r for r in ended if r.times.finished is not None]
    assert len(done) >= 40
    for r in done:
        tpot = (r.times.finished - r.times.first_token) / (len(r.output_token_ids) - 1)
        assert tpot <= INTERACTIVE.tpot_ms / 1000.0 + 1e-9, (r.request_id, tpot)
    assert sum(1 for r in s.requests.values() if r.slo is None) or count[0] > 8  # the flood was served too


def test_untargeted_decodes_sit_out_before_a_targeted_one_misses(monkeypatch):
    """A target below the step of every decode: untargeted decodes sit out, targeted ones run."""
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    s = Scheduler(KVCacheManager(4096, 16), 64, 512, "fcfs", TenantShares())
    s.cost.coefficients = [0.010, 0.0007, 0.002, 0.0]  # 2 ms a decode row
    tight = SloClass("tight", tpot_ms=25.0)
    for i in range(10):
        s.add_request(make_req(f"b{i}", 8, 50, None, clock.now))
    s.add_request(make_req("t", 8, 50, tight, clock.now))
    out = s.schedule()  # every prompt in one step
    s.update_after_step(out)
    for r in out.sampling:
        r.append_token(1)
        r.times.first_token = clock.now
    out = s.schedule()
    assert "t" in out.num_scheduled_tokens
    assert s.plan.sit_out and not (s.plan.sit_out & set(out.num_scheduled_tokens))
    assert s.cost.predict(out.shape) <= 0.025 + 1e-9


def test_a_request_that_cannot_make_its_ttft_is_refused_or_served_late(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    s = Scheduler(KVCacheManager(4096, 16), 8, 512, "fcfs", TenantShares())
    s.cost.coefficients = [0.010, 0.001, 0.001, 0.0]  # 900 tokens: 0.91 s in two steps at least
    refuse = SloClass("refuse", ttft_ms=200.0, reject=True)
    late = SloClass("late", ttft_ms=200.0)
    s.add_request(make_req("r", 900, 4, refuse, clock.now))
    s.add_request(make_req("l", 900, 4, late, clock.now))
    s.add_request(make_req("ok", 16, 4, late, clock.now))
    out = s.schedule()
    assert [r.request_id for r in s.take_rejected()] == ["r"]
    assert s.requests["l"].slo_missed and not s.requests["ok"].slo_missed
    assert "l" in out.num_scheduled_tokens and "r" not in s.requests


def test_fair_shares_hold_with_classes_mixed(monkeypatch):
    """VTC's bound between two backlogged tenants while one of them sends targeted requests."""
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    s = Scheduler(KVCacheManager(24, 8), 6, 32, "fair", TenantShares())
    s.cost.coefficients = list(TRUE)
    u = vtc_bound(s.shares.prompt_weight, s.shares.output_weight, 24 * 8)
    rng = random.Random(2)
    diffs, count = [], 0
    for _ in range(2000):
        for t, burst in (("A", 16), ("B", 8)):
            while s.shares.get(t).waiting < burst:
                slo = INTERACTIVE if t == "B" and count % 2 else None
                s.add_request(make_req(f"{t}-{count}", rng.randint(1, 60), rng.randint(1, 40), slo, clock.now, t))
                count += 1
        out = s.schedule()
        clock.now += true_time(out.shape) if out.shape is not None else 0.001
        s.update_after_step(out)
        for r in out.sampling:
            r.append_token(1)
            r.times.first_token = r.times.first_token or clock.now
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish_request(r, "length")
        a, b = s.shares.get("A"), s.shares.get("B")
        diffs.append(s.shares.service(a) - s.shares.service(b))
    assert max(diffs) - min(diffs) <= 2 * u, (max(diffs) - min(diffs), u)
