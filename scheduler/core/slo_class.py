"""Latency targets per class of traffic (docs/latency-targets.md): a class names a
time-to-first-token target (`ttft_ms`), a time-per-output-token target (`tpot_ms`, judged per
request as the mean gap between its tokens), either or none, and whether a request that can no
longer make its TTFT is refused at once (`slo_reject`). The step they decide: slo_budget.py."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

_TARGETS = ("ttft_ms", "tpot_ms")


@dataclass(frozen=True)
class SloClass:
    """A class of traffic and its targets; no target means best effort."""

    name: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    reject: bool = False  # `slo_reject`: refuse (503) a request that can no longer make its TTFT

    @property
    def targeted(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def check_slo_classes(value: object) -> dict[str, SloClass]:
    """`slo_classes` as given: None, or a mapping of class name to {ttft_ms, tpot_ms, slo_reject}."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"slo_classes must map class names to targets, got {value!r}")
    classes = {}
    for name, spec in value.items():
        spec = {} if spec is None else spec
        if not isinstance(name, str) or not isinstance(spec, Mapping):
            raise ValueError(f"slo_classes must map class names to targets, got {name!r}: {spec!r}")
        unknown = set(spec) - {*_TARGETS, "slo_reject"}
        if unknown:
            raise ValueError(
                f"slo_classes[{name!r}] has unknown keys {sorted(unknown)}; known: ttft_ms, tpot_ms, slo_reject"
            )
        for key in _TARGETS:
            ms = spec.get(key)
            if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < math.inf):
                raise ValueError(f"slo_classes[{name!r}].{key} must be a positive number of milliseconds, got {ms!r}")
        reject = spec.get("slo_reject", False)
        if not isinstance(reject, bool):
            raise ValueError(f"slo_classes[{name!r}].slo_reject must be true or false, got {reject!r}")
        ttft, tpot = spec.get("ttft_ms"), spec.get("tpot_ms")
        classes[name] = SloClass(
            name, None if ttft is None else float(ttft), None if tpot is None else float(tpot), reject
        )
    return classes
