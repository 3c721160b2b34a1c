"""Policies with one waiting queue, admitted from its head: `fcfs` and `priority`."""

from __future__ import annotations

from typing import Protocol

from orcaserve.scheduler.core.policy import PolicySettings, SchedulingPolicy, StepBuilder
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.request_queue import RequestQueue, WaitingQueue
from orcaserve.scheduler.core.step_output import SchedulerOutput
from orcaserve.scheduler.lora.slots import LoraWait


class HeadQueue(RequestQueue, Protocol):
    """A waiting queue in one order: its head is the next admitted."""

    def peek(self) -> Request | None: ...


class QueuePolicy(SchedulingPolicy):
    """The running requests catching up continue in order, then the head of the waiting queue is
    admitted until the budget, the seats or the KV pool run out. Nothing is admitted in a step
    that preempted: the new work would only be evicted again. Requests with a latency target
    wait ahead of the others, earliest TTFT deadline first (`WaitingQueue`)."""

    def __init__(self, settings: PolicySettings) -> None:
        super().__init__(settings)
        self.waiting: HeadQueue = self.make_queue()

    def make_queue(self) -> HeadQueue:
        return WaitingQueue(by_priority=False)

    def order_key(self, req: Request) -> tuple[int, int]:
        return req.sort_key(False)

    def fill(self, step: StepBuilder, out: SchedulerOutput, catching_up: list[Request]) -> None:
        for req in catching_up:
            step.continue_running(out, req)
        # A request whose LoRA adapter can take no slot (every slot holds a running request's
        # adapter, or it is being read back from disk) keeps its place and lets the requests behind
        # it pass, as vLLM's scheduler skips it; behind one waiting for a slot, those that would need
        # a slot of their own wait too, so the first slot freed goes to the earliest waiting adapter
        # request (docs/lora.md "More adapters than a step holds").
        queue, skipped, slot_wanted = self.waiting, [], False
        while not out.preempted and step.can_admit() and (head := queue.peek()) is not None:
            if (wait := step.waits_for_lora(head, behind=slot_wanted)) is not None:
                queue.take(head)
                skipped.append(head)
                slot_wanted |= wait is LoraWait.SLOT
            elif not step.start_waiting(out, head):
                break
        for req in reversed(skipped):  # back in their places, ahead of everyone left waiting
            queue.push(req, front=True)


class FcfsPolicy(QueuePolicy):
    """First come, first served; the newest running request is the first victim."""


class PriorityPolicy(QueuePolicy):
    """The smallest `priority` first, then arrival; the first victim is the lowest priority's newest."""

    def make_queue(self) -> HeadQueue:
        return WaitingQueue(by_priority=True)

    def order_key(self, req: Request) -> tuple[int, int]:
        return req.sort_key(True)
