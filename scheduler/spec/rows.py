"""The logits rows of a step with speculated rows (`StepBuffers.prepare`): a row that samples
feeds its last `1 + K` tokens' logits, K its proposals (0 for a row without)."""

from __future__ import annotations

import numpy as np

from orcaserve.scheduler.core.step_output import SchedulerOutput


def sample_rows(last: np.ndarray, sched: SchedulerOutput) -> np.ndarray:  # last [B] -> [S]
    """The packed positions whose logits the step samples, in the order of `sched.sampling`."""
    sampling = {r.request_id for r in sched.sampling}
    spec = sched.spec
    rows: list[int] = []
    for i, rid in enumerate(sched.num_scheduled_tokens):
        if rid in sampling:
            end = int(last[i])
            rows.extend(range(end - len(spec.get(rid, ())), end + 1))
    return np.array(rows, dtype=np.int64)
