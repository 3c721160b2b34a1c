"""A GGUF file's header (metadata, tensor table, where the data starts) and its tensors' bytes, read
lean: transformers' GGUF reader walks the metadata (string arrays, the vocabulary among them, only
counted) and the tensor table; the tensors stay in a memory map until one is read.

gguf-py's GGUFReader parses every metadata value into numpy arrays first, the vocabulary string by
string (2-7 s for SmolLM2's 49152 tokens, more at 128k), and transformers' `GgufHeader.from_file`
refuses the tensor types its own dequantizer lacks (llama.cpp's ternary TQ1_0 / TQ2_0 among them):
here the byte counts come from gguf-py's table of every ggml type, so any file gguf-py reads is read.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np


def read_gguf(path: str) -> tuple[dict[str, Any], Any]:
    """(metadata, transformers' GgufHeader) of the GGUF at `path`: metadata values as Python scalars,
    strings and lists of numbers (a string array as its length); the header's tensors in torch
    order with their byte counts. Raises ValueError where it is no GGUF, has no
    general.architecture, or holds a tensor type gguf-py does not know."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf.reader import GgufHeader, TensorInfo, _read_metadata, _read_tensor_table

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    metadata, count, pos = _read_metadata(blob, path)
    entries, pos = _read_tensor_table(blob, count, pos)
    infos = []
    for name, shape, ggml_type, offset in entries:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]  # ValueError: an unknown type
        infos.append(TensorInfo(name, shape, ggml_type, offset, prod(shape) // block * size))
    alignment = metadata.get("general.alignment", 32)  # llama.cpp's default
    data_start = (pos + alignment - 1) // alignment * alignment  # the next boundary after the table
    return metadata, GgufHeader(path, metadata["general.architecture"], tuple(infos), data_start)


def tensor_bytes(blob: np.ndarray, header: Any, info: Any) -> np.ndarray:
    """The raw bytes of tensor `info` (uint8, a view of `blob`, the file's memory map)."""
    start = header.data_start + info.offset
    return blob[start : start + info.nbytes]
