"""The bytes bound of a decode step: the weights and the K/V it must read, over
the device's measured copy bandwidth. gpu_graphs.py sets each decode row's median against it."""

from __future__ import annotations


def copy_gbps(dev) -> float | None:
    """Device-to-device copy of 1 GiB, bytes read + written per second (kernel_timing's measure)."""
    if dev.type != "cuda":
        return None
    from orcaserve.bench.kernel_timing import Timer
    from orcaserve.bench.kernel_timing import copy_gbps as measure

    return measure(dev, Timer(dev))


def decode_bound(model, batch: int, context: int, gbps: float | None) -> dict:
    """Bytes one decode step of `batch` requests at `context` tokens reads, and the time they take
    at `gbps` (None without a measurement)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    elem = next(model.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem
    out = {"weight_bytes": weights, "kv_bytes": kv, "copy_gbps": gbps}
    if gbps:
        out["bound_ms"] = (weights + kv) / (gbps * 1e9) * 1e3
    return out
