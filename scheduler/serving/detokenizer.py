"""Incremental detokenization with stop strings held back until they can be ruled out."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, one step at a time.

    Decoding the window `ids[prefix:]` against `ids[prefix:read]` gives the new text without
    re-decoding everything; a trailing U+FFFD means a multi-byte character is still incomplete, so
    nothing is released until the next token completes it.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already released to the client
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_ids: list[int]) -> bool:
        """Consume the newest tokens; True if a stop string was found (text is cut before it)."""
        prefix_text = self._decode(output_ids[self._prefix : self._read])
        new_text = self._decode(output_ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(output_ids)
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
