"""A request body as TorchServe hands it over (a dict, or bytes), checked for what no field may hold."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from orcaserve.handler.openai.protocol import ProtocolError

MAX_NESTING = 32


def decode_body(raw: Any) -> dict:
    """The JSON object of a request: TorchServe passes a dict for application/json, else bytes.

    Refuses (400) what no field may hold: invalid UTF-8, nesting deeper than `MAX_NESTING`, and
    strings that are not valid Unicode (JSON's `\\ud800` escapes decode to unpaired surrogates,
    which tokenizers and encoders reject later, far from the request).
    """
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("request body is not valid UTF-8") from None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("request body must be a JSON object")
    try:
        _check_values(raw, 0)
    except _BadValue as e:
        path = "".join(e.path).lstrip(".")
        field = path.split(".")[0].split("[")[0] or None  # the top-level field, for `param`
        if e.nesting:
            raise ProtocolError(f"request body nests deeper than {MAX_NESTING} levels", field) from None
        raise ProtocolError(
            f"{path or 'request body'} is not valid Unicode (an unpaired UTF-16 surrogate)", field
        ) from None
    return raw


class _BadValue(Exception):
    """Raised deep in a body; each level adds its key on the way out, so a valid body, the usual
    case, costs no path strings: a 1 MiB body is walked on the asyncio thread."""

    def __init__(self, nesting: bool) -> None:
        self.nesting = nesting
        self.path: list[str] = []


def _check_values(value: Any, depth: int) -> None:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _BadValue(nesting=False) from None
        return
    if not isinstance(value, (dict, list)) or not value:
        return
    if depth >= MAX_NESTING:  # its members would be deeper
        raise _BadValue(nesting=True)
    is_dict = isinstance(value, dict)
    members: Iterable[tuple[Any, Any]] = value.items() if isinstance(value, dict) else enumerate(value)
    for key, v in members:
        if is_dict:
            _check_values(key, depth + 1)  # a bad key is reported at its object's path
        if isinstance(v, (str, dict, list)):
            try:
                _check_values(v, depth + 1)
            except _BadValue as e:
                e.path.insert(0, f".{key}" if is_dict else f"[{key}]")
                raise


def check_size(raw: Any, content_length: str | None, limit: int | None) -> None:
    """`max_body_bytes` (`limit`): from Content-Length when the frontend passes it, else measured."""
    if limit is None:
        return
    if content_length and content_length.strip().isdigit():
        size = int(content_length)
    elif isinstance(raw, (bytes, bytearray, str)):
        size = len(raw)
    else:
        try:
            size = len(json.dumps(raw))
        except (ValueError, RecursionError):
            return  # decode_body refuses it next, with a better reason
    if size > limit:
        raise ProtocolError(
            f"request body has {size} bytes; this server accepts at most {limit} (max_body_bytes)", None, 413
        )
