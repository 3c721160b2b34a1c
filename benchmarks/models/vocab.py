"""A tokenizer of any size from SmolLM2's, for random checkpoints whose head is wider than 49152
rows (the 2B4T shape's 128256): llama.cpp sizes a model's vocabulary from the GGUF's token list and
refuses an embedding of another row count, so the list must have exactly the head's rows.

    vocab_gguf(128256)  # ~/.cache/orcaserve/vocab-128256.gguf: metadata only, no tensors

SmolLM2's byte-level BPE (its tokens, merges, pre-tokenizer `smollm`, special ids) grows by merges
of its own tokens, a word start (`Ġ` and letters) with a short lowercase continuation, ranked
after all of SmolLM2's merges: a valid BPE that transformers' GGUF tokenizer builder and llama.cpp
both load, and one that encodes text as SmolLM2 does except where a grown token applies. The file
holds SmolLM2's other metadata as it is (so transformers reads it as the model it came from);
`write_bitnet_gguf(..., tokenizer_from=vocab_gguf(n))` copies its tokenizer into a model's GGUF.
"""

from __future__ import annotations

import os

_SUFFIXES = 64  # continuations per word start: 25k word starts x 64 is far more than any head needs


def grown_merges(tokens: list[str], size: int) -> list[tuple[str, str]]:
    """`size - len(tokens)` new merges (a, b), each a + b a token not among `tokens` nor earlier
    merges, in a fixed order: for each of the first continuations, every word start by id."""
    if size < len(tokens):
        raise ValueError(f"a vocabulary of {len(tokens)} tokens grows only: {size} asked")
    starts = [t for t in tokens if t.startswith("Ġ") and t[1:].isascii() and t[1:].isalpha()]
    ends = [t for t in tokens if t.isascii() and t.isalpha() and t.islower() and 2 <= len(t) <= 4][:_SUFFIXES]
    seen, out = set(tokens), list[tuple[str, str]]()
    for b in ends:
        for a in starts:
            if len(out) == size - len(tokens):
                return out
            if a + b not in seen:
                seen.add(a + b)
                out.append((a, b))
    if len(out) < size - len(tokens):
        raise ValueError(f"{size} tokens asked: only {len(tokens) + len(out)} can be grown from this vocabulary")
    return out


def vocab_gguf(size: int, out: str | None = None, source: str | None = None) -> str:
    """A metadata-only GGUF at `out` (cached) whose tokenizer is `source`'s (the default model's
    GGUF) grown to `size` tokens; its other metadata is the source's."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from orcaserve.scheduler import default_model_path

    out = out or os.path.join(os.path.expanduser("~/.cache/orcaserve"), f"vocab-{size}.gguf")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fields = GGUFReader(source or default_model_path()).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    merges = grown_merges(tokens, size)
    grown = {
        "tokenizer.ggml.tokens": tokens + [a + b for a, b in merges],
        "tokenizer.ggml.token_type": list(fields["tokenizer.ggml.token_type"].contents()) + [1] * len(merges),
        "tokenizer.ggml.merges": list(fields["tokenizer.ggml.merges"].contents()) + [f"{a} {b}" for a, b in merges],
    }
    writer = GGUFWriter(out + ".part", str(fields["general.architecture"].contents()))
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer's own
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, grown.get(key, field.contents()), field.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    os.replace(out + ".part", out)
    return out
