"""Speculation's counters: what the metrics and the benchmark report (docs/speculative-decoding.md "Metrics")."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Running totals since the engine started."""

    method: str = "ngram"
    proposed: int = 0  # proposed tokens checked by the target
    accepted: int = 0  # of those, accepted (emitted as they were proposed)
    speculated_rows: int = 0  # row-steps that carried proposals
    steps_on: int = 0  # steps in which at least one row speculated
    steps_off: int = 0  # steps with decode rows that could have speculated and did not
    failed_steps: int = 0  # steps whose proposer raised (a draft model's forward): they decoded plainly
    unmatched_rows: int = 0  # row-steps that could have speculated and had no proposal (no n-gram found)
    # Proposals decided at position j (index j - 1; the accepted ones and the first rejected one)
    # and of those accepted: the acceptance at each position given the ones before were accepted.
    checked_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.speculated_rows += 1
        for at, n in ((self.checked_at, min(accepted + 1, proposed)), (self.accepted_at, accepted)):
            at.extend([0] * (n - len(at)))
            for j in range(n):
                at[j] += 1

    def acceptance_by_position(self) -> list[float]:
        """At each proposal position, the share of proposals accepted of those decided there."""
        acc = self.accepted_at + [0] * (len(self.checked_at) - len(self.accepted_at))
        return [round(a / c, 4) for a, c in zip(acc, self.checked_at)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculated row emitted per step: its accepted proposals and the target's own."""
        return (self.accepted + self.speculated_rows) / self.speculated_rows if self.speculated_rows else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_dict(self) -> dict[str, float | int | str | list[float] | list[int]]:
        return {
            "method": self.method,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "speculated_rows": self.speculated_rows,
            "steps_on": self.steps_on,
            "steps_off": self.steps_off,
            "failed_steps": self.failed_steps,
            "unmatched_rows": self.unmatched_rows,
            "acceptance_by_position": self.acceptance_by_position(),
            "checked_by_position": list(self.checked_at),
        }
