"""Service per tenant, and the virtual token counters of the `fair` policy (VTC: Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024).

A tenant's counter is the weighted service it received, `(w_p * prompt + w_q * output tokens) /
weight`, measured from an origin that moves with the slowest backlogged tenant (`rebase`). The
scheduler serves the backlogged tenant (one with waiting requests) whose counter is smallest; a
tenant that starts waiting begins no lower than the others (`virtual_time`). Design and bound:
docs/fair-share.md, "Fair share between tenants (VTC)".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from orcaserve.scheduler.core.request import Request


@dataclass
class Tenant:
    name: str | None  # None: requests that name no tenant, one tenant together
    weight: float
    counter: float = 0.0  # weighted service relative to the origin (`rebase`)
    waiting: int = 0
    running: int = 0
    # Totals for metrics and the fairness checks; never re-based.
    prompt_tokens: int = 0  # computed for it: cache hits and recomputation after preemption excluded
    output_tokens: int = 0  # generated for it

    @property
    def backlogged(self) -> bool:
        return self.waiting > 0

    @property
    def active(self) -> bool:
        return self.waiting > 0 or self.running > 0


def check_weights(weights: object) -> dict[str, float]:
    """`tenant_weights` as given (None or a mapping of tenant name to a positive number)."""
    if weights is None:
        return {}
    if not isinstance(weights, Mapping):
        raise ValueError(f"tenant_weights must map tenant names to positive numbers, got {weights!r}")
    for name, w in weights.items():
        if not isinstance(name, str) or isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"tenant_weights must map tenant names to positive numbers, got {name!r}: {w!r}")
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"tenant_weights[{name!r}] must be a positive number, got {w!r}")
    return {name: float(w) for name, w in weights.items()}


class TenantShares:
    """Per-tenant counts of waiting and running requests, tokens served, and VTC counters.

    Kept under every policy (metrics read it); only `fair` lets the counters decide. Charges are
    per token computed: a prompt token when it is first computed for its request (w_p), an output
    token when it is sampled (w_q). A prompt token served from the prefix cache at the first
    admission is never charged, nor is recomputation after a preemption (the scheduler chose it).
    """

    def __init__(
        self, weights: Mapping[str, float] | None = None, prompt_weight: float = 1.0, output_weight: float = 2.0
    ) -> None:
        self.weights = check_weights(weights)
        self.prompt_weight = float(prompt_weight)
        self.output_weight = float(output_weight)
        self.tenants: dict[str | None, Tenant] = {}
        # Tenants whose counter matters: active, or idle with service above the virtual time (on
        # return they keep that debt). The others sit at the origin and are skipped: per step the
        # work is this set, not every tenant ever seen.
        self.live: dict[str | None, Tenant] = {}

    def get(self, name: str | None) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            weight = self.weights.get(name, 1.0) if name is not None else 1.0
            t = self.tenants[name] = Tenant(name, weight)
        return t

    # ---- costs -------------------------------------------------------------------------------
    @staticmethod
    def tokens(req: Request, n: int, start: int | None = None) -> tuple[int, int]:
        """(prompt tokens, output tokens) charged when `req` computes its next `n` tokens (from
        `start`, by default its computed tokens): prompt tokens never computed for it before,
        and the token it samples if it catches up."""
        start = req.num_computed_tokens if start is None else start
        end = start + n
        charged, num_prompt = req.prompt_charged, len(req.prompt_token_ids)
        prompt = min(end, num_prompt) - max(start, charged) if charged < end and charged < num_prompt else 0
        return prompt, int(end == len(req.all_token_ids))

    def value(self, tenant: Tenant, prompt: int, output: int) -> float:
        return (self.prompt_weight * prompt + self.output_weight * output) / tenant.weight

    def serve(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        """Charge the tenants of a step's (request, tokens computed), the tokens already counted
        in `num_computed_tokens`; per tenant once (this runs every step, under every policy)."""
        got: dict[str | None, list[int]] = {}
        for req, n in scheduled:
            if (g := got.get(req.tenant)) is None:
                g = got[req.tenant] = [0, 0]
            end = req.num_computed_tokens
            if req.prompt_charged >= len(req.prompt_token_ids):  # (`tokens`, its prompt charged in full)
                if end == len(req.all_token_ids):
                    g[1] += 1
                continue
            prompt, output = self.tokens(req, n, end - n)
            if prompt:
                req.prompt_charged = min(end, len(req.prompt_token_ids))
            g[0] += prompt
            g[1] += output
        for name, (prompt, output) in got.items():
            t = self.get(name)
            t.prompt_tokens += prompt
            t.output_tokens += output
            t.counter += self.value(t, prompt, output)

    # ---- request life ------------------------------------------------------------------------
    def arrived(self, req: Request) -> None:
        """A new request queues. A tenant that had none waiting is lifted to the virtual time of
        the others, so staying away banks no credit."""
        t = self.get(req.tenant)
        if not t.waiting:
            t.counter = max(t.counter, self.virtual_time(exclude=t))
            self.live[t.name] = t
        t.waiting += 1

    def admitted(self, req: Request) -> None:
        t = self.get(req.tenant)
        t.waiting -= 1
        t.running += 1

    def preempted(self, req: Request) -> None:
        t = self.get(req.tenant)
        t.running -= 1
        t.waiting += 1

    def left(self, req: Request, was_running: bool) -> None:
        t = self.get(req.tenant)
        if was_running:
            t.running -= 1
        else:
            t.waiting -= 1

    # ---- virtual time ------------------------------------------------------------------------
    def virtual_time(self, exclude: Tenant | None = None) -> float:
        """Where a tenant that starts waiting begins: VTC's smallest counter among backlogged
        tenants; with none backlogged, the largest among tenants with requests running (a
        newcomer is then behind nobody who is being served); with none, the origin."""
        backlogged = [t.counter for t in self.live.values() if t.waiting and t is not exclude]
        if backlogged:
            return min(backlogged)
        running = [t.counter for t in self.live.values() if t.running and t is not exclude]
        return max(running, default=0.0)

    def rebase(self) -> None:
        """Move the origin to the smallest counter among backlogged tenants (with none, among
        active ones), after every step: counters stay bounded on a server that runs for months.

        Only idle tenants are clamped at the origin, and dropped from `live` once there (on
        return they would be lifted at least that far). An active tenant that is not backlogged
        may sit below it: its lag still protects it from preemption, and the lift on its next
        arrival takes it away; it lasts at most as long as its running requests."""
        backlogged = [t.counter for t in self.live.values() if t.waiting]
        active = backlogged or [t.counter for t in self.live.values() if t.running]
        shift = min(active, default=0.0)
        for name, t in list(self.live.items()):
            t.counter -= shift
            if not t.active:
                t.counter = max(t.counter, 0.0)
                if t.counter == 0.0:
                    del self.live[name]

    # ---- observations ------------------------------------------------------------------------
    def service(self, t: Tenant) -> float:
        """Weighted service since the engine started, in counter units (never re-based)."""
        return self.value(t, t.prompt_tokens, t.output_tokens)


def vtc_bound(prompt_weight: float, output_weight: float, max_batch_tokens: int, min_weight: float = 1.0) -> float:
    """VTC's U: how far one backlogged tenant's counter can run ahead of another's.

    The paper's U = max(w_p * L_input, w_q * M), M the tokens a running batch can hold. Here a
    prompt is charged as its tokens are computed, while they sit in the KV cache, so both terms
    are service of requests that fit in the batch: U = max(w_p, w_q) * M, the paper's value when
    w_q >= w_p as by default. Two tenants backlogged over an interval receive service (in counter
    units) that differs by at most 2U over it.
    """
    return max(prompt_weight, output_weight) * max_batch_tokens / min_weight


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one has all."""
    xs = list(values)
    square = sum(x * x for x in xs)
    if not xs or square == 0.0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square)
