"""The `handler:` section of model-config.yaml: which model, engine arguments, serving defaults."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, cast

from orcaserve.handler.reasoning import STYLES
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model.hub import parse_hub_id

ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 field name


def parse_bytes(value: Any, name: str = "kv_cache_memory") -> int | None:
    """An int, or a size like "256MiB" / "1G" (binary units)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"{name} must be bytes or a size like '512MiB', got {value!r}")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS["B" if unit == "B" else unit])


def resolve_model_path(path: Any, model_dir: str | None) -> str:
    """`default` (the bundled SmolLM2 GGUF), an absolute path, one relative to the archive (weights
    bundled into it), or a Hugging Face hub id, left for the loader to find in the serving
    machine's cache (scheduler/model/hub.py)."""
    path = str(path or "default")
    if path == "default":
        from orcaserve.scheduler.model.loader import default_model_path

        return default_model_path()
    if not os.path.isabs(path) and model_dir:
        inside = os.path.join(model_dir, path)
        if os.path.exists(inside) or parse_hub_id(path) is None:
            return inside
    return path


def _positive(name: str, value: Any, kind: type | tuple[type, ...] = int, allow_none: bool = True) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or cast(Any, value) <= 0:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be a positive {what}{' or null' if allow_none else ''}, got {value!r}")
    return value


def _header_name(value: Any, key: str = "tenant_header") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise ValueError(f"{key} must be an HTTP header name like 'X-Tenant-Id' or null, got {value!r}")
    return value


def _tenant_classes(value: Any, classes: Any) -> dict[str, str]:
    """`tenant_slo_class`: tenant name -> a class of `slo_classes`."""
    if value is None:
        return {}
    known = classes if isinstance(classes, dict) else {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"tenant_slo_class must map tenant names to class names, got {value!r}")
    for tenant, name in value.items():
        if name not in known:
            raise ValueError(f"tenant_slo_class[{tenant!r}] names {name!r}, not a class of slo_classes {sorted(known)}")
    return dict(value)


def _reasoning_parser(value: Any) -> str | None:
    """`reasoning_parser`: qwen3, deepseek_r1, auto (from the chat template) or none / null (off)."""
    if value not in (None, "none", "auto", *STYLES):
        raise ValueError(f"reasoning_parser must be one of {[*STYLES, 'auto', 'none']}, got {value!r}")
    return None if value == "none" else value


