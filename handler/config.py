"""The `handler:` section of model-config.yaml: which model, engine arguments, serving defaults."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from orcaserve.scheduler.config import EngineConfig

ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value: Any) -> int | None:
    """An int, or a size like "256MiB" / "1G" (binary units)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '512MiB', got {value!r}")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS["B" if unit == "B" else unit])


def resolve_model_path(path: Any, model_dir: str | None) -> str:
    """`default` (the bundled SmolLM2 GGUF), an absolute path, or one relative to the archive."""
    path = str(path or "default")
    if path == "default":
        from orcaserve.scheduler.loader import default_model_path

        return default_model_path()
    if not os.path.isabs(path) and model_dir:
        return os.path.join(model_dir, path)
    return path


@dataclass
class HandlerConfig:
    """Parsed `handler:` section. Engine arguments are exactly `EngineConfig`'s fields.

    model_path: "default" (the bundled SmolLM2-135M-Instruct GGUF), an absolute path to an HF
    directory or .gguf file, or a path relative to the extracted archive (for --extra-files).
    default_timeout: per-request deadline in seconds when the request has no `timeout`; None = none.
    default_max_tokens: max_tokens when the request has none; None = OpenAI's (16 for
    completions, up to the context length for chat).
    num_threads: torch intra-op threads of the worker; None = leave torch's choice.
    """

    model_path: str
    engine: dict
    default_timeout: float | None = None
    default_max_tokens: int | None = None
    served_model_name: str | None = None
    num_threads: int | None = None

    @classmethod
    def from_dict(cls, section: dict, model_dir: str | None = None) -> "HandlerConfig":
        """Validate the section; an unknown key raises ValueError naming it."""
        section = dict(section)
        serving = {"model_path", "default_timeout", "default_max_tokens", "served_model_name", "num_threads"}
        for key in section:
            if key not in serving and key not in ENGINE_ARGS:
                raise ValueError(f"unknown key {key!r} in model-config.yaml handler section; "
                                 f"known: {sorted(serving | set(ENGINE_ARGS))}")
        path = resolve_model_path(section.pop("model_path", "default"), model_dir)
        timeout = section.pop("default_timeout", None)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"default_timeout must be a positive number of seconds or null, got {timeout!r}")
        max_tokens = section.pop("default_max_tokens", None)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"default_max_tokens must be a positive integer or null, got {max_tokens!r}")
        name = section.pop("served_model_name", None)
        threads = section.pop("num_threads", None)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"num_threads must be a positive integer or null, got {threads!r}")
        if "kv_cache_memory" in section:
            section["kv_cache_memory"] = parse_bytes(section["kv_cache_memory"])
        EngineConfig(**section)  # validate now: a bad value should fail the load with its name
        return cls(path, section, timeout, max_tokens, name, threads)

    def engine_args(self, gpu_id: Any = None) -> dict:
        """Engine arguments; on a GPU worker the device defaults to TorchServe's assigned GPU."""
        args = dict(self.engine)
        if args.get("device") is None and gpu_id is not None:
            import torch

            if torch.cuda.is_available():
                args["device"] = f"cuda:{gpu_id}"
        return args
