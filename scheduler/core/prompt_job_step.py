"""The engine's per-step turn of the prompt log-probabilities jobs (prompt_jobs.py): one chunk of
the oldest job; once it is done its requests are scheduled, and if it raised its request fails
alone (every choice)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from orcaserve.scheduler.core.choices import Choices
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.core.prompt_jobs import PromptJobs
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.scheduler import Scheduler

log = logging.getLogger(__name__)


def advance_prompt_job(
    prompt_jobs: PromptJobs,
    scheduler: Scheduler,
    choices: Choices,
    fail: Callable[[Request, Exception], RequestOutput],
) -> list[RequestOutput]:
    """One chunk of the oldest prompt log-probabilities job: once it is done its requests are
    scheduled; if it raised, its request fails alone (every choice, through `fail`)."""
    ended = prompt_jobs.advance()
    if ended is None:
        return []
    request_id, held, error = ended
    if error is None:
        for req in held.to_schedule:
            scheduler.add_request(req)
        return []
    log.error("prompt log-probabilities of %s failed: %s: %s", request_id, type(error).__name__, error)
    choices.take_held(request_id)
    for req in held.receivers:  # never scheduled: nothing to free
        req.status, req.finish_reason = RequestStatus.FINISHED, "error"
    return [fail(req, error) for req in held.receivers]
