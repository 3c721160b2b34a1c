"""The `fair` policy's seat handover (scheduler/core/fair_policy.py): a waiting tenant below its
share gets a seat when all are taken, by suspending a request that keeps its KV blocks. On
hand-made model outputs (no model), and once through the real engine, token-exact."""

from __future__ import annotations

import random

import pytest
from test_fair_share import make, req, step

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_model
from orcaserve.scheduler.core.request import RequestStatus
from orcaserve.scheduler.sampling_params import SamplingParams


def flooded(policy="fair", n=8, **kw):
    """Tenant A's `n` requests of 8 prompt and 40 output tokens, 4 seats taken, after 3 steps."""
    s = make(policy, max_num_seqs=4, **kw)
    for i in range(n):
        s.add_request(req(f"a{i}", "A", 8, 40, first=100 * i))
    for _ in range(3):
        step(s)
    return s


def test_a_seat_bound_newcomer_gets_a_seat_the_next_step():
    s = flooded()
    assert len(s.running) == 4 and s.num_waiting == 4
    a3 = s.requests["a3"]
    blocks, computed = list(s.kv.blocks_of("a3")), a3.num_computed_tokens
    s.add_request(req("b", "B", 8, 40, first=5000))
    out = step(s)
    assert out.num_scheduled_tokens["b"] == 8 and "a3" not in out.num_scheduled_tokens
    assert list(s.suspended) == ["a3"] and a3.suspended and a3.status == RequestStatus.WAITING
    assert s.kv.blocks_of("a3") == blocks and a3.num_computed_tokens == computed  # nothing to recompute
    assert not out.preempted and s.num_suspensions == 1
    assert (s.shares.get("A").running, s.shares.get("A").waiting) == (3, 5)  # suspended counts as waiting
    assert s.num_waiting == 5 and len(s.running) == 4


def test_the_victim_is_the_newest_request_of_the_tenant_furthest_above_its_share():
    s = make(max_num_seqs=4)
    for rid, tenant in (("a0", "A"), ("c0", "C"), ("a1", "A"), ("c1", "C")):
        s.add_request(req(rid, tenant, 8, 40, first=len(s.requests) * 100))
    for _ in range(2):
        step(s)
    s.add_request(req("a2", "A", first=900))  # both stay backlogged
    s.add_request(req("c2", "C", first=950))
    s.shares.get("A").counter += 500  # A was served far more than C
    s.add_request(req("b", "B", first=5000))  # lifted to C's counter: below A's by a margin
    out = step(s)
    assert "b" in out.num_scheduled_tokens
    assert list(s.suspended) == ["a1"]  # A's newest, though C's c1 is newer


def test_no_handover_within_a_tenant_nor_under_fcfs_or_priority():
    for policy in ("fair", "fcfs", "priority"):
        s = flooded(policy, n=40)
        while s.has_unfinished():
            step(s)
        assert s.num_suspensions == 0 and not s.suspended, policy


def test_no_handover_without_the_margin_and_never_of_a_request_admitted_in_the_step():
    s = flooded()
    s.add_request(req("b", "B", first=5000))
    s.shares.get("B").counter = s.shares.get("A").counter + 1  # B is not below A: it waits
    out = step(s)
    assert "b" not in out.num_scheduled_tokens and not s.suspended
    # A's counter far above: B gets a seat, but not from the request admitted in this step.
    s = flooded(n=4)
    s.finish_request(s.requests["a3"], "abort")  # a seat frees; A has nobody waiting
    s.add_request(req("a9", "A", first=900))
    s.add_request(req("b", "B", first=5000))
    s.shares.get("A").counter += 500
    out = step(s)  # a9 and b are admitted (one free seat, then a handover)
    assert {"a9", "b"} <= set(out.num_scheduled_tokens) or list(s.suspended) != ["a9"]
    assert "a9" not in s.suspended


def test_two_flooding_tenants_rarely_hand_seats_over():
    """Two tenants flooding for 3,000 steps share the seats by the counters' admission order: a
    handover is for a tenant short of seats (none, or under half its weighted share), not for
    every swing of the counters, which would suspend one request in four here."""
    s = make(num_blocks=256, block_size=8, max_num_seqs=8, budget=64)
    rng = random.Random(4)
    count = 0
    for _ in range(3000):
        for t in ("A", "B"):
            while s.shares.get(t).waiting < 6:
                s.add_request(req(f"{t}{count}", t, rng.randint(1, 60), rng.randint(1, 40), first=count * 100))
                count += 1
        out = step(s)
        assert len(s.suspended) <= s.max_suspended and not set(out.num_scheduled_tokens) & set(s.suspended)
    assert s.num_suspensions <= count / 100 and s.num_preemptions == 0, (s.num_suspensions, count)
    assert s.shares.service(s.shares.get("A")) == pytest.approx(s.shares.service(s.shares.get("B")), rel=0.02)


