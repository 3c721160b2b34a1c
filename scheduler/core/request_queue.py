"""The waiting queues the policies own: FCFS or priority order, O(1) or O(log n) per operation,
and one per tenant for `fair`."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Protocol

from orcaserve.scheduler.core.request import Request


class RequestQueue(Protocol):
    """What the scheduler and the step builder ask of a policy's waiting requests; the policy
    itself reads its queue in its own terms (its head, a tenant's head)."""

    def __len__(self) -> int: ...

    def push(self, req: Request, front: bool = False) -> None:
        """Queue `req`; `front`: preempted or suspended, ahead of later arrivals."""

    def remove(self, req: Request) -> None:
        """`req` left while waiting (aborted, refused)."""

    def take(self, req: Request) -> None:
        """`req`, the head the policy chose, is admitted: out of the queue."""

    def targeted(self) -> list[Request]:
        """The requests with a latency target waiting, in no particular order."""


class WaitingQueue:
    """Requests waiting to run, in policy order; preempted ones go back to the front of theirs.

    FCFS is a deque: arrivals at the back, preempted requests at the front (they arrived before
    every request still waiting, and victims are taken newest first, so pushing each to the
    front keeps arrival order). Priority is a heap on (priority, arrival). Removal (an abort of a
    waiting request) is lazy: the request is skipped when it reaches the head.
    """

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, int, int, Request]] = []
        self._urgent: list[tuple[int, float, int, int, Request]] = []
        self._tie = itertools.count()  # the heap never compares Requests
        self._removed: set[Request] = set()  # by identity: an id may come back in a new request
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, req: Request, front: bool = False) -> None:
        """Queue `req`; `front` for a preempted request (FCFS: ahead of every arrival)."""
        if req.targeted:
            slo = req.slo
            due = req.times.arrival + (slo.ttft_ms or 0.0) / 1000.0 if slo is not None else req.times.arrival
            priority = req.priority if self.by_priority else 0
            heapq.heappush(self._urgent, (priority, due, req.arrival_seq, next(self._tie), req))
        elif self.by_priority:
            heapq.heappush(self._heap, (req.priority, req.arrival_seq, next(self._tie), req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)
        self._size += 1

    def remove(self, req: Request) -> None:
        self._removed.add(req)
        self._size -= 1

    def targeted(self) -> list[Request]:
        """The requests with a latency target waiting, in no particular order."""
        return [entry[-1] for entry in self._urgent if entry[-1] not in self._removed]

    def peek(self) -> Request | None:
        while True:
            head: Request | None
            if self._urgent:
                head = self._urgent[0][-1]
            elif self.by_priority:
                head = self._heap[0][3] if self._heap else None
            else:
                head = self._fifo[0] if self._fifo else None
            if head is None or head not in self._removed:
                return head
            self._discard_head()
            self._removed.discard(head)

    def take(self, req: Request) -> None:
        head = self.pop()
        assert head is req, "only the head of the queue is admitted"

    def pop(self) -> Request:
        head = self.peek()
        assert head is not None, "pop from an empty queue"
        self._discard_head()
        self._size -= 1
        return head

    def _discard_head(self) -> None:
        if self._urgent:
            heapq.heappop(self._urgent)
        elif self.by_priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()


class TenantQueues:
    """The `fair` policy's waiting requests: one priority queue per tenant (priority, then
    arrival: FCFS when no request carries a priority), so the scheduler can take the head of
    whichever tenant its counters choose. Only tenants with requests waiting have a queue."""

    def __init__(self) -> None:
        self._queues: dict[str | None, WaitingQueue] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def tenants(self) -> list[str | None]:
        return list(self._queues)

    def push(self, req: Request, front: bool = False) -> None:
        """`front` is implied: a preempted request's (priority, arrival) puts it before later arrivals."""
        queue = self._queues.get(req.tenant)
        if queue is None:
            queue = self._queues[req.tenant] = WaitingQueue(by_priority=True)
        queue.push(req)
        self._size += 1

    def remove(self, req: Request) -> None:
        queue = self._queues[req.tenant]
        queue.remove(req)
        self._size -= 1
        if not queue:
            del self._queues[req.tenant]

    def targeted(self) -> list[Request]:
        return [r for queue in self._queues.values() for r in queue.targeted()]

    def take(self, req: Request) -> None:
        head = self.pop_tenant(req.tenant)
        assert head is req, "only the head of a tenant's queue is admitted"

    def peek_tenant(self, tenant: str | None) -> Request | None:
        queue = self._queues.get(tenant)
        return queue.peek() if queue is not None else None

    def pop_tenant(self, tenant: str | None) -> Request:
        queue = self._queues[tenant]
        req = queue.pop()
        self._size -= 1
        if not queue:
            del self._queues[tenant]
        return req
