"""Token ids to bytes for tokenizers whose decoder is byte-level alone (GPT-2's scheme: SmolLM2,
Llama 3, Qwen), so that incremental detokenization is a lookup per token (docs/host-overlap.md
"Cheaper host work per request").

Such a decoder maps every character of a token's string through the byte-level alphabet to one
byte (a string with a character outside the alphabet is taken as its own UTF-8 bytes), joins the
bytes of all the ids and decodes them as UTF-8, each invalid sequence becoming one U+FFFD
(`tokenizers`' `ByteLevel.decode_chain`). Special tokens are dropped before the decoder sees
them when `skip_special_tokens` is set, and so are ids the vocabulary does not hold. The text of
ids is therefore the UTF-8 decoding of the concatenation of per-id byte strings, which this table
holds for every id of the vocabulary, built once per tokenizer (a few tens of milliseconds for
fifty thousand ids) and shared by the engines over it.

Added tokens are where the library's own rules grow (a normalized form used for decoding): the
table holds the special ones only where there is no normalizer (skipped: no bytes), and leaves
every other added token, and any id outside the vocabulary, to the library (`get` says None).
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenizers import Tokenizer, decoders


def _byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet: the character each byte is written as, mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(others))
    return {c: b for b, c in chars.items()}


_ALPHABET = _byte_alphabet()
_CHARS = {b: c for c, b in _ALPHABET.items()}
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _ALPHABET.items()})
_IN_ALPHABET = frozenset(_ALPHABET)


class ByteTable:
    """Each id's bytes under `backend`'s byte-level decoder with special tokens skipped, for
    every id of its vocabulary; `get(id)` is None for an id left to the library."""

    def __init__(self, backend: Tokenizer) -> None:
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        specials = frozenset(t.content for t in added.values() if t.special)
        plain = backend.normalizer is None
        table: dict[int, bytes] = {}
        for token in range(max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)):
            if token in added:  # skipped (no bytes) when special and there is no normalizer
                if added[token].special and plain:
                    table[token] = b""
                continue
            string = backend.id_to_token(token)
            if string is None:
                continue
            if string in specials:  # as `Tokenizer.decode` skips them: by content, not by id
                table[token] = b""
            elif _IN_ALPHABET.issuperset(string):
                table[token] = string.translate(_TO_LATIN1).encode("latin-1")
            else:
                table[token] = string.encode()
        self.get = table.get
        # The text of each id whose bytes alone are a whole piece (valid UTF-8, not empty, not
        # ending in U+FFFD): with nothing pending, the incremental step's piece is this string.
        whole: dict[int, str] = {}
        for token, data in table.items():
            try:
                text = data.decode()
            except UnicodeDecodeError:
                continue
            if text and text[-1] != "\ufffd":
                whole[token] = text
        self.whole = whole.get

    @staticmethod
    def char_of(byte: int) -> str:
        """The character the byte-level alphabet writes `byte` as."""
        return _CHARS[byte]

    @classmethod
    def of(cls, backend: Any) -> ByteTable | None:
        """The table of `backend`, when its decoder is byte-level alone; else None."""
        if not isinstance(backend, Tokenizer) or type(backend.decoder) is not decoders.ByteLevel:
            return None
        table = _TABLES.get(backend)
        if table is None:
            table = _TABLES[backend] = cls(backend)
        return table


# One table per tokenizer object, for as long as it lives (engines over one tokenizer share it;
# a table holds no reference to its tokenizer, which would keep it alive).
_TABLES: weakref.WeakKeyDictionary[Tokenizer, ByteTable] = weakref.WeakKeyDictionary()
