"""Off and on runs of `orcaserve-bench spec`, taken in alternated pairs (benchmarks/engine/speculative.py):
each side's medians, and each pair's speed-up with their median, which a phase of a shared machine
moves less than a ratio of two sides' medians (it lands on both runs of a pair)."""

from __future__ import annotations

import statistics


def summary(runs: list[dict]) -> dict:
    """One side's runs: the median tok/s (wall, CPU), every run's, and every run's outputs."""
    rates = [r["tok_s"] for r in runs]
    return {
        "tok_s": statistics.median(rates),
        "runs": [round(x, 1) for x in rates],
        "tok_cpu_s": statistics.median(r["tok_cpu_s"] for r in runs),
        "all_outputs": [r["outputs"] for r in runs],
    }


def pairs(offs: list[dict], ons: list[dict]) -> dict:
    """Each alternated pair's speed-up (a phase of a shared machine lands on both runs of a pair
    rather than on one side), their medians, and the totals' (tokens over seconds, each side)."""
    wall = [on["tok_s"] / off["tok_s"] for off, on in zip(offs, ons)]
    cpu = [on["tok_cpu_s"] / off["tok_cpu_s"] for off, on in zip(offs, ons)]

    def rate(runs: list[dict]) -> float:
        return sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs)

    return {
        "ratios": [round(x, 3) for x in wall],
        "ratios_cpu": [round(x, 3) for x in cpu],
        "median": round(statistics.median(wall), 3),
        "median_cpu": round(statistics.median(cpu), 3),
        "total": round(rate(ons) / rate(offs), 3),
    }
