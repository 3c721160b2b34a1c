"""Incremental detokenization with stop strings held back until they can be ruled out."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer  # transformers' own dependency; DecodeStream since 0.21
from tokenizers.decoders import DecodeStream


def stream_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, when decoding through it
    gives the same text as the tokenizer's own `decode` (no clean-up of spaces afterwards); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, one token at a time.

    Decoding the window `ids[prefix:]` against `ids[prefix:read]` gives the new text without
    re-decoding everything; a trailing U+FFFD means a multi-byte character is still incomplete, so
    nothing is released until the next token completes it. With a fast tokenizer this scheme runs
    inside the `tokenizers` library (`DecodeStream`, one call per token, docs/host-overlap.md
    "Detokenization"); otherwise through the tokenizer's `decode`, twice per token.
    """

    def __init__(self, tokenizer, stop: list[str], backend: Any = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already released to the client
        self._prefix = 0
        self._read = 0
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _step(self, output_ids: list[int]) -> str | None:
        """The text the newest token completes, or None while it completes none."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, output_ids[-1])
            except Exception:  # the library refuses a window it cannot extend: decode it here from now on
                self._stream = None
            else:
                if piece is not None:
                    self._prefix, self._read = self._read, len(output_ids)
                return piece
        prefix_text = self._decode(output_ids[self._prefix : self._read])
        new_text = self._decode(output_ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        self._prefix, self._read = self._read, len(output_ids)
        return new_text[len(prefix_text) :]

    def update(self, output_ids: list[int]) -> bool:
        """Consume the newest token (the last of `output_ids`; one call per token); True if a stop
        string was found (text is cut before it)."""
        stream = self._stream
        if stream is not None and not self.stop:  # the common case, inline: no stop string to look for
            try:
                piece = stream.step(self._backend, output_ids[-1])
            except Exception:
                self._stream = None  # as in `_step`: decoded here from now on
            else:
                if piece is not None:
                    self._prefix, self._read = self._read, len(output_ids)
                    self.text += piece
                return False
        # (a window the library refused falls through: `_step` decodes it, as it does from now on)
        piece = self._step(output_ids)
        if not piece:
            return False
        start = len(self.text)
        self.text += piece
        if self.stop:
            search_from = max(0, start - self.hold)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return True
        return False

    def release(self, finished: bool) -> str:
        """Text that can go to the client now: all of it when finished, else minus a possible
        stop-string prefix at the end."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
