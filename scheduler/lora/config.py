"""The engine arguments of LoRA (`lora_adapters`, `max_loras`, `max_cpu_loras`, `max_lora_rank`,
`enable_lora`), checked before any weight loads, and the combinations refused there (docs/lora.md
"What is refused").

Refused, each with the reason in its message, until it is built and proven exact:
- tensor parallelism: the adapters would have to be split like their projections;
- quantized base weights (and int8 activations, which need them): the update would run beside
  low-bit GEMMs that no test holds it to;
- a device other than the CPU: the engine runs the adapters through the Triton kernels there (and
  on the CPU under the interpreter, where tests/engine/test_lora_triton.py holds it to the CPU
  engine), but no GPU has run it yet: the GPU check's `lora_engine` step alone lifts the refusal
  for itself (GPU_CHECK_ENV), to prove it (docs/lora.md "What is refused").
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

# The GPU check's opt-in (benchmarks/gpu/lora_engine.py): "1" lets the engine serve adapters on a
# CUDA device, to prove there what the interpreter proved on the CPU.
GPU_CHECK_ENV = "ORCASERVE_LORA_GPU_CHECK"

# An adapter's name is what a client sends as `model`: printable, no whitespace, not empty.
_NAME = re.compile(r"^[\w.:/@+-]{1,128}$")


def check_adapter_name(name: Any, where: str = "") -> None:
    """Raise ValueError unless `name` may name an adapter (what a client sends as `model`)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}adapter name {name!r} must be 1-128 letters, digits or ._:/@+-")


class LoraUnsupported(ValueError):
    """A LoRA configuration this engine cannot serve exactly; raised before anything loads."""


def check_lora_config(
    adapters: Any,
    max_loras: Any,
    max_rank: Any,
    max_cpu_loras: Any = None,
    enable: Any = False,
    *,
    tensor_parallel_size: int,
    quantization: str | None,
    device: torch.device,
) -> None:
    """Raise ValueError (LoraUnsupported for a combination not built) naming what is wrong."""
    for name, value in (("max_lora_rank", max_rank), ("max_loras", max_loras), ("max_cpu_loras", max_cpu_loras)):
        if value is None and name != "max_lora_rank":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(enable, bool):
        raise ValueError(f"enable_lora must be true or false, got {enable!r}")
    if adapters is None and not enable:
        return
    if adapters is not None and (not isinstance(adapters, dict) or not adapters):
        raise ValueError(f"lora_adapters must be a mapping of adapter name -> directory, got {adapters!r}")
    for name, path in (adapters or {}).items():
        check_adapter_name(name, "lora_adapters: ")
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_adapters: adapter {name!r} needs a directory path, got {path!r}")
    stacked, host = lora_limits(adapters, max_loras, max_cpu_loras)
    if host < stacked:
        raise ValueError(f"max_cpu_loras={host} is below max_loras={stacked}: every stacked adapter is on the host")
    if tensor_parallel_size > 1:
        raise LoraUnsupported("LoRA adapters are not split over ranks: set tensor_parallel_size to 1")
    if quantization is not None:
        raise LoraUnsupported(
            f"LoRA adapters over quantization={quantization!r} weights are not proven exact: set quantization null"
        )
    if device.type != "cpu" and os.environ.get(GPU_CHECK_ENV) != "1":
        raise LoraUnsupported(
            f"LoRA adapters on {device.type}: the engine's Triton path with adapters is proven on the CPU "
            "under the interpreter only, not yet on a GPU (benchmarks/gpu_check.sh's lora_engine step): "
            "serve them on the CPU"
        )


def lora_limits(adapters: dict | None, max_loras: int | None, max_cpu_loras: int | None) -> tuple[int, int]:
    """(`max_loras`, `max_cpu_loras`) resolved: None is as many as `adapters` (at least one stacked,
    no more stacked than `max_cpu_loras`, and at least `max_loras` on the host)."""
    given = len(adapters or ())
    stacked = max_loras if max_loras is not None else max(1, min(given, max_cpu_loras or given))
    return stacked, max_cpu_loras if max_cpu_loras is not None else max(stacked, given)
