"""A GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks, parsed into BlockCodes and matched to a loaded model's
linear layers by content (docs/serving.md "Quantized weights").

transformers loads a GGUF by dequantizing it (gguf-py's arithmetic, fp32) and renames and, for
Llama-family files, permutes the rows of q and k back from llama.cpp's rotary layout. Rather than
re-deriving its name map and permutations per architecture, each weight is found by what it holds:
every dequantized row of every block tensor is hashed, a module's rows are looked up among a tensor
with the same multiset of row hashes, and the row order that falls out is the permutation. A match
is kept only if dequantizing the permuted codes gives the module's weight back bit for bit; anything
else stays dense, with the reason in the log.

Block layouts (GGUF spec, ggml-common.h), 32 weights of one row per block, little-endian:
- Q8_0, 34 bytes: fp16 d, 32 int8 q;                       w = d * q
- Q4_0, 18 bytes: fp16 d, 16 bytes of nibbles;             w = d * (u - 8)
- Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles;     w = d * u + m
where byte j's low nibble is element j and its high nibble element j + 16. K-quants, 256 weights:
- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit sc, mn (8 each), 128 bytes of nibbles
  (32 bytes per 64 elements: low nibbles the first 32, high the next); w = d*sc * u - dmin*mn
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 sc, fp16 d;
  w = d*sc * (u - 32), sc per 16 elements
whose per-32 (per-16) scales become BlockCodes q4_k (q6_k) in fp32, as gguf-py computes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from orcaserve.kernels.quant import BlockCodes, dequantize, take_rows
from orcaserve.scheduler.model.gguf_header import tensor_bytes

log = logging.getLogger(__name__)

# GGML type name -> BlockCodes.fmt
FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q6_K": "q6_k"}
_TYPES = "/".join(FORMATS)
SUPER = {"q4_k": 256, "q6_k": 256}  # elements per block where not 32: K must be a multiple
_CHUNK_ROWS = 4096  # rows hashed at once: bounds the int64 temporary (32 MB per 1024 columns)


def takes_width(fmt: str, k: int) -> bool:
    """Whether a [N, k] tensor in `fmt` (a BlockCodes format) parses into BlockCodes."""
    return k % SUPER.get(fmt, 32) == 0


def parse_blocks(raw: np.ndarray, fmt: str, k: int) -> BlockCodes:
    """BlockCodes of a [N, K] weight from its raw blocks (uint8 [N, K / 32 * block bytes])."""
    n = raw.shape[0]
    if fmt in SUPER:
        return _parse_k(np.ascontiguousarray(raw).reshape(n * (k // 256), -1), fmt, n, k)
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, -1)  # [N, K / 32, block bytes]

    def fp16(at: int) -> torch.Tensor:  # [N, K / 32] fp32 of the fp16 at byte `at` of each block
        return torch.from_numpy(
            np.ascontiguousarray(blocks[:, :, at : at + 2]).view(np.float16)[..., 0].astype(np.float32)
        )

    if fmt == "q8_0":
        q = blocks[:, :, 2:].view(np.int8).reshape(n, k)
        return BlockCodes(fmt, torch.from_numpy(q.copy()), fp16(0), None)
    start = 2 if fmt == "q4_0" else 4
    nib = blocks[:, :, start : start + 16]
    u = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int8).reshape(n, k)  # element j, j + 16
    if fmt == "q4_0":
        return BlockCodes(fmt, torch.from_numpy(u - 8), fp16(0), None)
    return BlockCodes(fmt, torch.from_numpy(u), fp16(0), fp16(2))


def _parse_k(blocks: np.ndarray, fmt: str, n: int, k: int) -> BlockCodes:
    """BlockCodes of K-quant super-blocks [N * K / 256, block bytes], in gguf-py's arithmetic
    (gguf.quants Q4_K / Q6_K dequantize_blocks): the scales as its fp32 products."""
    from gguf.quants import Q4_K

    nb = blocks.shape[0]
    if fmt == "q4_k":
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [nb, 1]
        dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)  # [nb, 8]
        offset = -(dmin * mn.astype(np.float32))
        qs = blocks[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).astype(np.int8).reshape(n, k)
        return BlockCodes(fmt, torch.from_numpy(q), _rows(scale, n), _rows(offset, n))
    ql = blocks[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(nb, 8, 32)
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(nb, 8, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = blocks[:, 208:210].view(np.float16).astype(np.float32) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return BlockCodes(fmt, torch.from_numpy(q.reshape(n, k)), _rows(scale, n), None)


def _rows(x: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(n, -1))


def row_hashes(w: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [N] int64: a hash of each row's bits (a wrapping dot product with fixed odd
    multipliers); equal rows hash equal, a collision is caught by the bitwise check after."""
    n, k = w.shape
    gen = torch.Generator().manual_seed(47)
    mult = torch.randint(-(1 << 62), 1 << 62, (k,), generator=gen, dtype=torch.int64) | 1
    out = torch.empty(n, dtype=torch.int64)
    for i in range(0, n, _CHUNK_ROWS):
        bits = w[i : i + _CHUNK_ROWS].contiguous().view(torch.int32).to(torch.int64)
        out[i : i + _CHUNK_ROWS] = (bits * mult).sum(1)
    return out


