"""Fault injection for the reliability suites; inert unless the worker's environment enables it.

With `ORCASERVE_TEST_FAULTS=1` in TorchServe's environment, a request whose `user` field is
`orcaserve-fault:step` makes the engine step that runs it raise (its requests fail with 500, the
loop goes on), `orcaserve-fault:loop` kills the engine loop thread (the worker answers what is
in flight and exits; TorchServe starts a new one), and `orcaserve-fault:slow` makes each step that
runs it take `SLOW_STEP_S` longer (a slow model: the request is surely still in flight when a
suite kills its worker, on however fast a machine). Without the variable the `user` field is what
OpenAI says it is: an opaque end-user id.
"""

from __future__ import annotations

import os
import time

from orcaserve.scheduler.core.scheduler import SchedulerOutput

ENV = "ORCASERVE_TEST_FAULTS"
PREFIX = "orcaserve-fault:"
SLOW_STEP_S = 0.05


class InjectedLoopDeath(BaseException):
    """Escapes every `except Exception`, as a bug in the loop itself would."""


class FaultInjector:
    """Maps request ids to the fault they asked for; the engine thread reads it in `hook`."""

    def __init__(self) -> None:
        self.enabled = os.environ.get(ENV) == "1"
        self._faults: dict[str, str] = {}  # single dict operations: atomic across the two threads

    def arm(self, request_id: str, user: object) -> None:
        if self.enabled and isinstance(user, str) and user.startswith(PREFIX):
            self._faults[request_id] = user[len(PREFIX) :]

    def disarm(self, request_id: str) -> None:
        self._faults.pop(request_id, None)

    def hook(self, sched: SchedulerOutput) -> None:
        """`Engine.fault_hook`: runs on the engine thread before the model."""
        slow = False
        for rid in sched.requests:
            kind = self._faults.get(rid)
            slow |= kind == "slow"
            if kind == "step":
                raise RuntimeError(f"injected step failure (request {rid})")
            if kind == "loop":
                raise InjectedLoopDeath(f"injected engine loop death (request {rid})")
        if slow:
            time.sleep(SLOW_STEP_S)
