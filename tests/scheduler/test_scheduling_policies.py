"""A scheduling policy is one class and one line in the table (scheduler/core/policies.py;
docs/engine.md, "Adding a policy"): shortest-prompt-first, defined here and registered for the
test, runs through the real scheduler, its order deciding admission and preemption."""

from __future__ import annotations

import pytest

from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core import policies
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.queue_policy import QueuePolicy
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.sampling_params import SamplingParams


class FewestPromptTokens:
    """Waiting requests, the one with the fewest prompt tokens at the head (then arrival)."""

    def __init__(self) -> None:
        self._waiting: list[Request] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, req: Request, front: bool = False) -> None:
        self._waiting.append(req)  # the order is the key's: `front` changes nothing

    def remove(self, req: Request) -> None:
        self._waiting.remove(req)

    take = remove

    def targeted(self) -> list[Request]:
        return [r for r in self._waiting if r.targeted]

    def peek(self) -> Request | None:
        return min(self._waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_seq), default=None)


class ShortestPromptFirst(QueuePolicy):
    """The shortest prompt runs first; the longest running one is the first victim."""

    def make_queue(self) -> FewestPromptTokens:
        return FewestPromptTokens()

    def order_key(self, req: Request) -> tuple[int, int]:
        return (req.num_prompt_tokens, req.arrival_seq)


@pytest.fixture
def spf(monkeypatch):
    monkeypatch.setitem(policies.POLICIES, "spf", ShortestPromptFirst)  # the one registry line
    return "spf"


def req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(EngineRequest(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), arrival_time=0.0))


def run(s: Scheduler) -> tuple[list[str], list[str]]:
    """Every request to the end with a fake model; (the order of first admission, the preempted)."""
    admitted: list[str] = []
    preempted: list[str] = []
    while s.has_unfinished():
        out = s.schedule()
        admitted += [rid for rid in out.num_scheduled_tokens if rid not in admitted]
        preempted += out.preempted
        s.update_after_step(out)
        for r in out.sampling:
            r.append_token(1)
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish_request(r, "length")
    return admitted, preempted


@pytest.mark.parametrize("policy", ["spf", "fcfs"])
def test_one_seat_admits_in_the_policy_order(spf, policy):
    s = Scheduler(KVCacheManager(64, 4), 1, 256, policy)
    assert type(s.policy).__name__ == ("ShortestPromptFirst" if policy == spf else "FcfsPolicy")
    for rid, n in (("p30", 30), ("p5", 5), ("p20", 20), ("p10", 10)):
        s.add_request(req(rid, n, 3))
    admitted, preempted = run(s)
    assert not preempted
    assert admitted == (["p5", "p10", "p20", "p30"] if policy == spf else ["p30", "p5", "p20", "p10"])


@pytest.mark.parametrize("policy", ["spf", "fcfs"])
def test_the_policy_picks_the_victim_when_the_kv_pool_runs_short(spf, policy):
    """Two requests outgrow 8 blocks of 4 tokens: the longest prompt is the first victim under
    shortest-prompt-first, the newest under FCFS; both still finish."""
    s = Scheduler(KVCacheManager(8, 4), 2, 64, policy)
    s.add_request(req("long", 12, 14))
    s.add_request(req("short", 4, 14))
    admitted, preempted = run(s)
    assert admitted == (["short", "long"] if policy == spf else ["long", "short"])  # both in the first step
    assert preempted and preempted[0] == ("long" if policy == spf else "short")


def test_the_config_validates_through_the_table(spf):
    assert EngineConfig(scheduling_policy=spf).scheduling_policy == spf
    with pytest.raises(ValueError, match="'fcfs', 'priority', 'fair' or 'spf', got 'lottery'"):
        EngineConfig(scheduling_policy="lottery")
