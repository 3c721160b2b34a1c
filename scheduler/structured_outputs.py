"""What a request's output must match (structured outputs), as plain data; compiled in `model/grammar.py`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Bounds on what one request may make admission compile (docs/serving.md, 'Structured outputs and
# tool calls'): a schema's JSON text, a regex, the choices and their total length.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint: `json` (a JSON schema, as its JSON text or a dict), `json_object`
    (any JSON object), `regex`, or `choice` (one of these strings exactly).

    `strict` (JSON only): objects allow no properties the schema does not list, as OpenAI's
    `strict: true` promises; False follows JSON Schema (additional properties allowed unless
    the schema says otherwise). `param` names the request field the constraint came from
    (`response_format`, `tools`, ...), so that an error can name it.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    strict: bool = True
    param: str = "structured_outputs"

    def __init__(
        self,
        json: str | dict | None = None,  # vLLM's field name
        json_object: bool = False,
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        strict: bool = True,
        param: str = "structured_outputs",
    ) -> None:
        set_ = [n for n, v in (("json", json), ("regex", regex), ("choice", choice)) if v is not None]
        if json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(f"{param} must set exactly one of json, json_object, regex, choice; got {set_ or 'none'}")
        if json is not None:
            json = _schema_text(json, param)
        if regex is not None and (not isinstance(regex, str) or not regex):
            raise ValueError(f"{param}: regex must be a non-empty string")
        if choice is not None:
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or len(choice) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise ValueError(f"{param}: choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            choice = tuple(choice)
        if len(json or regex or "".join(choice or ())) > MAX_SPEC_CHARS:
            raise ValueError(f"{param}: the constraint is longer than {MAX_SPEC_CHARS} characters")
        if not isinstance(strict, bool):
            raise ValueError(f"{param}: strict must be a boolean, got {strict!r}")
        for name, value in (
            ("json", json),
            ("json_object", json_object),
            ("regex", regex),
            ("choice", choice),
            ("strict", strict),
            ("param", param),
        ):
            object.__setattr__(self, name, value)

    @property
    def key(self) -> tuple:
        """What the grammar cache is keyed by: equal keys compile to the same grammar."""
        return (self.json, self.json_object, self.regex, self.choice, self.strict)


def _schema_text(schema: Any, param: str) -> str:
    """A schema as JSON text, properties in the order given (the order the output follows)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{param}: the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)
