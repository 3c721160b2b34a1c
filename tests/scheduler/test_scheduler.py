"""Scheduler and KV block accounting on CPU, driven by hand-made model outputs (no model runs)."""

from __future__ import annotations

import random

import pytest

from orcaserve.scheduler.core.block_pool import BlockPool
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=16, max_num_seqs=8, budget=64, policy="fcfs"):
    return Scheduler(KVCacheManager(num_blocks, block_size), max_num_seqs, budget, policy)


def req(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0) -> Request:
    return Request(
        EngineRequest(
            rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=0.0
        )
    )


def run_step(s: Scheduler, token: int = 1):
    """One iteration with a fake model: every request that caught up 'samples' `token`."""
    out = s.schedule()
    s.update_after_step(out)
    for r in out.sampling:
        r.append_token(token)
        if len(r.output_token_ids) >= r.params.max_tokens:
            s.finish_request(r, "length")
    return out


def test_block_pool_refcounts_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.allocate(2) is None and pool.num_free == 1
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3  # the shared block still has one reference
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free(a[:1])


def test_budget_chunks_long_prompt_and_decodes_go_first():
    s = make_scheduler(budget=32)
    s.add_request(req("a", 10, max_tokens=50))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"a": 10}
    s.add_request(req("long", 100))
    out = run_step(s)
    # the decode of "a" is never stalled by the long prompt, which takes the rest of the budget
    assert out.num_scheduled_tokens == {"a": 1, "long": 31}
    for expected_chunk in (31, 31):
        out = run_step(s)
        assert out.num_scheduled_tokens == {"a": 1, "long": expected_chunk}
    out = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "long": 7}
    assert s.requests["long"].output_token_ids == [1]  # sampled once its prompt was complete


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=3, budget=1000)
    for i in range(5):
        s.add_request(req(f"r{i}", 4))
    out = run_step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert s.num_waiting == 2


def test_preemption_frees_newest_and_recomputes_later():
    # 4 blocks of 4 slots; two requests of 7 prompt tokens fill 2 blocks each, then must grow.
    s = make_scheduler(num_blocks=4, block_size=4, budget=100)
    s.add_request(req("old", 7, max_tokens=6))
    s.add_request(req("new", 7, max_tokens=6))
    run_step(s)
    run_step(s)  # both at 8 tokens: 2 blocks each, pool empty
    out = run_step(s)
    assert out.preempted == ["new"]
    assert s.requests["new"].status == RequestStatus.WAITING
    assert s.requests["new"].num_computed_tokens == 0
    assert s.kv.blocks_of("new") == []
    while s.has_unfinished():
        run_step(s)
    assert s.kv.pool.num_free == 4


def test_priority_policy_admits_lower_value_first_and_preempts_highest():
    s = make_scheduler(max_num_seqs=1, budget=100, policy="priority")
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=-1))
    s.add_request(req("mid", 4, priority=0))
    order = []
    while s.has_unfinished():
        out = run_step(s)
        for rid in out.num_scheduled_tokens:
            if rid not in order:
                order.append(rid)
    assert order == ["high", "mid", "low"]


def test_no_block_leaks_after_thousands_of_mixed_requests():
    rng = random.Random(0)
    s = make_scheduler(num_blocks=48, block_size=8, max_num_seqs=12, budget=96)
    created = finished = aborted = 0
    for step in range(4000):
        for _ in range(rng.choice([0, 0, 1, 2])):
            s.add_request(req(f"r{created}", rng.randint(1, 120), max_tokens=rng.randint(1, 40)))
            created += 1
        if s.requests and rng.random() < 0.05:
            victim = rng.choice(list(s.requests.values()))
            s.finish_request(victim, "abort")
            aborted += 1
        before = len(s.requests)
        run_step(s, token=rng.randrange(100))
        finished += before - len(s.requests)
        held = sum(len(s.kv.blocks_of(r)) for r in s.requests)
        assert held == s.kv.pool.num_used, f"step {step}: blocks held by requests != blocks in use"
        assert len(s.running) <= 12
    while s.has_unfinished():
        run_step(s)
    assert created > 2000 and aborted > 50 and s.num_preemptions > 100
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_waiting_queue_orders_and_removes_in_constant_time():
    from orcaserve.scheduler.core.request_queue import WaitingQueue

    fifo = WaitingQueue(by_priority=False)
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    for r in (a, b, c):
        fifo.push(r)
    fifo.remove(b)
    assert len(fifo) == 2 and fifo.pop() is a
    fifo.push(a, front=True)  # preempted: back to the front
    again = req("b", 4)  # a new request reusing a removed one's id is not removed
    fifo.push(again)
    assert [fifo.pop() for _ in range(3)] == [a, c, again] and fifo.peek() is None and len(fifo) == 0

    prio = WaitingQueue(by_priority=True)
    low, high, high2 = req("low", 4, priority=5), req("high", 4, priority=-1), req("high2", 4, priority=-1)
    for r in (low, high, high2):
        prio.push(r)
    prio.remove(high)
    assert [prio.pop() for _ in range(2)] == [high2, low]