def test_when_the_pool_runs_short_suspended_requests_give_their_blocks_back_first():
    # 14 blocks of 4 slots: 4 requests of 8-token prompts hold 8 and grow to 12; b takes the last
    # 2, and its first decode needs one more: the suspended a3's 3 blocks come back.
    s = make(num_blocks=14, block_size=4, max_num_seqs=4, budget=100)
    for i in range(5):
        s.add_request(req(f"a{i}", "A", 8, 40, first=100 * i))
    step(s)
    s.add_request(req("b", "B", 8, 40, first=5000))
    step(s)
    assert list(s.suspended) == ["a3"] and s.kv.blocks_of("a3")
    while not (out := step(s)).preempted:
        assert s.kv.blocks_of("a3")  # kept while the pool had room
    assert out.preempted == ["a3"]  # the suspended request first, nobody running
    a3 = s.requests["a3"]
    assert not s.suspended and not a3.suspended and a3.num_computed_tokens == 0 and s.kv.blocks_of("a3") == []
    assert a3.status == RequestStatus.WAITING and a3.num_preemptions == 1
    while s.has_unfinished():
        step(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert all(t.waiting == t.running == 0 for t in s.shares.tenants.values())


def test_aborting_a_suspended_request_frees_its_blocks_and_counts():
    s = flooded()
    s.add_request(req("b", "B", first=5000))
    step(s)
    s.finish_request(s.requests["a3"], "abort")
    assert not s.suspended and s.kv.blocks_of("a3") == []
    assert (s.shares.get("A").running, s.shares.get("A").waiting) == (3, 4)
    held = sum(len(s.kv.blocks_of(r)) for r in s.requests)
    assert held == s.kv.pool.num_used


def test_suspended_requests_are_bounded():
    s = flooded(n=12, max_suspended=2)
    for i in range(4):  # four newcomers, each of its own tenant
        s.add_request(req(f"n{i}", f"N{i}", first=5000 + 100 * i))
    out = step(s)
    assert len(s.suspended) == 2 and sum(r.startswith("n") for r in out.num_scheduled_tokens) == 2


def test_a_suspended_and_resumed_request_produces_the_tokens_of_an_uninterrupted_one(engine_for):
    """Through the real engine: A's two requests fill both seats, B's arrival suspends A's newer
    one mid-decode; it resumes from its kept KV blocks (no recomputation) with transformers' tokens."""
    model = tiny_model("llama")
    rng = random.Random(5)
    prompts = {rid: [rng.randrange(3, TINY_VOCAB) for _ in range(n)] for rid, n in (("a0", 40), ("a1", 23), ("b", 9))}
    engine = engine_for(model, max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy="fair")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a0", prompts["a0"], params, tenant="A")
    engine.add_request("a1", prompts["a1"], params, tenant="A")
    results = {}
    for _ in range(4):
        engine.step()
    engine.add_request("b", prompts["b"], params, tenant="B")
    engine.step()
    a1 = engine.scheduler.requests["a1"]
    assert list(engine.scheduler.suspended) == ["a1"] and 0 < len(a1.output_token_ids) < 30
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert engine.scheduler.num_suspensions >= 1
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == hf_greedy(model, prompt, 30), rid
        assert results[rid].num_preemptions == 0, rid  # resumed, never recomputed
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # seed 1: full suite only
def test_many_tenants_random_work_keeps_blocks_and_counts_consistent(seed):
    s = make(num_blocks=40, block_size=8, max_num_seqs=6, budget=48)
    rng = random.Random(seed)
    n = 0
    for _step in range(3000):
        for _ in range(rng.choice([0, 0, 1, 3])):
            s.add_request(req(f"r{n}", f"t{rng.randrange(5)}", rng.randint(1, 90), rng.randint(1, 30), first=n))
            n += 1
        if s.requests and rng.random() < 0.03:
            s.finish_request(rng.choice(list(s.requests.values())), "abort")
        step(s)
        held = sum(len(s.kv.blocks_of(r)) for r in s.requests)
        assert held == s.kv.pool.num_used and len(s.running) <= 6
        for t in s.shares.tenants.values():
            mine = [r for r in s.requests.values() if r.tenant == t.name]
            assert t.running == sum(r.status == RequestStatus.RUNNING for r in mine)
            assert t.waiting == sum(r.status == RequestStatus.WAITING for r in mine)
        assert all(s.requests[r].suspended for r in s.suspended)
    assert s.num_suspensions > 20
    while s.has_unfinished():
        step(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
