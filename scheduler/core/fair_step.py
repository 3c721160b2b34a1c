"""The `fair` policy's part of a step after the decodes: the budget tenant by tenant in counter
order, the seat handover that lets a waiting tenant below its share in when every seat is
taken, and the cap on the other tenants' prompt tokens while one below its share runs
(docs/engine.md, "Fair share between tenants (VTC)", "Seat handover", "Prompt cap beside a
below-share tenant").

Functions over the `Scheduler` (scheduler.py), which owns the state; kept apart so that
scheduler.py stays the one ORCA step every policy shares.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from orcaserve.scheduler.core.fair_share import Tenant
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import TenantQueues

if TYPE_CHECKING:
    from orcaserve.scheduler.core.scheduler import Scheduler, SchedulerOutput


# Prompt tokens that tenants above their share may compute in a step where one below its share
# runs (`fair_prefill_cap`; docs/engine.md, "Prompt cap beside a below-share tenant"): twice what
# a flood of 16 seats with prompts as long as its outputs needs per step to refill its seats.
DEFAULT_PREFILL_CAP = 32


def seat_share(s: Scheduler, t: Tenant, active_weight: float | None = None) -> float:
    """`t`'s weighted share of the seats among the active tenants (`max_num_seqs` x w / W)."""
    if active_weight is None:
        active_weight = sum(u.weight for u in s.shares.live.values() if u.active)
    return s.max_num_seqs * t.weight / active_weight


def cap_sets(s: Scheduler, catching_up: dict[str | None, deque[Request]]) -> tuple[set, set]:
    """(below, above): the tenants below their share, whose requests in a step make it cap the
    prompt tokens of those above their share. Empty when the cap is off or nobody qualifies.

    Below its share: it holds fewer than half its weighted share of the seats (`seat_share`, the
    test by which the seat handover seats a newcomer: a tenant with a request or two beside a
    flood, never one of two flooding tenants whose seats swing around their shares), and its
    counter, with this step's charges so far, is not above the smallest counter of the tenants
    that hold at least that many seats: it was served no more per unit of weight than any of
    them. A tenant with few seats whose long prompts ran ahead of the flood by the counters is
    not protected; VTC orders it after the flood as before.

    Above its share: it has more rows decoding (running, not catching up) than its weighted
    share of the seats, and more than one (with more tenants than seats, a tenant with a single
    request is not a flood). Counting decoding rows, not seats, means the cap cannot drain a
    tenant below its share: when its new prompts are long, its seats fill with requests catching
    up, its decoding rows fall to its share, and from there its prompts are no longer capped."""
    if s.prefill_cap is None:
        return set(), set()
    active = [t for t in s.shares.live.values() if t.active]
    if len(active) < 2:
        return set(), set()
    weight = sum(t.weight for t in active)
    above = {
        t.name
        for t in active
        if t.running > 1 and t.running - len(catching_up.get(t.name, ())) > max(seat_share(s, t, weight), 1)
    }
    if not above:
        return set(), set()
    light = {t.name for t in active if t.running < seat_share(s, t, weight) / 2}
    floor = min(s.projected(t.name) for t in active if t.name not in light)  # `above` is not light
    below = {name for name in light if s.projected(name) <= floor}
    return (below, above) if below else (set(), set())


