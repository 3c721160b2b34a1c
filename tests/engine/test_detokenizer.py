"""The incremental detokenizer gives, token by token, exactly the text of the transformers
`decode` path it replaced, through each of its ways: the byte table of a byte-level decoder,
`tokenizers`' DecodeStream, and `decode` itself. Multi-byte characters split across tokens,
byte tokens that never complete a character, special and added tokens, ids outside the
vocabulary, stop strings held back and cut."""

from __future__ import annotations

import copy
import random

import pytest
from tokenizers import Tokenizer

from orcaserve.scheduler.byte_level import ByteTable
from orcaserve.scheduler.detokenizer import IncrementalDetokenizer, fast_decoding

TEXTS = [
    "Hello, world! The quick brown fox.",
    "naïve café — 東京タワー 🚀🎉 emoji ZWJ 👩‍👩‍👧 and ١٢٣",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|> special tokens in text",
    "def f(x):\n    return x ** 2  # code",
    "replacement \ufffd character, then \ufffd\ufffd twice",
]
STOPS = [[], ["fox"], ["東京", "\n\n"], ["🎉 e", "x ** "]]


def _sequences(tokenizer, extra: list[int] = ()) -> list[list[int]]:
    rng = random.Random(0)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    specials = list(tokenizer.all_special_ids) + list(extra)
    vocab = len(tokenizer)
    for _ in range(40):  # random ids: byte tokens that never complete a character included
        seqs.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
    byte_ids = _byte_ids(tokenizer)
    lead = [byte_ids[b] for b in b"\x80\xbf\xc3\xe2\xe6\xf0\xf4" if b in byte_ids]
    for _ in range(40):  # byte tokens alone: every kind of incomplete and invalid sequence
        seqs.append([rng.choice(lead + list(byte_ids.values())) for _ in range(rng.randrange(1, 24))])
    for _ in range(40):  # text with special tokens and random bytes spliced in
        ids = list(rng.choice(seqs[: len(TEXTS)]))
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials + list(range(256))))
        seqs.append(ids)
    return seqs


def _byte_ids(tokenizer) -> dict[int, int]:
    """Byte -> the id of the token that is that byte alone (the vocabulary lacks a few)."""
    backend = tokenizer.backend_tokenizer
    ids = {b: backend.token_to_id(ByteTable.char_of(b)) for b in range(256)}
    return {b: i for b, i in ids.items() if i is not None}


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> list[tuple[bool, str, str]]:
    trace = []
    for i in range(1, len(ids) + 1):
        hit = detok.update(ids[:i])
        trace.append((hit, detok.text, detok.release(False)))
        if hit:
            break
    trace.append((False, detok.text, detok.release(True)))
    return trace


def _run_steps(detok: IncrementalDetokenizer, ids: list[int]) -> list[tuple[bool, str, str]]:
    """`_run` through `step` (update and release in one call)."""
    trace = []
    for i in range(1, len(ids) + 1):
        released = detok.step(ids[:i])
        if released is None:  # a stop: what is left comes with the final call
            trace.append((True, detok.text, detok.release(True)))
            return trace
        trace.append((False, detok.text, released))
    trace.append((False, detok.text, detok.release(True)))
    return trace


def _merged(trace: list[tuple[bool, str, str]]) -> list[tuple[bool, str, str]]:
    """`_run`'s trace as `_run_steps` gives it: on a stop, the two last releases in one."""
    if len(trace) >= 2 and trace[-2][0]:
        hit, text, first = trace[-2]
        return [*trace[:-2], (hit, text, first + trace[-1][2])]
    return trace


def _ways(tokenizer) -> dict[str, object]:
    return {"table": fast_decoding(tokenizer), "stream": fast_decoding(tokenizer, byte_table=False), "decode": None}