@dataclass
class _Candidate:
    name: str
    codes: BlockCodes
    rows: dict[int, list[int]]  # row hash -> rows of the tensor with it


def _signature(hashes: torch.Tensor) -> tuple[int, ...]:
    return tuple(sorted(hashes.tolist()))


def _rows_by_hash(hashes: torch.Tensor) -> dict[int, list[int]]:
    """row hash -> the rows with it, ascending."""
    rows: dict[int, list[int]] = {}
    for r, h in enumerate(hashes.tolist()):
        rows.setdefault(h, []).append(r)
    return rows


def _reordered(codes: BlockCodes, index: torch.Tensor, w: torch.Tensor) -> BlockCodes | None:
    """`codes` with its rows taken in `index`'s order, if they then dequantize to `w` bit for bit."""
    if not index.equal(torch.arange(len(index))):
        codes = take_rows(codes, index)
    return codes if torch.equal(dequantize(codes).view(torch.int32), w.view(torch.int32)) else None


def _permutation(hashes: torch.Tensor, rows: dict[int, list[int]]) -> torch.Tensor | None:
    """index[i] = the tensor row whose hash equals row i's; None if a row has no partner."""
    taken = {h: list(r) for h, r in rows.items()}
    index = []
    for h in hashes.tolist():
        free = taken.get(h)
        if not free:
            return None
        index.append(free.pop(0))
    return torch.tensor(index, dtype=torch.int64)


def match_gguf_blocks(path: str, named: list[tuple[str, Any]]) -> dict[str, BlockCodes | None]:
    """For each (name, module) the codes that reproduce its fp32 weight bit for bit, with rows in
    the module's order, or None; the log names tensors of other types and modules left dense."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    by_sig: dict[tuple[tuple[int, int], tuple[int, ...]], list[_Candidate]] = {}
    other: list[str] = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        if len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists dimensions innermost first
        if kind not in FORMATS or not takes_width(FORMATS[kind], k):
            if kind not in ("F32", "F16", "BF16"):
                other.append(f"{t.name} ({kind})")
            continue
        codes = parse_blocks(np.asarray(t.data), FORMATS[kind], k)
        hashes = row_hashes(dequantize(codes))
        by_sig.setdefault(((n, k), _signature(hashes)), []).append(_Candidate(t.name, codes, _rows_by_hash(hashes)))
    if other:
        log.warning("GGUF tensors of types without a packed GEMM, served dense: %s", ", ".join(other))
    found: dict[str, BlockCodes | None] = {}
    for name, module in named:
        w = module.weight.detach()
        found[name] = None
        if w.dtype != torch.float32 or w.dim() != 2:
            log.warning("%s: weight is %s, not the fp32 the file dequantizes to: served dense", name, w.dtype)
            continue
        hashes = row_hashes(w)
        for cand in by_sig.get((tuple(w.shape), _signature(hashes)), []):
            index = _permutation(hashes, cand.rows)
            found[name] = None if index is None else _reordered(cand.codes, index, w)
            if found[name] is not None:
                break
        if found[name] is None:
            log.warning("%s: no block tensor of the file (%s) reproduces it bit for bit: served dense", name, _TYPES)
    return found


def matched_permutation(path: str, tensor: str, module: Any) -> torch.Tensor | None:
    """The row order of GGUF `tensor` that gives `module`'s weight (tests: q/k come permuted)."""
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(path).tensors if t.name == tensor)
    codes = parse_blocks(np.asarray(t.data), FORMATS[t.tensor_type.name], int(t.shape[0]))
    return _permutation(row_hashes(module.weight.detach()), _rows_by_hash(row_hashes(dequantize(codes))))


