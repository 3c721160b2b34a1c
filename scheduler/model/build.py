"""A loaded model made ready for an engine, and its KV cache sized and allocated (`Engine.from_model`).

Apart from engine.py because it is done once, before the first step: the model is checked
(docs/serving.md "Supported architectures", "Quantized weights"), quantized if asked, moved to the
config's device and dtype, and the cache's blocks and the longest sequence are worked out from
`kv_cache_memory` and the model's limits (docs/kv-cache.md "Paged KV cache"); the engine's
constructor then allocates that many blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model.bitnet import check_bitnet
from orcaserve.scheduler.model.families import check_architecture, check_quantization, length_cap
from orcaserve.scheduler.model.loader import model_dims
from orcaserve.scheduler.model.model_runner import CausalLM
from orcaserve.scheduler.model.quantized import mark_activations, quantize_model

log = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class KVSizing:
    """What the engine's constructor takes besides the model: the cache's blocks and the longest
    sequence (prompt and output) a request may have."""

    num_blocks: int
    max_model_len: int


def prepare_model(model: CausalLM, config: EngineConfig) -> KVSizing:
    """Check `model`, quantize it if the config asks, move it to the config's device and dtype
    (in place, in eval mode), and size the KV cache; raises ValueError for what cannot be served."""
    check_architecture(model, config.allow_unverified_architecture)
    quantization = config.quantized()
    if config.activations is not None and quantization is None:  # left to from_pretrained, not resolved
        raise ValueError(f"activations={config.activations!r} runs against quantized weights only: set quantization")
    check_quantization(model, quantization)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    check_bitnet(model, device)
    if quantization:  # before the cast to dtype: codes from the fp32 weights
        quantize_model(model, quantization, dtype)
        mark_activations(model, config.activations)
    model.to(device=device, dtype=dtype).eval()
    layers, n_kv, head_dim = model_dims(model.config)
    budget = config.kv_cache_memory
    if budget is None:
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.8) if device.type == "cuda" else _CPU_KV_BYTES
    block_bytes = 2 * layers * config.block_size * n_kv * head_dim * torch.finfo(dtype).bits // 8
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {block_bytes} bytes")
    capacity = num_blocks * config.block_size
    model_limit = getattr(model.config, "max_position_embeddings", None) or capacity
    window = length_cap(model)  # the lean decoder is exact only while a sequence fits the window
    max_model_len = config.max_model_len or min(model_limit, capacity, window or capacity)
    if max_model_len > capacity:
        raise ValueError(f"max_model_len={max_model_len} exceeds the KV cache capacity of {capacity} tokens")
    if window is not None and max_model_len > window:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's sliding attention window of {window} tokens, "
            "which orcaserve's paged attention does not apply"
        )
    if window is not None and window < model_limit:
        log.warning(
            "max_model_len capped at the sliding attention window (%d tokens; the model takes %d)",
            window,
            model_limit,
        )
    return KVSizing(num_blocks, max_model_len)


def allocate_kv_caches(
    model: CausalLM, config: EngineConfig, num_blocks: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The paged cache's K and V tensors, one pair per layer, each [num_blocks, block_size, kv_heads,
    head_dim] on the config's device and dtype."""
    layers, n_kv, head_dim = model_dims(model.config)
    shape = (num_blocks, config.block_size, n_kv, head_dim)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    # Zero-filled so never-written slots are finite: masking them out is then enough.
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(layers)
    ]
