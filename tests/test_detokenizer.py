"""The incremental detokenizer through `tokenizers`' DecodeStream gives, token by token, exactly
the text of the transformers `decode` path it replaced: multi-byte characters split across
tokens, special tokens skipped, stop strings held back and cut."""

from __future__ import annotations

import random

import pytest

from orcaserve.scheduler.detokenizer import IncrementalDetokenizer, stream_backend

TEXTS = [
    "Hello, world! The quick brown fox.",
    "naïve café — 東京タワー 🚀🎉 emoji ZWJ 👩‍👩‍👧 and ١٢٣",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|> special tokens in text",
    "def f(x):\n    return x ** 2  # code",
]


def _sequences(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    specials = list(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    for _ in range(40):  # random ids: byte tokens that never complete a character included
        seqs.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
    for _ in range(20):  # text with special tokens and random bytes spliced in
        ids = list(rng.choice(seqs[: len(TEXTS)]))
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials + list(range(256))))
        seqs.append(ids)
    return seqs


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> list[tuple[bool, str, str]]:
    trace = []
    for i in range(1, len(ids) + 1):
        hit = detok.update(ids[:i])
        trace.append((hit, detok.text, detok.release(False)))
        if hit:
            break
    trace.append((False, detok.text, detok.release(True)))
    return trace


@pytest.mark.parametrize("stop", [[], ["fox"], ["東京", "\n\n"], ["🎉 e", "x ** "]])
def test_stream_matches_decode(tokenizer, stop):
    backend = stream_backend(tokenizer)
    assert backend is not None  # SmolLM2's tokenizer takes the fast path
    for ids in _sequences(tokenizer):
        fast = _run(IncrementalDetokenizer(tokenizer, stop, backend), ids)
        slow = _run(IncrementalDetokenizer(tokenizer, stop), ids)
        assert fast == slow, ids


def test_whole_text_is_decode(tokenizer):
    backend = stream_backend(tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, [], backend)
        for i in range(1, len(ids) + 1):
            detok.update(ids[:i])
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_plain_tokenizer_takes_decode_path():
    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    assert stream_backend(Plain()) is None
    detok = IncrementalDetokenizer(Plain(), ["cd"])
    assert not detok.update([0, 1])
    assert detok.update([0, 1, 2, 3]) and detok.text == "ab"