def stream_gguf(
    path: str, model: Any, config: dict, wants_codes: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor, BlockCodes | None]]:
    """The file's tensors one at a time, as transformers' GGUF loader (load_gguf_checkpoint) makes
    each of them: gguf-py's fp32 dequantization, its name map, its per-architecture processor
    (Llama's q/k rows un-permuted), never more than one at once: (parameter name, fp32 tensor,
    codes). `config`: the dict transformers parsed from the file's metadata (its processor's
    input); `model`: the weightless model being filled. Codes come for the names `wants_codes`
    accepts: the file's own blocks in the parameter's row order, verified to dequantize to the
    tensor bit for bit (as match_gguf_blocks, against the one tensor the name map names), else None
    with the reason in the log. The tensor table is read with transformers' own lean reader
    (gguf-py's GGUFReader parses the whole vocabulary first: ~10 s for SmolLM2's); a BitNet file's
    ternary types, which that reader refuses, go through gguf_header.read_gguf (bitnet_gguf.py)."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize
    from transformers.integrations.gguf.reader import GgufHeader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    header = GgufHeader.from_file(path)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(_TopNames(model), processor)
    parsed: dict[str, dict] = {"config": config, "tensors": {}}
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    other: list[str] = []
    for info in header.tensors:
        kind = GGMLQuantizationType(info.ggml_type)
        data = as_gguf_py_reads(tensor_bytes(blob, header, info), kind, info.shape)
        done = processor.process(
            weights=gguf_dequantize(data, kind), name=info.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if done.name not in names:
            continue
        key = names[done.name]
        w = torch.from_numpy(np.copy(done.weights)).to(torch.float32)
        del done
        codes = None
        if wants_codes(key):
            if kind.name in FORMATS and w.dim() == 2 and takes_width(FORMATS[kind.name], w.shape[1]):
                codes = verified(parse_blocks(data, FORMATS[kind.name], w.shape[1]), w)
                if codes is None:
                    log.warning("%s: its tensor %s does not reproduce it bit for bit: served dense", key, info.name)
            elif kind.name not in ("F32", "F16", "BF16"):
                other.append(f"{info.name} ({kind.name})")
        yield key, w, codes
    if other:
        log.warning("GGUF tensors of types without a packed GEMM, served dense: %s", ", ".join(other))


class _TopNames:
    """The model as get_gguf_hf_weights_map sees it, without children: the decoder families'
    parameter names are all mapped from the top, and its walk into every submodule rebuilds
    gguf-py's name map each time (~400 times, 10 s and more for SmolLM2)."""

    def __init__(self, model: Any):
        self.config, self._model = model.config, model

    def state_dict(self) -> dict:
        return self._model.state_dict()

    def named_children(self) -> Iterator[tuple[str, Any]]:
        return iter(())


def as_gguf_py_reads(raw: np.ndarray, kind: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes viewed as gguf-py's GGUFReader gives its `data` (what transformers hands
    gguf-py's dequantize): plain types as their numpy type, block types as uint8 rows of blocks."""
    from gguf import GGMLQuantizationType as T

    plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16}
    plain.update({T.I32: np.int32, T.I64: np.int64})
    if kind in plain:
        return raw.view(plain[kind]).reshape(shape)
    return raw.reshape(*shape[:-1], -1)


def verified(codes: BlockCodes, w: torch.Tensor) -> BlockCodes | None:
    """`codes` (file row order) in `w`'s row order if they dequantize to `w` bit for bit, else None.
    The row order is found by content, as match_gguf_blocks finds it (q/k come permuted)."""
    plain = dequantize(codes)
    if torch.equal(plain.view(torch.int32), w.view(torch.int32)):
        return codes
    index = _permutation(row_hashes(w), _rows_by_hash(row_hashes(plain)))
    return None if index is None else _reordered(codes, index, w)