@dataclass
class HandlerConfig:
    """Parsed `handler:` section. Engine arguments are exactly `EngineConfig`'s fields.

    model_path: "default" (the bundled SmolLM2-135M-Instruct GGUF), an absolute path to an HF
    directory or .gguf file, a path relative to the extracted archive (weights bundled into it),
    or a Hugging Face hub id (`org/name[@revision][/file.gguf]`) found in the serving machine's
    local Hugging Face cache.
    default_timeout: per-request deadline in seconds when the request has no `timeout`; None = none.
    default_max_tokens: max_tokens when the request has none; None = OpenAI's (16 for
    completions, up to the context length for chat), capped by `max_tokens_limit`.
    num_threads: torch intra-op threads of the worker; None = leave torch's choice.
    tenant_header: the request header (set by a trusted gateway) naming the tenant; prefix-cache
    blocks are shared only within a tenant, and requests without the header are refused (400).
    None = one tenant; the `cache_salt` body field alone separates (handler/openai/tenancy.py).
    slo_class_header: the request header (set by a trusted gateway) naming the request's class of
    latency targets (`slo_classes`); `tenant_slo_class`: tenant -> class when the header is absent
    (docs/latency-targets.md). None: no class, no target.
    reasoning_parser: how the model's `<think>` thinking is split from its answer (qwen3,
    deepseek_r1; auto: from the chat template; None: not split) (docs/protocols.md, 'Reasoning').
    lora_runtime_updates: the routes that load and unload LoRA adapters while serving, behind the
    management key (docs/lora.md, 'Loading and unloading while serving'); off by default.
    Limits (docs/reliability.md#limits): `max_body_bytes` per request body, `max_tokens_limit` on
    a request's `max_tokens`, `max_waiting_requests` sequences waiting beyond the engine's
    `max_num_seqs` seats, per worker (beyond seats plus queue: 503 with Retry-After). None =
    unlimited. `max_frame_bytes`: the largest frame
    sent to the frontend, which refuses one above its `max_response_size` (6,553,500 bytes by
    default; the request is then never answered); longer bodies go out in several frames.
    neighbour_nice: the niceness a TorchServe worker gives its frontend's threads and its own
    threads other than the engine's (neighbours.py); 0 = leave them alone.
    """

    model_path: str
    engine: dict
    default_timeout: float | None = None
    default_max_tokens: int | None = None
    served_model_name: str | None = None
    num_threads: int | None = None
    max_body_bytes: int | None = 1 << 20
    max_tokens_limit: int | None = 2048
    max_waiting_requests: int | None = 64
    tenant_header: str | None = None
    max_frame_bytes: int = 1 << 20
    slo_class_header: str | None = None
    tenant_slo_class: dict[str, str] = dataclasses.field(default_factory=dict)
    reasoning_parser: str | None = "auto"
    lora_runtime_updates: bool = False
    neighbour_nice: int = 0

    SERVING_KEYS = (
        "model_path",
        "default_timeout",
        "default_max_tokens",
        "served_model_name",
        "num_threads",
        "max_body_bytes",
        "max_tokens_limit",
        "max_waiting_requests",
        "tenant_header",
        "max_frame_bytes",
        "slo_class_header",
        "tenant_slo_class",
        "reasoning_parser",
        "lora_runtime_updates",
        "neighbour_nice",
    )

    @classmethod
    def from_dict(cls, section: dict, model_dir: str | None = None) -> HandlerConfig:
        """Validate the section; an unknown key raises ValueError naming it."""
        section = dict(section)
        for key in section:
            if key not in cls.SERVING_KEYS and key not in ENGINE_ARGS:
                raise ValueError(
                    f"unknown key {key!r} in model-config.yaml handler section; "
                    f"known: {sorted(set(cls.SERVING_KEYS) | set(ENGINE_ARGS))}"
                )
        path = resolve_model_path(section.pop("model_path", "default"), model_dir)
        serving: dict[str, Any] = {
            "default_timeout": _positive("default_timeout", section.pop("default_timeout", None), (int, float)),
            "default_max_tokens": _positive("default_max_tokens", section.pop("default_max_tokens", None)),
            "served_model_name": section.pop("served_model_name", None),
            "num_threads": _positive("num_threads", section.pop("num_threads", None)),
            "tenant_header": _header_name(section.pop("tenant_header", None)),
            "slo_class_header": _header_name(section.pop("slo_class_header", None), "slo_class_header"),
            "tenant_slo_class": _tenant_classes(section.pop("tenant_slo_class", None), section.get("slo_classes")),
            "reasoning_parser": _reasoning_parser(section.pop("reasoning_parser", "auto")),
        }
        for key in ("max_body_bytes", "max_tokens_limit", "max_waiting_requests"):
            if key in section:
                value = section.pop(key)
                serving[key] = _positive(key, parse_bytes(value, key) if key == "max_body_bytes" else value)
        if "max_frame_bytes" in section:  # never unlimited: the frontend's own limit would hit
            value = parse_bytes(section.pop("max_frame_bytes"), "max_frame_bytes")
            serving["max_frame_bytes"] = _positive("max_frame_bytes", value, allow_none=False)
        nice = serving["neighbour_nice"] = section.pop("neighbour_nice", 0)
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"neighbour_nice must be an integer from 0 to 19, got {nice!r}")
        runtime = serving["lora_runtime_updates"] = section.pop("lora_runtime_updates", False)
        if not isinstance(runtime, bool):
            raise ValueError(f"lora_runtime_updates must be true or false, got {runtime!r}")
        if runtime:  # the engine holds a LoRA set even with no adapter at start (lora/runtime.py)
            section.setdefault("enable_lora", True)
        if "kv_cache_memory" in section:
            section["kv_cache_memory"] = parse_bytes(section["kv_cache_memory"])
        adapters = section.get("lora_adapters")
        if isinstance(adapters, dict) and model_dir:  # paths relative to the archive: bundled adapters
            section["lora_adapters"] = {
                n: os.path.join(model_dir, p) if isinstance(p, str) and p and not os.path.isabs(p) else p
                for n, p in adapters.items()
            }
        EngineConfig(**section)  # validate now: a bad value should fail the load with its name
        return cls(path, section, **serving)

    def engine_args(self, gpu_id: Any = None) -> dict:
        """Engine arguments; on a GPU worker the device defaults to TorchServe's assigned GPU."""
        args = dict(self.engine)
        if args.get("device") is None and gpu_id is not None:
            import torch

            if torch.cuda.is_available():
                args["device"] = f"cuda:{gpu_id}"
        return args
