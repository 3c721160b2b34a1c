"""orcaserve's step counters around a measured load, read from TorchServe's Prometheus endpoint:
steps, tokens fed and tokens generated, so that a run over HTTP can be set beside the same
requests offline by counts that the machine's load does not change (`orcaserve-bench
closed-loop` reports the same ones; docs/serving.md, "The engine's CPU over HTTP")."""

from __future__ import annotations

import re
import time

import requests

COUNTERS = ("orca_steps_total", "orca_step_tokens_total", "orca_generation_tokens_total", "orca_preemptions_total")
_LINE = re.compile(r"^(orca_[a-z_]+)(?:\{[^}]*\})?\s+(\S+)$")

Counts = dict[str, float]


def parse(text: str) -> Counts:
    """The counters of COUNTERS in a Prometheus text page, summed over their label sets."""
    got = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if (m := _LINE.match(line)) and m.group(1) in got:
            got[m.group(1)] += float(m.group(2))
    return got


def read(url: str) -> Counts:
    return parse(requests.get(url, timeout=10).text)


def settled(url: str, tokens: int, timeout: float = 10.0) -> Counts:
    """The counters once the frontend has the load's last emission (the worker reports them as
    log lines that the frontend parses a moment later): read until `tokens` more generated
    tokens than at `url`'s previous state show, or they stop changing, or `timeout`."""
    deadline, last = time.time() + timeout, read(url)
    while time.time() < deadline:
        time.sleep(0.5)
        now = read(url)
        if now == last and now["orca_generation_tokens_total"] >= tokens:
            return now
        last = now
    return last


def delta(before: Counts, after: Counts) -> dict:
    """What the load added: steps, tokens fed and generated, and the per-token ratios."""
    d: dict[str, float | None] = {
        k.removeprefix("orca_").removesuffix("_total"): after[k] - before[k] for k in COUNTERS
    }
    steps, generated = after["orca_steps_total"] - before["orca_steps_total"], d["generation_tokens"]
    d["steps_per_output_token"] = steps / generated if generated else None
    d["tokens_per_step"] = (
        (after["orca_step_tokens_total"] - before["orca_step_tokens_total"]) / steps if steps else None
    )
    return d


def line(d: dict) -> str:
    if not d.get("steps"):
        return "engine counters: no step counted"
    return (
        f"engine counters over the measured load: {d['steps']:.0f} steps, {d['generation_tokens']:.0f} tokens"
        f" generated, {d['steps_per_output_token']:.4f} steps per output token,"
        f" {d['tokens_per_step']:.1f} tokens fed per step, {d['preemptions']:.0f} preemptions"
    )
