"""The `fair` policy (VTC counters per tenant) on hand-made model outputs: no model runs."""

from __future__ import annotations

import random

import pytest

from orcaserve.scheduler.core.fair_share import TenantShares, check_weights, jain_index, vtc_bound
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import TenantQueues
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.sampling_params import SamplingParams


def make(policy="fair", num_blocks=64, block_size=16, max_num_seqs=4, budget=64, weights=None, caching=False, **kw):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs, budget, policy, TenantShares(weights), **kw)


def req(rid: str, tenant: str | None, prompt_len: int = 8, max_tokens: int = 8, priority: int = 0, first=0):
    prompt = [first + i for i in range(prompt_len)]
    return Request(
        EngineRequest(
            rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority, tenant=tenant, arrival_time=0.0
        )
    )


def step(s: Scheduler):
    """One iteration with a fake model: every request that caught up samples token 1."""
    out = s.schedule()
    s.update_after_step(out)
    for r in out.sampling:
        r.append_token(1)
        if len(r.output_token_ids) >= r.params.max_tokens:
            s.finish_request(r, "length")
    return out


def admitted(out) -> list[Request]:
    """Requests that started (or restarted) this step, after it ran (caching off)."""
    return [r for rid, r in out.requests.items() if r.num_computed_tokens == out.num_scheduled_tokens[rid]]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_flood_does_not_delay_a_newcomer_past_the_next_free_slot(policy):
    s = make(policy)
    for i in range(40):
        s.add_request(req(f"a{i}", "A"))
    for _ in range(3):
        step(s)
    s.add_request(req("b", "B"))
    waited = 0
    while True:
        started = [r.request_id for r in admitted(step(s))]
        if "b" in started:
            break
        waited += bool(started)  # steps that admitted someone else first
    if policy == "fair":
        assert waited == 0  # the first slot that freed up went to B
    else:
        assert waited >= 8  # B queued behind every A request that arrived before it


def test_a_returning_tenant_is_lifted_and_keeps_its_debt():
    shares = TenantShares()
    a = shares.get("A")
    shares.arrived(req("a0", "A"))
    a.counter = 100.0  # A is backlogged at 100
    shares.get("B").counter = 10.0  # B was served less, then went idle
    shares.live["B"] = shares.get("B")
    shares.arrived(req("b0", "B"))
    assert shares.get("B").counter == 100.0  # no credit for the time away
    shares.get("C").counter = 150.0  # C was served more, then went idle
    shares.live["C"] = shares.get("C")
    shares.arrived(req("c0", "C"))
    assert shares.get("C").counter == 150.0  # and keeps that debt


def test_after_idling_a_tenant_shares_instead_of_catching_up():
    s = make(max_num_seqs=4)
    n = {"A": 0, "B": 0}

    def top_up(tenant):
        while s.shares.get(tenant).waiting < 4:
            s.add_request(req(f"{tenant}{n[tenant]}", tenant))
            n[tenant] += 1

    for _ in range(30):
        top_up("A")
        top_up("B")
        step(s)
    for r in [r for r in s.requests.values() if r.tenant == "B"]:
        s.finish_request(r, "abort")  # B leaves
    for _ in range(300):  # A alone: served far more than B
        top_up("A")
        step(s)
    assert "B" not in s.shares.live  # forgotten: it had fallen to the origin
    starts = {"A": 0, "B": 0}
    for _ in range(60):
        top_up("A")
        top_up("B")
        for r in admitted(step(s)):
            starts[r.tenant] += 1
    assert starts["A"] >= 0.4 * (starts["A"] + starts["B"])  # B did not take every slot to catch up


def backlogged_run(s: Scheduler, tenants, steps: int, rng: random.Random, burst=None):
    """Keep every tenant backlogged for `steps` steps (random lengths); yields after each step.
    `burst[t]`: how many requests tenant t keeps queued (default 3)."""
    count = 0
    for _ in range(steps):
        for t in tenants:
            while s.shares.get(t).waiting < (burst or {}).get(t, 3):
                s.add_request(req(f"{t}-{count}", t, rng.randint(1, 60), rng.randint(1, 40), first=count * 100))
                count += 1
        yield step(s)


