"""The `fair` policy's part of a step after the decodes: the budget tenant by tenant in counter
order, and the seat handover that lets a waiting tenant below its share in when every seat is
taken (docs/engine.md, "Fair share between tenants (VTC)" and "Seat handover").

Functions over the `Scheduler` (scheduler.py), which owns the state; kept apart so that
scheduler.py stays the one ORCA step every policy shares.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import TenantQueues

if TYPE_CHECKING:
    from orcaserve.scheduler.core.scheduler import Scheduler, SchedulerOutput


def fill_fair(s: Scheduler, out: SchedulerOutput, catching_up: list[Request]) -> None:
    """The budget goes tenant by tenant, smallest counter (with this step's charges so far)
    first, each tenant's running requests before its waiting ones; equal counters go to the
    earlier request. Admission stops, as under FCFS, once the head of the chosen tenant does not
    fit in the KV pool or anything was preempted, and, with every seat taken, once the chosen
    tenant may not be handed one (`hand_over`)."""
    queue = s.waiting
    assert isinstance(queue, TenantQueues)
    running: dict[str | None, deque[Request]] = {}
    for req in catching_up:
        running.setdefault(req.tenant, deque()).append(req)

    def next_of(tenant: str | None) -> Request:
        head = running[tenant][0] if tenant in running else queue.peek_tenant(tenant)
        assert head is not None
        return head

    admitting = True
    while s._budget > 0:
        admitting = admitting and not out.preempted
        candidates = list(running)
        if admitting:
            candidates += [t for t in queue.tenants() if t not in running]
        if not candidates:
            return
        tenant = min(candidates, key=lambda t: (s._projected(t), next_of(t).arrival_seq))
        if tenant in running:
            req = running[tenant].popleft()
            if not running[tenant]:
                del running[tenant]
            s._continue(out, req)
        elif len(s.running) >= s.max_num_seqs and not hand_over(s, out, tenant, running):
            admitting = False
        elif not s._start(out, next_of(tenant)):
            admitting = False


def hand_over(
    s: Scheduler, out: SchedulerOutput, tenant: str | None, catching_up: dict[str | None, deque[Request]]
) -> bool:
    """Every seat is taken and `tenant`, next in line, waits: suspend the newest running request
    of the tenant furthest above its share that may give a seat (its tokens of this step taken
    back) and return True, or change nothing and return False. A tenant may give a seat when its
    counter is at least one decode step's service of its seats (w_q x its running / its weight)
    above `tenant`'s, it holds more seats per unit of weight than `tenant` even after giving one (so the
    seat cannot come straight back), and it has a request not admitted in this step; and only
    while `tenant` holds fewer seats than its weighted share of them among the active tenants and
    fewer than `max_suspended` requests are suspended."""
    if len(s.suspended) >= s.max_suspended:
        return False
    me = s.shares.get(tenant)
    active_weight = sum(t.weight for t in s.shares.live.values() if t.active)
    if me.running and me.running + 1 > s.max_num_seqs * me.weight / active_weight / 2:
        return False  # it holds a seat, and half its weighted share of them: it waits for a free one
    floor = s._projected(tenant)
    givers = sorted(
        (
            t
            for t in s.shares.live.values()
            if t.running
            and t is not me
            and s._projected(t.name) - floor >= s.shares.output_weight * t.running / t.weight
            and (me.running + 1) / me.weight <= (t.running - 1) / t.weight
        ),
        key=lambda t: s._projected(t.name),
        reverse=True,
    )
    for top in givers:
        held = [r for r in s.running.values() if r.tenant == top.name and r.admitted_step != s._step]
        if held:
            break
    else:
        return False
    victim = max(held, key=s._key)
    s._take_back(out, victim)
    if victim in catching_up.get(top.name, ()):
        catching_up[top.name].remove(victim)
        if not catching_up[top.name]:
            del catching_up[top.name]
    suspend(s, victim)
    return True


def suspend(s: Scheduler, req: Request) -> None:
    """Out of the running set with its blocks and computed tokens kept: waiting again for its
    tenant's counts, at the front of its tenant's queue (its arrival is older than any request
    the tenant has waiting that it did not preempt)."""
    del s.running[req.request_id]
    req.status = RequestStatus.WAITING
    req.suspended = True
    s.suspended[req.request_id] = req
    s.num_suspensions += 1
    s.shares.preempted(req)
    s.waiting.push(req, front=True)


def release_suspended(s: Scheduler, out: SchedulerOutput, keep: Request | None = None) -> bool:
    """The KV pool is short: a suspended request (of the tenant furthest above its share, its
    newest) gives its blocks back and will restart by recomputation, as if preempted. False when
    none other than `keep` holds blocks."""
    held = [r for r in s.suspended.values() if r is not keep]
    if not held:
        return False
    req = max(held, key=s._victim_key)
    del s.suspended[req.request_id]
    req.suspended = False
    s.kv.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    s.num_preemptions += 1
    out.preempted.append(req.request_id)
    return True
