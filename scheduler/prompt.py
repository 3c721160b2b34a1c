"""What a request may ask the model to continue, and how it becomes token ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orcaserve.scheduler.errors import InvalidRequest, PromptTooLong
from orcaserve.scheduler.serving.tool_template import tool_template


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered with the tokenizer's chat template (generation prompt appended)
    when the request is admitted, not when it is parsed: rendering a large conversation takes
    as long as tokenizing it, and neither may run on a thread other requests wait for."""

    messages: list[dict[str, Any]]
    tools: list[dict] | None = None  # OpenAI function tools, rendered by the template (tool_template.py)
    # Extra arguments of the template (e.g. `enable_thinking`), as the request sent them.
    template_kwargs: dict[str, Any] | None = None


Prompt = str | Sequence[int] | ChatPrompt


def encode_prompt(tokenizer: Any, prompt: Prompt, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt's token ids; raises InvalidRequest (param `prompt` or `messages`) for an empty,
    too long or malformed prompt.

    Cost is bounded by the prompt's size: at most one tokenization and one pass over the ids,
    and ids are checked against the vocabulary only once their count is known to fit.
    """
    if isinstance(prompt, ChatPrompt):
        # Jinja renders in Python, holding the GIL the engine thread needs between its ops; a
        # template gives every message at least one token, so this many can never fit.
        if len(prompt.messages) >= max_model_len:
            raise InvalidRequest(
                f"messages has {len(prompt.messages)} entries, each at least one token; "
                f"max_model_len is {max_model_len}",
                param="messages",
            )
        try:
            template = tool_template(tokenizer, prompt.messages, prompt.tools)
            text = tokenizer.apply_chat_template(
                prompt.messages,
                tools=prompt.tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
                **(prompt.template_kwargs or {}),
            )
        except Exception as e:  # a template may refuse e.g. a role order
            raise InvalidRequest(
                f"messages could not be rendered by the chat template: {e}", param="messages"
            ) from None
        # The template writes the BOS token itself (as text), so none is added.
        ids = _tokenize(tokenizer, text, "messages", special=False)
    elif isinstance(prompt, str):
        # As transformers' tokenizer(prompt) and vLLM do: the tokenizer's special tokens (a BOS)
        # are added. Gemma without its BOS answers fluent nonsense (docs/serving.md
        # "Supported architectures").
        ids = _tokenize(tokenizer, prompt, "prompt", special=True) if prompt else []
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise InvalidRequest(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )
    if not ids:
        raise InvalidRequest("prompt is empty", param="prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLong(
            f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} (prompt plus at least one generated token)"
        )
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
    return ids


def _tokenize(tokenizer: Any, text: str, field: str, special: bool) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=special)
    except Exception as e:  # e.g. a string that is not valid Unicode
        raise InvalidRequest(f"{field} could not be tokenized: {type(e).__name__}: {e}", param=field) from None
