"""The protocols a worker speaks, as objects in a table from URL path to protocol: OpenAI's
completions, chat completions and models, Anthropic's Messages (and its token count) and OpenAI's
Responses (docs/protocols.md).

A protocol parses its body into one `ParsedRequest` (one `EngineRequest`: the other protocols
translate their body into the chat completions body it means, then parse it as any chat request),
shapes the answer through a shaper's seams (`response`, `events`, `done`, `error_event`:
openai/shaper.py, edge_shaper.py) and reshapes the one error path's answer (openai/errors.py
`http_error`) into its own. There is no second path through the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from orcaserve.handler.anthropic import messages as anthropic
from orcaserve.handler.anthropic.request import chat_body as anthropic_chat_body
from orcaserve.handler.edge_shaper import EdgeShaper
from orcaserve.handler.lora_admin import LOAD, UNLOAD
from orcaserve.handler.openai import reasoning_content, responses_api
from orcaserve.handler.openai.errors import HttpError
from orcaserve.handler.openai.logprobs import LogprobsRenderer
from orcaserve.handler.openai.protocol import CHAT, COMPLETIONS, MODELS, ParsedRequest, ProtocolError, parse_request
from orcaserve.handler.openai.shaper import shaper_for
from orcaserve.handler.reasoning import ReasoningStyle
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.prompt import encode_prompt


class Shapes(Protocol):
    """What the handler asks of a request's shaper (openai/shaper.py `Shaper`, `EdgeShaper`)."""

    done: bool

    def response(self, finals: dict[int, RequestOutput]) -> str: ...
    def events(self, outputs: list[RequestOutput]) -> str: ...
    def error_event(self, error: HttpError) -> str: ...


class Limits(Protocol):
    """The serving settings parsing reads (`HandlerConfig`'s)."""

    default_timeout: float | None
    default_max_tokens: int | None
    max_tokens_limit: int | None


MakeShaper = Callable[[ParsedRequest, str, str, LogprobsRenderer | None, ReasoningStyle | None], Shapes]


def _same(error: HttpError) -> HttpError:
    return error


def _openai_body(body: dict) -> tuple[dict, tuple[str, ...]]:
    return body, ()


@dataclass(frozen=True)
class Endpoint:
    """One protocol. `kind`: the OpenAI endpoint kind its request is parsed as (MODELS: no body);
    `translate(body)`: the body that kind parses and the fields accepted but ignored; `shaper`:
    its answer's shaper; `error`: an error answer in its shape; `counts_tokens`: the answer is the
    prompt's token count, nothing is generated."""

    name: str
    kind: str
    shaper: MakeShaper
    translate: Callable[[dict], tuple[dict, tuple[str, ...]]] = _openai_body
    error: Callable[[HttpError], HttpError] = _same
    counts_tokens: bool = False

    def parse(self, body: dict, request_id: str, limits: Limits, style: ReasoningStyle | None) -> ParsedRequest:
        """The request `body` asks for, as the model (`style`: its reasoning parser) serves it;
        raises ProtocolError."""
        body, ignored = self.translate(body)
        req = parse_request(
            body, self.kind, limits.default_timeout, limits.default_max_tokens, limits.max_tokens_limit, request_id
        )
        req = reasoning_content.prepare(style, req)
        return dataclasses.replace(req, ignored=tuple(sorted({*req.ignored, *ignored}))) if ignored else req


def _edge(answer: Callable, writer: Callable) -> MakeShaper:
    return partial(EdgeShaper, answer, writer)


def _count_body(body: dict) -> tuple[dict, tuple[str, ...]]:
    return anthropic_chat_body(body, count_only=True)


OPENAI_COMPLETIONS = Endpoint("completions", COMPLETIONS, shaper_for)
OPENAI_CHAT = Endpoint("chat completions", CHAT, shaper_for)
OPENAI_MODELS = Endpoint("models", MODELS, shaper_for)
_ANTHROPIC_SHAPER = _edge(anthropic.message, anthropic.MessageEvents)
MESSAGES = Endpoint("messages", CHAT, _ANTHROPIC_SHAPER, anthropic_chat_body, anthropic.anthropic_error)
COUNT_TOKENS = Endpoint("count_tokens", CHAT, _ANTHROPIC_SHAPER, _count_body, anthropic.anthropic_error, True)
_RESPONSES_SHAPER = _edge(responses_api.response, responses_api.ResponseEvents)
RESPONSES = Endpoint("responses", CHAT, _RESPONSES_SHAPER, responses_api.chat_body)
# LoRA adapters loaded and unloaded while serving (handler/lora_admin.py): no generation, no shaper.
LORA_LOAD = Endpoint("load_lora_adapter", LOAD, shaper_for)
LORA_UNLOAD = Endpoint("unload_lora_adapter", UNLOAD, shaper_for)

# URL path (TorchServe's `url_path` header, `v1/` optional) -> protocol; a new protocol is one
# object and one line.
PROTOCOLS: dict[str, Endpoint] = {
    "": OPENAI_COMPLETIONS,
    "v1/completions": OPENAI_COMPLETIONS,
    "v1/chat/completions": OPENAI_CHAT,
    "v1/models": OPENAI_MODELS,
    "v1/messages": MESSAGES,
    "v1/messages/count_tokens": COUNT_TOKENS,
    "v1/responses": RESPONSES,
    "v1/load_lora_adapter": LORA_LOAD,
    "v1/unload_lora_adapter": LORA_UNLOAD,
}


def endpoint_for(url_path: str | None) -> Endpoint:
    """The protocol a URL suffix selects; raises ProtocolError (404) for an unknown one."""
    path = (url_path or "").strip("/")
    found = PROTOCOLS.get(path) if path == "" or path.startswith("v1/") else PROTOCOLS.get(f"v1/{path}")
    if found is None:
        # the adapter routes are an operator's (off by default, behind the management key): not offered
        paths = ", ".join(p for p, e in PROTOCOLS.items() if p and e not in (LORA_LOAD, LORA_UNLOAD))
        raise ProtocolError(f"unknown path {url_path!r}; use one of {paths}", None, 404, "not_found_error")
    return found


async def count_tokens(tokenizer: Any, req: ParsedRequest, vocab_size: int, max_model_len: int) -> str:
    """`count_tokens`' answer: the prompt's tokens as the engine would encode them (off the asyncio
    thread, on a tokenizer of the handler's own); a prompt that would not fit is a 400 as well."""
    ids = await asyncio.to_thread(encode_prompt, tokenizer, req.prompt, vocab_size, max_model_len)
    return json.dumps({"input_tokens": len(ids)})
