"""Which model a request's `model` field names: the served model or one of its LoRA adapters
(docs/lora.md "Over HTTP"), as vLLM reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from orcaserve.scheduler.engine_request import EngineRequest


def with_model(
    request: EngineRequest, model: str | None, served: str, adapters: Collection[str], strict: bool = False
) -> EngineRequest:
    """`request` under the LoRA adapter its `model` field names. The served model's name, or no
    name, is the base model; while the worker serves adapters every other name is taken for an
    adapter, and the engine refuses one it does not serve (`UnknownModel`: 404 `model_not_found`
    through the one error path, handler/openai/errors.py). A worker without adapters does not check
    the field (one model per route; docs/api.md), unless `strict` (adapters may be loaded while it
    serves: every name but the served model's is taken for an adapter)."""
    if not (adapters or strict) or model is None or model == served:
        return request
    return dataclasses.replace(request, lora=model)
