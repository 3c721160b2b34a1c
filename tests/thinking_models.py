"""Tiny models that think: chat templates with think tags (Qwen3's and DeepSeek-R1's styles) and a
tiny llama made to say a chosen answer token by token, its tags split across tokens wherever a
test asks (tests/handler/test_reasoning_served.py, tests/e2e/test_protocols_e2e.py)."""

from __future__ import annotations

import copy

import torch

from orcaserve.bench.models.tiny import TINY_CONFIG

# Qwen3-like: the model opens <think> itself; enable_thinking false closes an empty one in the prompt.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1-like: the generation prompt opens the thinking.
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

ANSWER_THINKING = "I think 2 < 3."
ANSWER = "Yes."


def chain_model(vocab: int, chain: list[int]):
    """A tiny llama whose greedy next token depends on the current token alone: `chain[k]` is
    followed by `chain[k + 1]`. Attention and MLP write nothing (o_proj, down_proj zero), so the
    last hidden state is the token's normed embedding, and lm_head's row of each successor is it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "vocab_size": vocab})).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        hidden = emb.shape[1]
        for token, after in zip(chain, chain[1:], strict=False):
            normed = emb[token] / emb[token].pow(2).mean().sqrt()
            head[after] += 20 * normed / hidden  # logit 20 after `token`, about 0 for the rest
    return model


def served(tokenizer, template: str, pieces: list[str]):
    """(tokenizer, model) answering `pieces`, one token each, then EOS, to the template's prompt."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    tok.add_tokens([p for p in pieces if len(tok.encode(p, add_special_tokens=False)) != 1])
    ids = [tok.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(i) == 1 for i in ids), pieces
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Is 2 < 3?"}], tokenize=False, add_generation_prompt=True
    )
    last = tok.encode(text, add_special_tokens=False)[-1]
    chain = [last, *(i[0] for i in ids), tok.eos_token_id]
    assert len(set(chain)) == len(chain), pieces  # each token has one successor
    return tok, chain_model(len(tok), chain)


def cut(open_at: int, close_at: int, opened: bool) -> list[str]:
    """The answer's pieces: `<think>` split at `open_at`, `</think>` at `close_at` (glued to the
    text beside them, so every piece is a distinct token)."""
    start = ["<think>"[:open_at], "<think>"[open_at:] + "\n" + ANSWER_THINKING[:5]]
    if opened:
        start = [ANSWER_THINKING[:5]]
    middle = [ANSWER_THINKING[5:] + "\n" + "</think>"[:close_at]]
    return [*start, *middle, "</think>"[close_at:] + "\n\n" + ANSWER[:2], ANSWER[2:]]
