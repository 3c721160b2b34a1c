"""What a step costs: an online least-squares model of a step's time from what it computes
(docs/latency-targets.md, "The step-cost model").

A step's time is modelled as `c0 + c_p * prompt tokens + c_d * decode rows + c_a * context`,
where `context` is the K/V its attention reads, in thousands of token pairs: a row of `n` tokens
after `c` cached ones reads about `n * (c + n / 2)`. The coefficients are the non-negative least
squares fit over the last `window` steps the engine measured, refitted every `refresh` steps; a
feature no recorded step has varied keeps the coefficient 0 (the fit is the minimum-norm one).
Until `warm` steps are recorded there is no model and `predict` returns None: the scheduler
plans full steps, and the first steps (prompts being computed, then decodes) are its warm start.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("intercept", "prompt_tokens", "decode_rows", "context_kilo")


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the model's terms."""

    prompt_tokens: int  # tokens of rows that are not single-token decodes (prompt chunks, recomputation)
    decode_rows: int  # rows that feed one token and sample the next (a verifying row: one per checked token)
    context: float  # K/V token pairs the attention reads, in thousands

    def row(self) -> list[float]:
        return [1.0, float(self.prompt_tokens), float(self.decode_rows), self.context]


def row_context(computed: int, n: int) -> float:
    """Thousands of K/V token pairs read by a row feeding `n` tokens after `computed` cached ones."""
    return n * (computed + (n + 1) / 2) / 1000.0


class StepCostModel:
    """Least squares of step seconds on `StepShape`, refreshed as steps are recorded; tracks its
    own error on steps it had not yet seen (the prediction made before each was recorded)."""

    def __init__(self, window: int = 256, refresh: int = 8, warm: int = 8) -> None:
        self.window, self.refresh, self.warm = window, refresh, warm
        self._rows: deque[list[float]] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.coefficients: list[float] | None = None  # per FEATURES, seconds
        self.num_observed = 0
        # Online error: the mean absolute error relative to the measured time, over the steps
        # predicted before they were recorded (exponentially weighted, 1/64 per step).
        self.relative_error: float | None = None
        self.last_predicted: float | None = None
        self.last_measured: float | None = None

    def predict(self, shape: StepShape) -> float | None:
        """Seconds the step should take, or None before the warm start."""
        if self.coefficients is None:
            return None
        return sum(c * x for c, x in zip(self.coefficients, shape.row()))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record a step the engine ran and timed."""
        predicted = self.predict(shape)
        if predicted is not None and seconds > 0:
            err = abs(predicted - seconds) / seconds
            self.relative_error = (
                err if self.relative_error is None else self.relative_error + (err - self.relative_error) / 64
            )
        self.last_predicted, self.last_measured = predicted, seconds
        self._rows.append(shape.row())
        self._times.append(seconds)
        self.num_observed += 1
        self._since_fit += 1
        if len(self._rows) >= self.warm and (self.coefficients is None or self._since_fit >= self.refresh):
            self.coefficients = fit(list(self._rows), list(self._times))
            self._since_fit = 0


def fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Non-negative least squares (active set over the four features: a feature whose
    coefficient comes out negative is dropped and the rest refitted), minimum-norm where the
    steps leave a coefficient undetermined. In numpy: a 256 x 4 fit is tens of microseconds on
    the calling thread, where torch's op cost 0.16 ms on one thread and went through OpenMP on two
    (the speculation policy refits every 8 steps, docs/speculative-decoding.md "When it pays")."""
    x = np.array(rows, dtype=np.float64)  # [steps, features]
    y = np.array(times, dtype=np.float64)  # [steps]
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1], dtype=np.float64)
    while active:
        # pinv gives the minimum-norm solution when features are collinear (e.g. no prompt yet)
        c = np.linalg.pinv(x[:, active]) @ y  # [active]
        if bool((c >= 0).all()):
            coef = np.zeros(x.shape[1], dtype=np.float64)
            coef[active] = c
            break
        del active[int(np.argmin(c))]
    return coef.tolist()
