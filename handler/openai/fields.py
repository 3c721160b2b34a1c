"""The OpenAI routes' kinds and the body fields each accepts, ignores or refuses (docs/api.md#fields)."""

from __future__ import annotations

import logging

from orcaserve.handler.openai import structured, tools
from orcaserve.handler.openai.errors import ProtocolError

log = logging.getLogger(__name__)

COMPLETIONS = "completions"
CHAT = "chat"
MODELS = "models"

# Fields a client may send; anything else is an error naming the field (typos must not pass
# silently: `max_token` would otherwise quietly generate 16 tokens). Fields of OpenAI's API that
# orcaserve does not act on are accepted and ignored (`_IGNORED`); docs/api.md#fields.
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",
    "n",
    "logit_bias",
    # extensions
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "priority",
    "timeout",
    "cache_salt",  # vLLM's name: subdivides prefix-cache sharing (handler/openai/tenancy.py)
} | structured.VLLM_FIELDS
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
_CHAT_FIELDS = (
    _COMMON
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "chat_template_kwargs"}
    | tools.FIELDS
)
# OpenAI's fields that change nothing about the tokens a request gets back here: accepted, ignored,
# logged once per process and named in the IGNORED_HEADER of the answer (as vLLM does).
_IGNORED_COMMON = {"user"}
_IGNORED = {
    COMPLETIONS: _IGNORED_COMMON,
    CHAT: _IGNORED_COMMON
    | {
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
        "prediction",
        "modalities",
        "web_search_options",
    },
}
# OpenAI's fields whose request cannot be served as asked: ignoring them would answer something
# else than what the client asked for (tools: see structured outputs; audio output; suffix).
_REFUSED = {
    COMPLETIONS: {"suffix"},
    CHAT: {"functions", "function_call", "audio"},
}
IGNORED_HEADER = "X-Orcaserve-Ignored-Fields"
_logged_ignored: set[str] = set()


def check_fields(body: dict, kind: str) -> tuple[str, ...]:
    """Refuse unknown and unservable fields; returns the OpenAI fields to ignore, each logged the
    first time this process sees it."""
    allowed, ignore, refuse = (
        (_COMPLETION_FIELDS if kind == COMPLETIONS else _CHAT_FIELDS),
        _IGNORED[kind],
        _REFUSED[kind],
    )
    ignored = []
    for key in body:
        if key in refuse and body[key] is not None:
            raise ProtocolError(f"{key} is not supported", key)
        if key in ignore:
            ignored.append(key)
            if key not in _logged_ignored:
                _logged_ignored.add(key)
                log.warning("orcaserve ignores the OpenAI field %r (logged once per process)", key)
        elif key not in allowed and key not in refuse:
            raise ProtocolError(f"unknown field {key!r}", key)
    return tuple(sorted(ignored))
