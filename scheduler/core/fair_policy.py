"""The `fair` policy: the budget after the decodes goes tenant by tenant in the order of their
virtual token counters (fair_share.py), the seat handover lets a waiting tenant below its share in
when every seat is taken, and the other tenants' prompt tokens are capped while one below its
share runs (docs/engine.md, "Fair share between tenants (VTC)", "Seat handover", "Prompt cap
beside a below-share tenant").
"""

from __future__ import annotations

from collections import deque

from orcaserve.scheduler.core.fair_share import Tenant
from orcaserve.scheduler.core.policy import PolicySettings, SchedulingPolicy, StepBuilder
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.request_queue import TenantQueues
from orcaserve.scheduler.core.step_output import SchedulerOutput

# Prompt tokens that tenants above their share may compute in a step where one below its share
# runs (`fair_prefill_cap`; docs/engine.md, "Prompt cap beside a below-share tenant"): twice what
# a flood of 16 seats with prompts as long as its outputs needs per step to refill its seats.
DEFAULT_PREFILL_CAP = 32


class FairPolicy(SchedulingPolicy):
    """Tenants share the step in proportion to their weights (VTC). One waiting queue per tenant;
    within a tenant, priority then arrival. The first victim is the newest request of the tenant
    furthest above its share, counting this step's rows so far (the policy observes them)."""

    def __init__(self, settings: PolicySettings) -> None:
        super().__init__(settings)
        self.waiting: TenantQueues = TenantQueues()
        self.shares = settings.shares
        self.max_num_seqs = settings.max_num_seqs
        self.prefill_cap = settings.prefill_cap  # see `cap_sets`
        self.num_capped_steps = 0  # steps in which the cap held prompt tokens back
        # What the step's rows so far will charge, per tenant and per request, so that the next
        # choice already sees this step's service.
        self._pending: dict[str | None, float] = {}
        self._charges: dict[str, float] = {}
        self.observer = self

    # ---- order -------------------------------------------------------------------------------
    def order_key(self, req: Request) -> tuple[int, int]:
        return req.sort_key(True)

    def projected(self, tenant: str | None) -> float:
        """`tenant`'s counter with this step's charges so far."""
        return self.shares.get(tenant).counter + self._pending.get(tenant, 0.0)

    def victim_key(self, req: Request) -> tuple[float, bool, int, int]:
        return (self.projected(req.tenant), not req.targeted, *self.order_key(req))

    # ---- the step's charges (`StepObserver`) ---------------------------------------------------
    def begin(self) -> None:
        self._pending.clear()
        self._charges.clear()

    def gave(self, req: Request, n: int) -> None:
        tenant = self.shares.get(req.tenant)
        charge = self.shares.value(tenant, *self.shares.tokens(req, n))
        self._charges[req.request_id] = charge
        self._pending[req.tenant] = self._pending.get(req.tenant, 0.0) + charge

    def took_back(self, req: Request) -> None:
        charge = self._charges.pop(req.request_id, 0.0)
        if charge:
            self._pending[req.tenant] -= charge

    def seat_share(self, t: Tenant, active_weight: float | None = None) -> float:
        """`t`'s weighted share of the seats among the active tenants (`max_num_seqs` x w / W)."""
        if active_weight is None:
            active_weight = sum(u.weight for u in self.shares.live.values() if u.active)
        return self.max_num_seqs * t.weight / active_weight

    def cap_sets(self, catching_up: dict[str | None, deque[Request]]) -> tuple[set, set]:
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
        if self.prefill_cap is None:
            return set(), set()
        active = [t for t in self.shares.live.values() if t.active]
        if len(active) < 2:
            return set(), set()
        weight = sum(t.weight for t in active)
        above = {
            t.name
            for t in active
            if t.running > 1 and t.running - len(catching_up.get(t.name, ())) > max(self.seat_share(t, weight), 1)
        }
        if not above:
            return set(), set()
        light = {t.name for t in active if t.running < self.seat_share(t, weight) / 2}
        floor = min(self.projected(t.name) for t in active if t.name not in light)  # `above` is not light
        below = {name for name in light if self.projected(name) <= floor}
        return (below, above) if below else (set(), set())

    def fill(self, step: StepBuilder, out: SchedulerOutput, catching_up: list[Request]) -> None:
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
        queue = self.waiting
        running: dict[str | None, deque[Request]] = {}
        for req in catching_up:
            running.setdefault(req.tenant, deque()).append(req)
        below, above = self.cap_sets(running)
        capped: dict[str, int] = {}  # request -> prompt tokens it was given under the cap
        no_room: set[str | None] = set()  # next waiting request left no tokens or no adapter slot
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
            while step.budget_left > 0:
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
                tenant = min(candidates, key=lambda t: (self.projected(t), next_of(t).arrival_seq))
                req = next_of(tenant)
                limit = left if left is not None and held(tenant) else None
                # Rows leave the step (`StepBuilder.take_back`) only when one is preempted or a seat handed over.
                preempted, handed = len(out.preempted), False
                if tenant in running:
                    running[tenant].popleft()
                    if not running[tenant]:
                        del running[tenant]
                    step.continue_running(out, req, limit)
                elif step.room_for(req) <= 0:  # the latency plan leaves it nothing: others may still fit
                    no_room.add(tenant)
                elif step.waits_for_lora(req) is not None:  # its adapter can take no slot: others go on
                    no_room.add(tenant)
                elif len(step.running) >= self.max_num_seqs and not (
                    handed := self.hand_over(step, out, tenant, running)
                ):
                    admitting = False
                elif not step.start_waiting(out, req, limit):
                    admitting = False
                if limit is not None and req.request_id in out.num_scheduled_tokens:
                    n = capped[req.request_id] = out.num_scheduled_tokens[req.request_id]
                    used += n  # `req` was not in the step before this row: nothing of it counted yet
                    withheld |= n == limit < req.num_tokens - req.num_computed_tokens
                if handed or preempted != len(out.preempted):  # rows may have left: recount
                    used = sum(n for r, n in capped.items() if r in out.num_scheduled_tokens)
            return withheld

        if not fill(self.prefill_cap if below else None):
            return
        if any(r.tenant in below for r in out.requests.values()):
            self.num_capped_steps += 1
            return
        # Nobody below its share got a row: the rows cut by the cap go back in line, uncapped (so the
        # refill below never reads `used`).
        for rid in reversed(capped):
            if rid in out.num_scheduled_tokens:
                req = out.requests[rid]
                step.take_back(out, req)
                running.setdefault(req.tenant, deque()).appendleft(req)
        fill(None)

    def hand_over(
        self, step: StepBuilder, out: SchedulerOutput, tenant: str | None, catching_up: dict[str | None, deque[Request]]
    ) -> bool:
        """Every seat is taken and `tenant`, next in line, waits: suspend the newest running request
        of the tenant furthest above its share that may give a seat (its tokens of this step taken
        back) and return True, or change nothing and return False. A tenant may give a seat when its
        counter is at least one decode step's service of its seats (w_q x its running / its weight)
        above `tenant`'s, it holds more seats per unit of weight than `tenant` even after giving one (so the
        seat cannot come straight back), and it has a request not admitted in this step; and only
        while `tenant` holds fewer seats than its weighted share of them among the active tenants and
        fewer than `max_suspended` requests are suspended."""
        if not step.can_suspend():
            return False
        me = self.shares.get(tenant)
        if me.running and me.running + 1 > self.seat_share(me) / 2:
            return False  # it holds a seat, and half its weighted share of them: it waits for a free one
        floor = self.projected(tenant)
        givers = sorted(
            (
                t
                for t in self.shares.live.values()
                if t.running
                and t is not me
                and self.projected(t.name) - floor >= self.shares.output_weight * t.running / t.weight
                and (me.running + 1) / me.weight <= (t.running - 1) / t.weight
            ),
            key=lambda t: self.projected(t.name),
            reverse=True,
        )
        for top in givers:
            held = [r for r in step.running.values() if r.tenant == top.name and r.admitted_step != step.step_index]
            if held:
                break
        else:
            return False
        victim = max(held, key=self.order_key)
        step.suspend(out, victim)
        if victim in catching_up.get(top.name, ()):
            catching_up[top.name].remove(victim)
            if not catching_up[top.name]:
                del catching_up[top.name]
        return True