def fill_fair(s: Scheduler, out: SchedulerOutput, catching_up: list[Request]) -> None:
    """The budget goes tenant by tenant, smallest counter (with this step's charges so far)
    first, each tenant's running requests before its waiting ones; equal counters go to the
    earlier request. Admission stops, as under FCFS, once the head of the chosen tenant does not
    fit in the KV pool or anything was preempted, and, with every seat taken, once the chosen
    tenant may not be handed one (`hand_over`).

    While a tenant below its share runs in the step, the rows of the tenants above theirs
    (`cap_sets`) that compute prompt tokens (chunks, recomputation, admissions) get
    `prefill_cap` tokens in all; decodes are never capped, nor are other tenants' prompts. If
    in the end no request of a below-share tenant was scheduled, the cap is lifted: the rows it
    cut go back in line and the rest of the budget is filled without it, so the cap never leaves
    capacity idle unless it protects someone."""
    queue = s.waiting
    assert isinstance(queue, TenantQueues)
    running: dict[str | None, deque[Request]] = {}
    for req in catching_up:
        running.setdefault(req.tenant, deque()).append(req)
    below, above = cap_sets(s, running)
    capped: dict[str, int] = {}  # request -> prompt tokens it was given under the cap
    no_room: set[str | None] = set()  # tenants whose next waiting request the step's limits leave no tokens
    used = 0  # of those, the tokens of rows still in the step (`capped`'s rows not taken back)
    admitting = True

    def next_of(tenant: str | None) -> Request:
        head = running[tenant][0] if tenant in running else queue.peek_tenant(tenant)
        assert head is not None
        return head

    def held(tenant: str | None) -> bool:
        """The cap applies to `tenant`'s next row: above its share, and not a resumed decode."""
        req = next_of(tenant)
        return tenant in above and not (req.suspended and req.num_tokens - req.num_computed_tokens == 1)

    def fill(cap: int | None) -> bool:
        """Fill the budget; True when the cap held prompt tokens back."""
        nonlocal admitting, used
        withheld = False
        while s.budget_left > 0:
            admitting = admitting and not out.preempted
            candidates = list(running)
            if admitting:
                candidates += [t for t in queue.tenants() if t not in running and t not in no_room]
            left = None if cap is None else cap - used
            if left is not None and left <= 0:
                kept = [t for t in candidates if not held(t)]
                withheld |= len(kept) < len(candidates)
                candidates = kept
            if not candidates:
                return withheld
            tenant = min(candidates, key=lambda t: (s.projected(t), next_of(t).arrival_seq))
            req = next_of(tenant)
            limit = left if left is not None and held(tenant) else None
            # Rows leave the step (`Scheduler.take_back`) only when one is preempted or a seat handed over.
            taken_back = (len(out.preempted), s.num_suspensions)
            if tenant in running:
                running[tenant].popleft()
                if not running[tenant]:
                    del running[tenant]
                s.continue_running(out, req, limit)
            elif s.room_for(req) <= 0:  # the latency plan leaves it nothing: others may still fit
                no_room.add(tenant)
            elif len(s.running) >= s.max_num_seqs and not hand_over(s, out, tenant, running):
                admitting = False
            elif not s.start_waiting(out, req, limit):
                admitting = False
            if limit is not None and req.request_id in out.num_scheduled_tokens:
                n = capped[req.request_id] = out.num_scheduled_tokens[req.request_id]
                used += n  # `req` was not in the step before this row: nothing of it counted yet
                withheld |= n == limit < req.num_tokens - req.num_computed_tokens
            if taken_back != (len(out.preempted), s.num_suspensions):  # rows may have left: recount
                used = sum(n for r, n in capped.items() if r in out.num_scheduled_tokens)
        return withheld

    if not fill(s.prefill_cap if below else None):
        return
    if any(r.tenant in below for r in out.requests.values()):
        s.num_capped_steps += 1
        return
    # Nobody below its share got a row: the rows cut by the cap go back in line, uncapped (so the
    # refill below never reads `used`).
    for rid in reversed(capped):
        if rid in out.num_scheduled_tokens:
            req = out.requests[rid]
            s.take_back(out, req)
            running.setdefault(req.tenant, deque()).appendleft(req)
    fill(None)


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
    if me.running and me.running + 1 > seat_share(s, me) / 2:
        return False  # it holds a seat, and half its weighted share of them: it waits for a free one
    floor = s.projected(tenant)
    givers = sorted(
        (
            t
            for t in s.shares.live.values()
            if t.running
            and t is not me
            and s.projected(t.name) - floor >= s.shares.output_weight * t.running / t.weight
            and (me.running + 1) / me.weight <= (t.running - 1) / t.weight
        ),
        key=lambda t: s.projected(t.name),
        reverse=True,
    )
    for top in givers:
        held = [r for r in s.running.values() if r.tenant == top.name and r.admitted_step != s.step_index]
        if held:
            break
    else:
        return False
    victim = max(held, key=s.order_key)
    s.take_back(out, victim)
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
    req = max(held, key=s.victim_key)
    del s.suspended[req.request_id]
    req.suspended = False
    s.kv.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    s.num_preemptions += 1
    out.preempted.append(req.request_id)
    return True
