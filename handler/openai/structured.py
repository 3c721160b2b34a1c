"""Structured outputs as OpenAI and vLLM clients ask for them, turned into the engine's
`StructuredOutputs` (compiled at admission: scheduler/model/grammar.py).

OpenAI: `response_format` `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}` (chat). vLLM's extra-body shapes (chat and completions):
`structured_outputs` `{"json" | "regex" | "choice" | "json_object": ...}` and the older
`guided_json`, `guided_regex`, `guided_choice`. One of them per request.
"""

from __future__ import annotations

from typing import Any

from orcaserve.scheduler.structured_outputs import StructuredOutputs

VLLM_FIELDS = frozenset({"structured_outputs", "guided_json", "guided_regex", "guided_choice"})
FIELDS = VLLM_FIELDS | {"response_format"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
_VLLM_KEYS = {"json", "regex", "choice", "json_object"}


class FieldError(ValueError):
    """A malformed request field (`param`); protocol.py answers it with a 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs(body: dict) -> StructuredOutputs | None:
    """The constraint `body` asks for (None: free text); raises FieldError naming the field for a
    malformed one. Whether a schema compiles is known at admission (also a 400)."""
    asked = sorted(k for k in FIELDS if body.get(k) is not None and body[k] != {"type": "text"})
    if len(asked) > 1:
        raise FieldError(f"only one of {', '.join(asked)} may be set", asked[1])
    if not asked:
        return None
    name = asked[0]
    value = body[name]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict) or not set(value) <= _VLLM_KEYS:
                raise ValueError(f"structured_outputs must be an object with one of {sorted(_VLLM_KEYS)}")
            return StructuredOutputs(**value, param=name)
        return StructuredOutputs(**{_GUIDED[name]: value}, param=name)
    except (ValueError, TypeError) as e:
        raise FieldError(str(e), name) from None


def _response_format(fmt: Any) -> StructuredOutputs:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError("response_format.json_schema must be an object with a name (and a schema)")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
        schema = spec.get("schema")
        return StructuredOutputs(json={} if schema is None else schema, strict=bool(strict), param="response_format")
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
