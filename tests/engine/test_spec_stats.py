"""Speculation's counters: acceptance at each proposal position and the rows without a proposal
(docs/speculative-decoding.md "Metrics")."""

from __future__ import annotations

import copy

from orcaserve.scheduler.spec.stats import SpecStats


def test_acceptance_by_position_counts_the_decided_proposals():
    stats = SpecStats()
    stats.record(4, 4)  # all four accepted: positions 1-4 decided and accepted
    stats.record(4, 1)  # the first accepted, the second rejected, 3-4 never decided
    stats.record(2, 0)  # the first rejected
    assert stats.checked_at == [3, 2, 1, 1]
    assert stats.accepted_at == [2, 1, 1, 1]
    assert stats.acceptance_by_position() == [round(2 / 3, 4), 0.5, 1.0, 1.0]
    assert stats.to_dict()["acceptance_by_position"] == stats.acceptance_by_position()
    assert (stats.proposed, stats.accepted, stats.speculated_rows) == (10, 5, 3)


def test_a_copy_does_not_share_the_position_counts():
    stats = SpecStats()
    stats.record(2, 1)
    snap = copy.deepcopy(stats)
    stats.record(2, 2)
    assert snap.checked_at == [1, 1] and stats.checked_at == [2, 2]
