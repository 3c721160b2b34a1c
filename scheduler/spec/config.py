"""The `speculative` engine argument, checked at load (docs/speculative-decoding.md "Configuration").

In vLLM's words: `{method: ngram, num_speculative_tokens: K, prompt_lookup_min: a,
prompt_lookup_max: b}` (prompt lookup) or `{method: draft, model: <HF dir or .gguf>,
num_speculative_tokens: K}` (a smaller model proposing, scheduler/spec/draft.py). A bad value is
refused with a message naming the key; a combination not built yet (a GPU, asynchronous
scheduling, tensor parallelism) is refused with the reason, before any weight is loaded. The
draft's own checks (its vocabulary against the target's) come when it loads, with the engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The most proposals a row may carry in a step: far beyond where prompt lookup still pays.
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 16
# Set to 1 by the GPU check's `spec` step only: lets speculation run on a GPU so that step can prove
# its outputs equal speculation off (docs/speculative-decoding.md "What is refused").
GPU_CHECK_ENV = "ORCASERVE_SPECULATIVE_GPU_CHECK"
# The settings of each method (the proposers' table, spec/proposers.py `PROPOSERS`, has one
# proposer per method named here; a test holds the two to the same names).
COMMON = frozenset({"method", "num_speculative_tokens", "min_accepted"})
METHOD_KEYS: dict[str, frozenset[str]] = {
    "ngram": COMMON | {"prompt_lookup_min", "prompt_lookup_max"},
    "draft": COMMON | {"model", "quantization"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt lookup (ngram: proposals from the request's own prompt and output) or a draft
    model (draft: `model`, its weights' `quantization`, null: chosen for the file as the
    engine's are)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Stop proposing for a request whose accepted tokens per speculated step stay below this
    # (docs/speculative-decoding.md "When it pays").
    min_accepted: float = 0.3
    model: str | None = None
    quantization: str | None = None

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """`value` as the engine argument or model-config.yaml key gives it (a mapping, or None:
        off); raises ValueError naming the offending key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative must be a mapping such as {{method: ngram, ...}} or null, got {value!r}")
        method = value.get("method")
        if not isinstance(method, str) or method not in METHOD_KEYS:
            known_methods = " or ".join(repr(m) for m in METHOD_KEYS)
            raise ValueError(f"speculative.method must be {known_methods}, got {method!r}")
        known = METHOD_KEYS[method]
        for key in value:
            if key not in known:
                raise ValueError(
                    f"speculative.{key} is not a setting of method {method!r} (known: {', '.join(sorted(known))})"
                )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative.num_speculative_tokens is required (proposals per request and step)")
        k = _int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS) or 0
        low = _int(value, "prompt_lookup_min", 1, MAX_LOOKUP, default=None)
        high = _int(value, "prompt_lookup_max", 1, MAX_LOOKUP, default=None)
        if low is None and high is None:
            low, high = cls.prompt_lookup_min, cls.prompt_lookup_max
        elif low is None:
            low = min(cls.prompt_lookup_min, high or cls.prompt_lookup_min)
        elif high is None:
            high = max(low, cls.prompt_lookup_max)
        assert low is not None and high is not None
        if low > high:
            raise ValueError(f"speculative.prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        floor = value.get("min_accepted", cls.min_accepted)
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= k:
            raise ValueError(f"speculative.min_accepted must be a number in [0, {k}], got {floor!r}")
        model, quantization = value.get("model"), value.get("quantization")
        if method == "draft" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative.model (the draft's HF directory or .gguf file) is required, got {model!r}")
        if quantization is not None and not isinstance(quantization, str):
            raise ValueError(f"speculative.quantization must be a string or null, got {quantization!r}")
        return cls(method, k, low, high, float(floor), model, quantization)

    def check_engine(
        self, device: str, async_scheduling: bool | None, tensor_parallel_size: int, max_num_seqs: int
    ) -> None:
        """Combinations not built yet, refused at load with the reason (docs/speculative-decoding.md
        "What composes")."""
        if device != "cpu" and os.environ.get(GPU_CHECK_ENV) != "1":
            raise ValueError(
                f"speculative decoding runs on the CPU engine only for now (device {device!r}): "
                "its rows are not proven exact on the GPU path; set speculative null there"
            )
        if async_scheduling:
            raise ValueError(
                "speculative decoding needs the synchronous step (its proposals are checked before the next "
                "step is scheduled): set async_scheduling false or null"
            )
        if tensor_parallel_size > 1:
            raise ValueError("speculative decoding is not built for tensor_parallel_size > 1: set speculative null")
        if self.num_speculative_tokens + 1 > max_num_seqs:
            raise ValueError(
                f"speculative.num_speculative_tokens ({self.num_speculative_tokens}) + 1 logits rows must fit "
                f"max_num_seqs ({max_num_seqs}), the step's sampled rows"
            )


def _int(value: Mapping[str, Any], key: str, low: int, high: int, default: int | None = 0) -> int | None:
    if key not in value:
        return default
    v = value[key]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"speculative.{key} must be an integer in [{low}, {high}], got {v!r}")
    return v