def test_weights_two_to_one_give_a_two_to_one_token_share():
    s = make(num_blocks=32, max_num_seqs=8, weights={"A": 2, "B": 1})
    rng = random.Random(0)
    for _ in backlogged_run(s, ["A", "B"], 3000, rng):
        pass
    a, b = s.shares.service(s.shares.get("A")), s.shares.service(s.shares.get("B"))  # per unit of weight
    assert a == pytest.approx(b, rel=0.05)
    served = {t: s.shares.get(t).prompt_tokens + 2 * s.shares.get(t).output_tokens for t in "AB"}
    assert served["A"] / served["B"] == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("policy, victim", [("fair", "a2"), ("fcfs", "b1")])
def test_preemption_takes_the_tenant_furthest_above_its_share(policy, victim):
    # 8 blocks of 4 slots. A runs two 8-token prompts, B one of 4 (admitted before A's second
    # under fair, last under FCFS); all grow until the pool is empty.
    s = make(policy, num_blocks=8, block_size=4, max_num_seqs=4, budget=100)
    s.add_request(req("a1", "A", 8, 20))
    s.add_request(req("a2", "A", 8, 20))
    s.add_request(req("b1", "B", 4, 20))
    while not (out := step(s)).preempted:
        pass
    assert out.preempted[0] == victim  # fair: A's newest although B's is newer than a1 and a2
    assert s.shares.get("A").counter > s.shares.get("B").counter or policy == "fcfs"


def test_no_idle_capacity_while_anyone_waits():
    """Each step that leaves requests waiting used its whole token budget, filled every sequence
    slot, preempted, found that the KV pool could not hold the request next in line (the
    head-of-line rule FCFS has too), or capped the prompts of tenants above their share beside
    one below it (`fair_prefill_cap`, deliberately; tests/scheduler/test_fair_prefill_cap.py)."""
    s = make(num_blocks=48, block_size=8, max_num_seqs=6, budget=48)
    refused: list[Request] = []
    allocate = s.kv.allocate_slots

    def recording(r, n, cached=()):
        ok = allocate(r, n, cached)
        if not ok and r.status == RequestStatus.WAITING:
            refused.append(r)
        return ok

    s.kv.allocate_slots = recording  # type: ignore[method-assign]
    rng = random.Random(1)
    tenants = [f"t{i}" for i in range(5)]
    checked = blocked = n = 0
    for i in range(3000):
        for _ in range(rng.choice([0, 0, 1, 3])):
            s.add_request(req(f"r{n}", rng.choice(tenants), rng.randint(1, 90), rng.randint(1, 30)))
            n += 1
        refused.clear()
        capped = s.policy.num_capped_steps
        out = s.schedule()
        if s.num_waiting:
            checked += 1
            full = out.total_tokens == s.max_num_batched_tokens or len(s.running) == s.max_num_seqs
            full |= s.policy.num_capped_steps > capped
            assert full or out.preempted or refused, f"step {i}: idle capacity while requests wait"
            blocked += not (full or out.preempted)
        s.update_after_step(out)
        for r in out.sampling:
            r.append_token(1)
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish_request(r, "length")
    assert checked > 1000 and 0 < blocked < checked / 4, (checked, blocked)
    assert s.num_suspensions > 0  # seats were handed over meanwhile


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_service_difference_of_backlogged_tenants_stays_within_vtc_bound(policy):
    """VTC's guarantee, checked on the scheduler's own counters: while A and B are both
    backlogged, their counters differ by at most U, and over any interval the service each got
    differs by at most 2U. A keeps 4x as many requests queued: FCFS breaks the bound."""
    s = make(policy, num_blocks=24, block_size=8, max_num_seqs=6, budget=32)
    u = vtc_bound(s.shares.prompt_weight, s.shares.output_weight, 24 * 8)
    rng = random.Random(2)
    diffs, spread = [], 0.0
    for _ in backlogged_run(s, ["A", "B"], 2500, rng, burst={"A": 32, "B": 8}):
        a, b = s.shares.get("A"), s.shares.get("B")
        assert a.backlogged and b.backlogged
        spread = max(spread, abs(a.counter - b.counter))
        diffs.append(s.shares.service(a) - s.shares.service(b))
    assert s.num_preemptions > 0
    worst = max(diffs) - min(diffs)  # max over intervals [t1, t2] of |W_A - W_B|
    if policy == "fair":
        assert spread <= u and worst <= 2 * u, (spread, worst, u)
    else:
        assert worst > 2 * u


