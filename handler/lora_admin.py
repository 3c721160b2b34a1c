"""Loading and unloading LoRA adapters while serving: `v1/load_lora_adapter` and
`v1/unload_lora_adapter` in vLLM's shape (`{"lora_name", "lora_path"}`), reached through
TorchServe's inference API like the other routes (docs/lora.md "Loading and unloading while
serving"; docs/api.md).

Off unless the model config sets `lora_runtime_updates: true` (vLLM keeps its routes behind
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). The frontend checks the inference key as for any request;
these routes also need TorchServe's management key, sent as `X-Management-Key`, read from the
frontend's `key_file.json` at each call (keys rotate and expire). Without token authorization
there is no management key, and the routes refuse every call.

An adapter is read and checked on a thread of its own, beside the step loop (`LoraRegistry.read`
touches no engine state); the engine thread then only puts it on the host (`EngineLoop.call`).
A refusal names what is wrong and changes nothing: the base model and the other adapters keep
serving.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orcaserve.handler.openai.protocol import ProtocolError
from orcaserve.scheduler.errors import UnknownModel
from orcaserve.scheduler.lora.adapter import AdapterError
from orcaserve.scheduler.serving.engine_loop import EngineLoop

LOAD, UNLOAD = "load_lora_adapter", "unload_lora_adapter"  # the endpoint kinds (protocols.py)
KEY_HEADER = "x-management-key"
# One reader thread: loads run one at a time, and only one more thread ever runs torch work.
_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orca-lora-load")


def frontend_key_file() -> str:
    """TorchServe writes `key_file.json` into its working directory; the worker is its child."""
    return os.path.join(os.readlink(f"/proc/{os.getppid()}/cwd"), "key_file.json")


def management_key(path: str) -> str | None:
    """The management key in `path` while it has not expired; None without one."""
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)["management"]
        expires = datetime.datetime.fromisoformat(entry["expiration time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if expires <= datetime.datetime.now(datetime.timezone.utc):
        return None
    key = entry.get("key")
    return key if isinstance(key, str) and key else None


class LoraAdmin:
    """The two routes for one worker; `adapters` is the handler's list of the names served."""

    def __init__(
        self, enabled: bool, served: str, loop: EngineLoop, key_file: Callable[[], str] = frontend_key_file
    ) -> None:
        self.enabled = enabled
        self.served = served
        self.loop = loop
        self.key_file = key_file
        self.adapters: list[str] = list(loop.engine.lora_names)

    async def serve(self, kind: str, body: dict, headers: dict[str, Any]) -> str:
        """Load or unload the adapter `body` names; the answer's text. Raises ProtocolError (401,
        400, 404) or UnknownModel (404 `model_not_found`)."""
        if not self.enabled:
            raise ProtocolError(
                "loading LoRA adapters while serving is off (lora_runtime_updates in model-config.yaml)",
                None,
                404,
                "not_found_error",
            )
        self._authorize(headers)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ProtocolError("lora_name must be a non-empty string", "lora_name")
        if kind == UNLOAD:
            try:
                await asyncio.wrap_future(self.loop.call(lambda e: e.loras.remove(name)))
            except UnknownModel as err:
                raise ProtocolError(err.message, "lora_name", 404, "invalid_request_error", "model_not_found") from None
            self.adapters = [n for n in self.adapters if n != name]
            return f"Success: LoRA adapter '{name}' removed successfully."
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("lora_path must be a non-empty string (a directory on the server)", "lora_path")
        if name == self.served:
            raise ProtocolError(f"{name!r} is the served model's name: name the adapter otherwise", "lora_name")
        registry = self.loop.engine.loras
        try:
            adapter = await asyncio.wrap_future(_READER.submit(registry.read, name, path))
            await asyncio.wrap_future(self.loop.call(lambda e: e.loras.add(adapter)))
        except AdapterError as err:
            raise ProtocolError(str(err), "lora_path") from None
        self.adapters.append(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _authorize(self, headers: dict[str, Any]) -> None:
        sent = {str(k).lower(): v for k, v in headers.items()}.get(KEY_HEADER)
        if isinstance(sent, (bytes, bytearray)):
            sent = bytes(sent).decode("latin-1")
        try:
            key = management_key(self.key_file())
        except OSError:
            key = None
        if key is None:
            raise ProtocolError(
                "no management key to check (TorchServe's token authorization is off): runtime LoRA updates refused",
                None,
                403,
                "permission_error",
            )
        if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), key.encode()):
            message = "send TorchServe's management key as X-Management-Key"
            raise ProtocolError(message, None, 401, "authentication_error", "invalid_api_key")
