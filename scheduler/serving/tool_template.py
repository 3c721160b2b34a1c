"""Which chat template renders a conversation with tools: the model's, or a Hermes-style one.

Qwen2.5's template (and other Hermes-style ones) lists the tools in the system turn and reads
calls back as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results as
`<tool_response>` in a user turn. A ChatML template that knows nothing of tools (SmolLM2-135M's
drops them silently, and fails on an assistant turn without content) gets the same rendering
here, in its own ChatML tokens, so that `tools` and tool results reach such a model at all
(docs/serving.md, 'Structured outputs and tool calls').
"""

from __future__ import annotations

from typing import Any

# Qwen2.5-Instruct's tool rendering, without its default system prompt's wording.
HERMES_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}You are a helpful assistant.{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within " }}
{{- "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": " }}
{{- "<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- (tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def uses_tools(messages: list[dict[str, Any]], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def tool_template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None) -> str | None:
    """The template to render with: None (the model's own) unless the conversation has tools or
    tool turns and the model's template is ChatML without any notion of tool calls."""
    own = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(own, str) or not uses_tools(messages, tools) or "tool_call" in own or "<|im_start|>" not in own:
        return None
    return HERMES_TEMPLATE