def test_counters_stay_bounded_and_idle_tenants_are_forgotten():
    s = make(max_num_seqs=8, budget=64)
    rng = random.Random(3)
    u = vtc_bound(1.0, 2.0, 64 * 16)
    for i in range(4000):
        if rng.random() < 0.3:
            t = f"t{rng.randrange(20)}" if i < 3000 else "last"
            s.add_request(req(f"r{i}", t, rng.randint(1, 40), rng.randint(1, 20)))
        step(s)
        assert all(0.0 <= t.counter <= 2 * u for t in s.shares.live.values() if not t.active)
        assert all(abs(t.counter) <= 2 * u for t in s.shares.live.values())
    while s.has_unfinished():
        step(s)
    assert set(s.shares.live) <= {"last"} and len(s.shares.tenants) == 21


def test_cache_hits_and_recomputation_are_not_charged():
    s = make(num_blocks=6, block_size=4, max_num_seqs=4, budget=100, caching=True)
    s.add_request(req("first", "A", 10, 2))
    while s.has_unfinished():
        step(s)
    assert (s.shares.get("A").prompt_tokens, s.shares.get("A").output_tokens) == (10, 2)
    s.add_request(req("again", "A", 10, 2))  # 8 tokens (two blocks) come from the cache
    step(s)
    assert s.requests["again"].num_cached_tokens == 8 and s.shares.get("A").prompt_tokens == 12
    while s.has_unfinished():
        step(s)
    # Two requests that outgrow the pool: one is preempted and recomputed, charged once.
    s.add_request(req("x", "A", 7, 9, first=500))
    s.add_request(req("y", "B", 7, 9, first=900))
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions > 0
    assert s.shares.get("A").prompt_tokens == 12 + 7 and s.shares.get("B").prompt_tokens == 7
    assert s.shares.get("A").output_tokens == 4 + 9 and s.shares.get("B").output_tokens == 9
    assert all(t.waiting == t.running == 0 for t in s.shares.tenants.values())


def test_tenant_queues_order_by_priority_then_arrival_and_remove():
    q = TenantQueues()
    late, urgent, early, other = req("late", "A"), req("urgent", "A", priority=-1), req("early", "A"), req("o", "B")
    early.arrival_seq, late.arrival_seq = late.arrival_seq, early.arrival_seq  # `early` arrived first
    for r in (late, urgent, early, other):
        q.push(r)
    assert len(q) == 4 and set(q.tenants()) == {"A", "B"}
    q.remove(other)
    assert q.tenants() == ["A"] and q.peek_tenant("B") is None
    assert [q.pop_tenant("A").request_id for _ in range(3)] == ["urgent", "early", "late"]
    assert len(q) == 0 and q.tenants() == []


def test_weights_validation_and_jain_index():
    assert check_weights(None) == {} and check_weights({"a": 2}) == {"a": 2.0}
    for bad in ([1], {"a": 0}, {"a": -1.0}, {"a": True}, {"a": "2"}, {1: 2}, {"a": float("inf")}):
        with pytest.raises(ValueError, match="tenant_weights"):
            check_weights(bad)
    assert jain_index([3, 3, 3]) == 1.0 and jain_index([1, 0]) == 0.5 and jain_index([]) == 1.0
    with pytest.raises(ValueError, match="'fcfs', 'priority' or 'fair'"):
        make("lottery")
