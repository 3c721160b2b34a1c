"""What `quantization` and `activations` left null become for a checkpoint (`Engine.from_pretrained`).

A GGUF file is served the way its file intends, as llama.cpp computes it: its own blocks
(`quantization: gguf`) with int8 activations and integer dot products, on a CPU that has them
(AVX-512 VNNI's `vpdpbusd`, or AVX2's `vpmaddubsw`) and where the lean decoder serves its family.
Anywhere else (a safetensors directory, a GPU, tensor parallelism, LoRA adapters, a CPU without
AVX2, where the C++ operators are not built) the weights stay dense in `dtype`: the quantized GEMMs would run
their PyTorch twin there, an fp32 copy of every weight, slower than dense. `quantization: none`
asks for the dense exact path by name. Why and what was measured: docs/quantized-weights.md
"Defaults". A BitNet GGUF's projections are ternary whatever the choice; `gguf` there serves its
lm_head from the file's blocks where it has them (llama-quantize's Q6_K), else it is dense
(docs/bitnet.md, "A quantized lm_head").
"""

from __future__ import annotations

import dataclasses
import logging

from orcaserve.scheduler.config import EngineConfig

log = logging.getLogger(__name__)

# general.architecture of the GGUF files whose model the lean decoder serves (decoder.SUPPORTED).
LEAN_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_BITNET = "a BitNet GGUF, its TQ1_0 / TQ2_0 projections served as ternary weights (docs/bitnet.md)"


def gguf_architecture(path: str) -> str | None:
    """The file's `general.architecture`, read from its header (None where it has none) with
    transformers' lean reader: gguf-py's GGUFReader parses the whole vocabulary first (2-7 s for
    SmolLM2's, on every load), this one reads the metadata and tensor names (0.04 s)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:  # the metadata alone: its tensor table check refuses types it cannot load (BitNet's TQ1_0)
        return read_gguf_metadata(path)[0]["general.architecture"]
    except ValueError:  # no general.architecture (or not a GGUF at all)
        return None


def integer_dot_products() -> bool:
    """Whether the int8 GEMM runs here as a C++ kernel of integer dot products (`linear_int8` on
    avx2 and up, docs/int8-activations.md "Kernels per ISA"), loading the operators as the first
    quantized layer would."""
    from orcaserve.kernels import dispatch
    from orcaserve.kernels.cpu import build

    build.load()
    return dispatch.resolve("linear_int8", "q4_0").startswith("orcaserve.")


def _dense_because(config: EngineConfig, path: str) -> str | None:
    """Why a GGUF at `path` is served dense under `config` (None: it is served quantized)."""
    if not path.endswith(".gguf"):
        return "not a GGUF file"
    if config.resolved_device().type != "cpu":
        return "the quantized GEMMs run on the CPU only"
    if config.tensor_parallel_size > 1:
        return "quantized weights are not split over ranks"
    if config.lora_adapters:
        return "LoRA adapters are served over dense weights (docs/lora.md)"
    arch = gguf_architecture(path)
    if arch == "bitnet" and not _bitnet_head_in_blocks(path):
        return _BITNET
    if arch not in (*LEAN_GGUF_ARCHITECTURES, "bitnet"):
        return f"architecture {arch!r} is not served by the lean decoder"
    if not integer_dot_products():
        return "this CPU has no integer dot products the C++ operators use (AVX2 or VNNI)"
    return None


def _bitnet_head_in_blocks(path: str) -> bool:
    """Whether a BitNet GGUF's lm_head is in a block type with a packed GEMM (llama-quantize's
    Q6_K), served from its blocks (docs/bitnet.md, "A quantized lm_head")."""
    from orcaserve.scheduler.model.bitnet_gguf import head_format

    return head_format(path) is not None


def choose_weights(config: EngineConfig, path: str) -> EngineConfig:
    """`config` with `quantization` and `activations` set for the checkpoint at `path` (resolved:
    a .gguf file or a directory) where the user left `quantization` null; as given otherwise."""
    if config.quantization is not None:
        return config
    why = _dense_because(config, path)
    if why is not None:
        if config.activations is not None:
            raise ValueError(f"activations={config.activations!r} runs against quantized weights only, and {why}")
        if why is _BITNET:
            log.info("quantization chosen: none, %s", why)
        elif path.endswith(".gguf"):
            log.info("quantization chosen: none, the GGUF dequantized to %s (%s)", config.resolved_dtype(), why)
        return dataclasses.replace(config, quantization="none")
    log.info(
        "quantization chosen: gguf with int8 activations, the file's blocks against integer dot products as "
        "llama.cpp computes them, other tensors in %s (quantization: none serves it dense and exact; "
        'docs/quantized-weights.md "Defaults")',
        config.resolved_dtype(),
    )
    return dataclasses.replace(config, quantization="gguf", activations=config.activations or "int8")
