"""The scheduling policies by name (`scheduling_policy`): a new policy is its file and one line here
(docs/engine.md, "Adding a policy")."""

from __future__ import annotations

from orcaserve.scheduler.core.fair_policy import FairPolicy
from orcaserve.scheduler.core.policy import PolicySettings, SchedulingPolicy
from orcaserve.scheduler.core.queue_policy import FcfsPolicy, PriorityPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FcfsPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,  # per tenant (docs/fair-share.md)
}


def check_policy(name: object) -> str:
    """`name` if it names a policy, else ValueError listing those that exist."""
    if not isinstance(name, str) or name not in POLICIES:
        *first, last = (repr(n) for n in POLICIES)
        known = f"{', '.join(first)} or {last}" if first else last
        raise ValueError(f"scheduling_policy must be {known}, got {name!r}")
    return name


def make_policy(name: str, settings: PolicySettings) -> SchedulingPolicy:
    return POLICIES[check_policy(name)](settings)
