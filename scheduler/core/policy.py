"""What a scheduling policy is, and the one interface it fills a step through (docs/engine.md,
"Scheduling policies").

The `Scheduler` (scheduler.py) runs the ORCA step every policy shares: the running decodes
first, under the step's budget (the latency targets' hook, slo_budget.py, sets it), then the
policy's `fill`: running requests still catching up and waiting ones admitted, in the policy's
order, through `StepBuilder`. A policy owns its waiting queue(s), its order, its victim order
for preemption and its own counters; it never touches the scheduler's state but through the
builder. Policies are chosen by name from the table in policies.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.request_queue import RequestQueue
from orcaserve.scheduler.core.step_output import SchedulerOutput
from orcaserve.scheduler.lora.slots import LoraWait


class StepBuilder(Protocol):
    """The step being built, as a policy sees it (running_batch.py builds it)."""

    @property
    def budget_left(self) -> int:
        """Tokens the step may still take."""

    @property
    def step_index(self) -> int:
        """Steps scheduled so far, the one being built included."""

    @property
    def running(self) -> Mapping[str, Request]:
        """The running requests, in admission order (read only: the builder changes it)."""

    def can_admit(self) -> bool:
        """Budget is left and a seat (`max_num_seqs`) is free."""

    def room_for(self, req: Request) -> int:
        """Tokens the step's limits leave `req` (its budget, and the untargeted prompt rows' share)."""

    def continue_running(self, out: SchedulerOutput, req: Request, limit: int | None = None) -> None:
        """Give a running request its next tokens (at most `limit`), preempting in the policy's
        victim order while the KV pool is short."""

    def start_waiting(self, out: SchedulerOutput, req: Request, limit: int | None = None) -> bool:
        """Admit `req`, the head of its waiting queue, with at most `limit` tokens; False, taking
        nothing, when the KV pool is short."""

    def waits_for_lora(self, req: Request, behind: bool = False) -> LoraWait | None:
        """Why `req`'s LoRA adapter can take no slot in this step (None: it can): every slot holds a
        running request's adapter, or `behind` an earlier request waits for the next free one
        (`SLOT`), or the adapter is being read back from disk (`READING`)."""

    def take_back(self, out: SchedulerOutput, req: Request) -> None:
        """Take `req`'s row of this step back: its tokens return to the budget."""

    def can_suspend(self) -> bool:
        """Fewer requests are suspended than the scheduler allows (blocks held idle)."""

    def suspend(self, out: SchedulerOutput, req: Request) -> None:
        """Hand `req`'s seat over: its row taken back, it waits again keeping its KV blocks and
        resumes where it stopped when it is next admitted."""


class StepObserver(Protocol):
    """Told of every row given to the step and taken back (a policy that counts the step's service
    as it is built: `fair`, whose order reads it)."""

    def begin(self) -> None:
        """A new step: nothing given yet."""

    def gave(self, req: Request, n: int) -> None: ...

    def took_back(self, req: Request) -> None: ...


@dataclass(frozen=True)
class PolicySettings:
    """What a policy may read of the engine's configuration."""

    max_num_seqs: int
    shares: TenantShares  # per-tenant service, kept under every policy
    prefill_cap: int | None  # `fair_prefill_cap`


class SchedulingPolicy(ABC):
    """Orders the waiting requests, fills each step after its running decodes, and picks whom to
    preempt. `waiting` holds every waiting request, suspended ones included; the scheduler pushes
    arrivals and preempted requests into it, removes aborted ones, and the builder takes a request
    out of it (`RequestQueue.take`) when it is admitted."""

    waiting: RequestQueue
    observer: StepObserver | None = None  # told of each row given and taken back (None: nobody)

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings

    @abstractmethod
    def order_key(self, req: Request) -> tuple[int, int]:
        """The policy's order among requests of equal standing: smaller runs first."""

    def victim_key(self, req: Request) -> tuple[float, bool, int, int]:
        """The largest is preempted first: one without a latency target before one with, then
        the last in the policy's order."""
        return (0.0, not req.targeted, *self.order_key(req))

    @abstractmethod
    def fill(self, step: StepBuilder, out: SchedulerOutput, catching_up: list[Request]) -> None:
        """After the running decodes: give the rest of the budget to `catching_up` (running
        requests with more than one token to compute, targeted ones first, each group in
        `order_key` order) and to waiting requests."""
