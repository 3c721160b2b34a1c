"""Incremental detokenization with stop strings held back until they can be ruled out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer  # transformers' own dependency; DecodeStream since 0.21
from tokenizers.decoders import DecodeStream

from orcaserve.scheduler.byte_level import ByteTable


@dataclass(frozen=True)
class FastDecoding:
    """A fast tokenizer's way to its text without the Python wrappers: `backend` for the
    library's `DecodeStream`, and `table` (each id's bytes, byte_level.py) when its decoder is
    byte-level alone (one per tokenizer, shared)."""

    backend: Tokenizer
    table: ByteTable | None


def fast_decoding(tokenizer: Any, byte_table: bool = True) -> FastDecoding | None:
    """How to decode through the `tokenizers.Tokenizer` behind a transformers fast tokenizer, when
    that gives the same text as the tokenizer's own `decode` (no clean-up of spaces afterwards);
    else None. `byte_table=False`: DecodeStream even for a byte-level decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return FastDecoding(backend, ByteTable.of(backend) if byte_table else None)


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, one token at a time.

    Decoding the window `ids[prefix:]` against `ids[prefix:read]` gives the new text without
    re-decoding everything; a trailing U+FFFD means a multi-byte character is still incomplete, so
    nothing is released until the next token completes it. With a byte-level decoder that is the
    UTF-8 decoding of the bytes of the tokens since the last piece, looked up per id (`FastDecoding.
    table`); with another fast tokenizer the scheme runs inside the `tokenizers` library
    (`DecodeStream`, one call per token); otherwise through the tokenizer's `decode`, twice per
    token (docs/host-overlap.md "Cheaper host work per request").
    """

    def __init__(self, tokenizer, stop: list[str], fast: FastDecoding | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # with stop strings: the text so far, cut before a stop string found
        self._parts: list[str] = []  # without: the text's pieces, joined when read
        self.emitted = 0  # characters of the text (pieces without stop strings) released to the client
        self._prefix = 0
        self._read = 0
        self._fast = fast
        self._table = fast.table if fast is not None else None
        self._pending = b""  # table: bytes of the tokens since the last piece (an incomplete character)
        self._stream = DecodeStream(skip_special_tokens=True) if fast is not None and self._table is None else None

    @property
    def text(self) -> str:
        return "".join(self._parts) if not self.stop else self._text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _bytes_step(self, data: bytes, num_ids: int) -> str | None:
        """The table's step: `data` are the newest token's bytes."""
        if self._pending:
            data = self._pending + data
        try:
            piece = data.decode()
        except UnicodeDecodeError:
            piece = data.decode(errors="replace")  # each invalid sequence one U+FFFD, as the library's
        if not piece or piece[-1] == "\ufffd":  # nothing yet, or a character not complete yet
            self._pending = data
            return None
        self._pending = b""
        self._read = num_ids  # (`_prefix` is set when the table hands over: `_to_stream`)
        return piece

    def _to_stream(self, output_ids: list[int]) -> None:
        """An id the table leaves to the library: DecodeStream from now on, given the tokens since
        the last piece (none of which completed any text) before the newest."""
        assert self._fast is not None
        self._table = None
        self._prefix = self._read  # the window starts after the last piece: its text is complete
        self._stream = stream = DecodeStream(skip_special_tokens=True)
        try:
            for token in output_ids[self._read : -1]:
                stream.step(self._fast.backend, token)
        except Exception:  # decoded here from now on (`_step`)
            self._stream = None

    def _step(self, output_ids: list[int]) -> str | None:
        """The text the newest token completes, or None while it completes none."""
        table = self._table
        if table is not None:
            data = table.get(output_ids[-1])
            if data is not None:
                return self._bytes_step(data, len(output_ids))
            self._to_stream(output_ids)
        if self._stream is not None:
            assert self._fast is not None
            try:
                piece = self._stream.step(self._fast.backend, output_ids[-1])
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

    def step(self, output_ids: list[int]) -> str | None:
        """`update` and `release(False)` in one call: the text to release after the newest token,
        or None when a stop string ended the text (`release(True)` gives what is left)."""
        table = self._table
        if table is not None and not self.stop:  # the common case, inline: a lookup, nothing held back
            token = output_ids[-1]
            # A token whose bytes are a whole piece, nothing pending before it: `_bytes_step`'s
            # piece is its text, looked up.
            piece = None if self._pending else table.whole(token)
            if piece is not None:
                self._read = len(output_ids)
            elif (data := table.get(token)) is not None:
                piece = self._bytes_step(data, len(output_ids))
                if not piece:
                    return self.release(False)
            else:
                return None if self.update(output_ids) else self.release(False)
            parts = self._parts
            parts.append(piece)
            if self.emitted == len(parts) - 1:  # (nothing was left unreleased before it)
                self.emitted += 1
                return piece
            return self.release(False)
        return None if self.update(output_ids) else self.release(False)

    def update(self, output_ids: list[int]) -> bool:
        """Consume the newest token (the last of `output_ids`; one call per token); True if a stop
        string was found (text is cut before it)."""
        piece = self._step(output_ids)
        if not piece:
            return False
        if not self.stop:
            self._parts.append(piece)
            return False
        start = len(self._text)
        self._text += piece
        search_from = max(0, start - self.hold)
        hits = [i for i in (self._text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            return True
        return False

    def release(self, finished: bool) -> str:
        """Text that can go to the client now: all of it when finished, else minus a possible
        stop-string prefix at the end."""
        if not self.stop:  # nothing held back: the pieces not released yet
            parts, start = self._parts, self.emitted
            self.emitted = len(parts)
            return parts[start] if len(parts) == start + 1 else "".join(parts[start:])
        end = len(self._text) if finished else max(self.emitted, len(self._text) - self.hold)
        delta = self._text[self.emitted : end]
        self.emitted = end
        return delta
