"""The adapters of `lora_adapters` loaded for an engine at start (docs/lora.md)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from orcaserve.scheduler.lora.adapter import ModuleShapes, load_adapter
from orcaserve.scheduler.lora.config import LoraUnsupported
from orcaserve.scheduler.lora.resident import LoraSet
from orcaserve.scheduler.model.bitnet import ARCHITECTURE as BITNET
from orcaserve.scheduler.model.families import LEAN, lean_supports

log = logging.getLogger(__name__)


def load_lora_set(model: Any, adapters: Mapping[str, str] | None, max_rank: int) -> LoraSet | None:
    """Every adapter of `adapters` checked against `model` (before the lean decoder takes its
    projections over) and kept in its dtype and device; None without adapters. Raises
    AdapterError or LoraUnsupported (ValueErrors) naming what is wrong."""
    if not adapters:
        return None
    if not lean_supports(model):
        raise LoraUnsupported(
            f"LoRA adapters are served by the lean decoder ({', '.join(LEAN)}); {type(model).__name__} "
            "runs through transformers' forward, where they are not applied"
        )
    if type(model).__name__ == BITNET:
        raise LoraUnsupported(
            "LoRA adapters over a BitNet model are not proven exact (its projections quantize their inputs): "
            "serve the base model alone"
        )
    base = ModuleShapes.of(model)
    weight = model.model.embed_tokens.weight
    loaded = [load_adapter(name, path, base, max_rank, weight.dtype, weight.device) for name, path in adapters.items()]
    for a in loaded:
        log.info(
            "LoRA adapter %s: rank %d, scale %g, %s, %.1f MiB",
            a.name,
            a.rank,
            a.scale,
            "/".join(sorted(a.modules)),
            a.nbytes / 2**20,
        )
    return LoraSet(loaded, base, weight.dtype)