@pytest.mark.parametrize("stop", STOPS)
def test_every_way_matches_decode(tokenizer, stop):
    ways = _ways(tokenizer)
    assert ways["table"].table is not None  # SmolLM2's decoder is byte-level alone
    assert ways["stream"].table is None
    for ids in _sequences(tokenizer):
        traces = {name: _run(IncrementalDetokenizer(tokenizer, stop, fast), ids) for name, fast in ways.items()}
        assert traces["table"] == traces["decode"], ids
        assert traces["stream"] == traces["decode"], ids
        for fast in ways.values():
            assert _run_steps(IncrementalDetokenizer(tokenizer, stop, fast), ids) == _merged(traces["decode"]), ids


def test_whole_text_is_decode(tokenizer):
    for fast in _ways(tokenizer).values():
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            detok = IncrementalDetokenizer(tokenizer, [], fast)
            for i in range(1, len(ids) + 1):
                detok.update(ids[:i])
            assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_table_bytes_decode_as_the_library(tokenizer):
    """Every id of the vocabulary: the table's bytes, decoded, are the library's text of it; and
    random byte strings decode to the same text (U+FFFD per invalid sequence) both ways."""
    backend = tokenizer.backend_tokenizer
    table = ByteTable(backend)
    assert ByteTable.of(backend) is ByteTable.of(backend)  # one per tokenizer
    for token in range(backend.get_vocab_size(with_added_tokens=True)):
        data = table.get(token)
        assert data is not None and data.decode(errors="replace") == backend.decode([token]), token
    rng = random.Random(1)
    byte_ids = _byte_ids(tokenizer)
    edges = [b for b in b"\x80\x8f\x9f\xa0\xbf\xc2\xdf\xe0\xed\xef\xf0\xf3\xf4a" if b in byte_ids]
    high = [b for b in byte_ids if b >= 0x80]
    for _ in range(3000):
        raw = bytes(rng.choice(edges + high) for _ in range(rng.randrange(1, 12)))
        ids = [byte_ids[b] for b in raw]
        assert raw.decode(errors="replace") == backend.decode(ids), raw


def _with_added(tokenizer, normalized: bool):
    """`tokenizer` with two added tokens that are not special (one outside the byte alphabet)."""
    from tokenizers import AddedToken

    other = copy.deepcopy(tokenizer)
    other.backend_tokenizer.add_tokens([AddedToken("<tool call>", normalized=normalized), AddedToken("café!")])
    return other


@pytest.mark.parametrize("normalized", [False, True])
def test_added_tokens_and_unknown_ids_go_through_the_library(tokenizer, normalized):
    other = _with_added(tokenizer, normalized)
    backend = other.backend_tokenizer
    added = [backend.token_to_id("<tool call>"), backend.token_to_id("café!")]
    unknown = backend.get_vocab_size(with_added_tokens=True) + 7
    table = ByteTable(backend)
    assert table.get(added[0]) is None and table.get(unknown) is None and table.get(0) == b""
    rng = random.Random(2)
    seqs = []
    for ids in _sequences(other)[len(TEXTS) :]:  # each somewhere, pending bytes before it or not
        ids = list(ids)
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([*added, unknown]))
        seqs.append(ids)
    ways = _ways(other)
    for stop in STOPS[:2]:
        for ids in seqs:
            traces = {name: _run(IncrementalDetokenizer(other, stop, fast), ids) for name, fast in ways.items()}
            assert traces["table"] == traces["stream"] == traces["decode"], ids


def test_other_decoders_take_the_stream():
    from tokenizers import decoders, models

    backend = Tokenizer(models.BPE())
    backend.decoder = decoders.Sequence([decoders.ByteLevel()])
    assert ByteTable.of(backend) is None


def test_plain_tokenizer_takes_decode_path():
    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    assert fast_decoding(Plain()) is None
    detok = IncrementalDetokenizer(Plain(), ["cd"])
    assert not detok.update([0, 1])
    assert detok.update([0, 1, 2, 3]) and detok.text == "ab"
