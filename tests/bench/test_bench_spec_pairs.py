"""`orcaserve-bench spec`'s alternated pairs (benchmarks/engine/spec_pairs.py): each pair's ratio,
their median and the totals', without a model."""

from __future__ import annotations

from orcaserve.bench.engine.spec_pairs import pairs, summary


def run(tokens: int, wall: float, cpu: float, out: int) -> dict:
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "tok_cpu_s": tokens / cpu,
        "outputs": {"q": [out]},
    }


def test_a_slow_phase_on_one_pair_moves_its_ratio_not_the_median():
    """Three pairs: the second ran in a phase twice as slow, on both of its runs."""
    offs = [run(100, 1.0, 1.0, 1), run(100, 2.0, 1.0, 1), run(100, 1.0, 1.0, 1)]
    ons = [run(100, 0.5, 0.5, 1), run(100, 1.0, 0.4, 1), run(100, 0.4, 0.5, 1)]
    got = pairs(offs, ons)
    assert got["ratios"] == [2.0, 2.0, 2.5] and got["median"] == 2.0
    assert got["ratios_cpu"] == [2.0, 2.5, 2.0] and got["median_cpu"] == 2.0
    assert got["total"] == round((300 / 1.9) / (300 / 4.0), 3)


def test_summary_keeps_every_runs_outputs_for_the_comparison():
    offs = summary([run(100, 1.0, 1.0, 1), run(100, 3.0, 1.0, 2)])
    assert offs["tok_s"] == (100 + 100 / 3) / 2 and offs["all_outputs"] == [{"q": [1]}, {"q": [2]}]
    assert offs["all_outputs"] != summary([run(100, 1.0, 1.0, 1), run(100, 1.0, 1.0, 1)])["all_outputs"]
