"""OpenAI's `logprobs` objects, for completions and for chat, from the engine's `TokenLogprob`s."""

from __future__ import annotations

from collections.abc import Sequence

from orcaserve.scheduler.core.token_logprob import TokenLogprob

# JSON has no -Infinity: a token the model rules out (a masked vocabulary entry) gets this floor,
# as vLLM does.
_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)


class LogprobsRenderer:
    """Token ids to text with a tokenizer of its own (fast tokenizers are not thread-safe, and the
    engine's is busy on other threads). Each id's text is decoded once and kept: at most one entry
    per vocabulary id. Special tokens keep their text (`<|im_end|>`), as vLLM shows them."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        """Token ids' text (an echoed prompt given as ids)."""
        return self._tokenizer.decode(token_ids)

    def completion(self, logprobs: Sequence[TokenLogprob], offset: int = 0) -> tuple[dict, int]:
        """The completions API's `logprobs`, and where the next token's text starts.

        `top_logprobs` maps text to log-probability for the asked-for alternatives plus the
        sampled token (as vLLM does); `text_offset` is where each token's text starts, counting
        from `offset` (the length of the tokens' text sent before)."""
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        for lp in logprobs:
            text = self.text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(_finite(lp.logprob))
            top = {self.text(t): _finite(v) for t, v in lp.top}
            top.setdefault(text, _finite(lp.logprob))
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
        return body, offset

    def echo(self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> tuple[dict, int]:
        """The completions API's `logprobs` of an echoed prompt, as vLLM gives them: the first
        token's log-probability and alternatives are null; offsets count from the prompt's start."""
        first = self.text(prompt_ids[0])
        body, offset = self.completion([lp for lp in logprobs if lp is not None], len(first))
        body["tokens"].insert(0, first)
        body["token_logprobs"].insert(0, None)
        body["top_logprobs"].insert(0, None)
        body["text_offset"].insert(0, 0)
        return body, offset

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """The chat API's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
        return {
            "content": [
                {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        # The UTF-8 of the decoded text, as vLLM gives it: a token that is only part of a character
        # decodes alone to U+FFFD, so its raw bytes are not recovered here.
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
