"""The adapters of `lora_adapters` loaded for an engine at start (docs/lora.md), into the `LoraSet`
that also takes those loaded at run time."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from orcaserve.scheduler.lora.adapter import ModuleShapes, load_adapter
from orcaserve.scheduler.lora.config import LoraUnsupported, lora_limits
from orcaserve.scheduler.lora.resident import LoraSet
from orcaserve.scheduler.model.bitnet import ARCHITECTURE as BITNET
from orcaserve.scheduler.model.families import LEAN, lean_supports

log = logging.getLogger(__name__)


def load_lora_set(model: Any, config: Any) -> LoraSet | None:
    """Every adapter of `config.lora_adapters` checked against `model` (before the lean decoder
    takes its projections over) and kept in its dtype and device; None without adapters unless
    `config.enable_lora` (adapters loaded at run time). Raises AdapterError or LoraUnsupported
    (ValueErrors) naming what is wrong."""
    adapters: Mapping[str, str] = config.lora_adapters or {}
    if not adapters and not config.enable_lora:
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
    max_rank = config.max_lora_rank
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
    stacked, _ = lora_limits(dict(adapters), config.max_loras, config.max_cpu_loras)
    return LoraSet(loaded, base, weight.dtype, stacked, weight.device, triton_cells(config, stacked, weight.device))


def triton_cells(config: Any, max_loras: int, device: torch.device) -> Any:
    """The Triton kernels' cells where the engine runs the Triton path (a CUDA device, or the
    `triton` attention backend: the CPU under the interpreter), their step descriptors and scratch
    allocated once on `device` for the most rows a forward takes; None elsewhere (docs/lora.md
    "The Triton kernels in the engine")."""
    if device.type != "cuda" and config.resolved_backend() != "triton":
        return None
    from orcaserve.kernels.triton.lora_cells import SegmentBuffers, TritonLora
    from orcaserve.scheduler.model.prompt_logprobs import MAX_ROWS

    rows = max(config.max_num_batched_tokens, MAX_ROWS)
    return TritonLora(SegmentBuffers(rows, max_loras, config.max_lora_rank, device))
