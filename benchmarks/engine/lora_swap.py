"""`orcaserve-bench lora --swap-cost`: what changing the stacked LoRA adapters costs (docs/lora.md
"More adapters than a step holds"; dated runs in docs/performance-log.md).

    orcaserve-bench lora --swap-cost --adapters 8 --ranks 16 --max-loras 4

No engine, no model weights: the model's config gives the shapes. `--adapters` random adapters
(every projection of every layer, `write_adapter`) are written to a temporary directory and read
back with the engine's loader, timed (what a runtime load costs on the reader thread); then they
sit on the host with `--max-loras` slots, and slots change by LRU, one swap at a time, each timed
around `LoraSet.sync` (the copy from the host copy a step pays when it admits a request of an
adapter not stacked). One torch thread, as the engine thread runs its work.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from orcaserve.scheduler.lora.adapter import TARGETS, ModuleShapes, load_adapter
from orcaserve.scheduler.lora.resident import LoraSet


def swap_cost(config: Any, rank: int, count: int, max_loras: int, dtype: torch.dtype, swaps: int = 60) -> dict:
    """Median read time of one adapter and median time of one slot swap (and its p90)."""
    from orcaserve.bench.engine.lora import _WIDTHS as widths
    from orcaserve.bench.engine.lora import write_adapter

    torch.set_num_threads(1)
    head_dim = config.hidden_size // config.num_attention_heads
    shapes = ModuleShapes(config.num_hidden_layers, {m: widths[m](config, head_dim) for m in TARGETS})
    loads = []
    with tempfile.TemporaryDirectory(prefix="orca-lora-swap-") as tmp:
        adapters = []
        for i in range(count):
            write_adapter(Path(tmp) / f"a{i}", config, rank, seed=i)
            started = time.perf_counter()
            adapters.append(load_adapter(f"a{i}", str(Path(tmp) / f"a{i}"), shapes, rank, dtype, torch.device("cpu")))
            loads.append(time.perf_counter() - started)
    loras = LoraSet(adapters, shapes, dtype, max_loras)
    times = []
    for n in range(swaps):  # each admission names an adapter not stacked: the LRU one leaves
        loras.slots.admit(f"a{(max_loras + n) % count}", frozenset)
        started = time.perf_counter()
        loras.sync()
        times.append(time.perf_counter() - started)
    times.sort()
    result = {
        "adapters": count,
        "rank": rank,
        "max_loras": max_loras,
        "adapter_mib": round(adapters[0].nbytes / 2**20, 2),
        "load_ms": round(1e3 * statistics.median(loads), 2),
        "swap_ms": round(1e3 * statistics.median(times), 2),
        "swap_p90_ms": round(1e3 * times[int(0.9 * len(times))], 2),
        "evictions": loras.slots.num_evictions,
    }
    print(
        f"{count} adapters of rank {rank} ({result['adapter_mib']} MiB each), {max_loras} slots: read and checked "
        f"{result['load_ms']} ms; one slot swap {result['swap_ms']} ms (p90 {result['swap_p90_ms']} ms)",
        file=sys.stderr,
    )
    return result
