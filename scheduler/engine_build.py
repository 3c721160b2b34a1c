"""How an engine is built: from a checkpoint's path (`Engine.from_pretrained`) or around a model
already loaded (`Engine.from_model`). `Engine` itself is handed in, so this module sits below it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model.build import prepare_model
from orcaserve.scheduler.model.defaults import choose_weights
from orcaserve.scheduler.model.hub import resolve_model
from orcaserve.scheduler.model.loader import load_model_and_tokenizer

E = TypeVar("E")


def from_pretrained(engine_cls: Callable[..., E], path: str, **engine_args: Any) -> E:
    """Load `path` (HF directory, .gguf file, or hub id in the local Hugging Face cache:
    model/hub.py) and build an engine for it."""
    # quantization left null: chosen for the file (model/defaults.py, docs/quantized-weights.md "Defaults")
    config = choose_weights(EngineConfig(**engine_args), resolve_model(path))
    if config.tensor_parallel_size > 1:  # ranks started and each loads its slices (docs/tensor-parallel.md)
        from orcaserve.scheduler.model.parallel.launch import start_engine

        return start_engine(engine_cls, path, config)
    # Quantized: filled a tensor at a time, codes from each one's fp32 values (docs/serving.md
    # "Memory at load"); the rest comes in dtype.
    load_dtype = config.resolved_dtype()
    model, tokenizer = load_model_and_tokenizer(path, load_dtype, config.resolved_device(), config.quantized())
    return from_model(engine_cls, model, tokenizer, config)


def from_model(engine_cls: Callable[..., E], model: Any, tokenizer: Any, config: EngineConfig) -> E:
    """Build an engine around a loaded transformers model (moved to the config's device and
    dtype), sizing the KV cache from `kv_cache_memory`."""
    sizing = prepare_model(model, config)  # checks, device and dtype, the cache's size (model/build.py)
    return engine_cls(model, tokenizer, config, sizing.num_blocks, sizing.max_model_len)
