"""Loading a model served quantized one tensor at a time (docs/serving.md "Quantized weights",
"Memory at load").

Loading the whole model in fp32 and quantizing it afterwards needs the fp32 model's size at load:
an 8B Q4 GGUF of 5 GB would need over 32 GB. Here the model is built without weights (parameters
on the meta device; buffers such as the rotary frequencies computed as usual), then filled tensor
by tensor from the file: a projection the lean decoder quantizes (quantized.linears) gets its
codes and never keeps its dense weight; everything else is set dense in the engine's dtype. Each
tensor is first made exactly as transformers' loader makes it in fp32 (safetensors upcast; a GGUF
through gguf_blocks.stream_gguf), so the codes and dense tensors are those of the fp32 load followed
by quantize_model and the cast to dtype, bit for bit (tests/model/test_quantized_load.py).
"""

from __future__ import annotations

import copy
import glob
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from orcaserve.kernels.quant import BlockCodes
from orcaserve.scheduler.model.families import check_quantization
from orcaserve.scheduler.model.quantized import (
    CODES,
    GGUF_PATH,
    QUANTIZED,
    attach,
    linears,
    log_quantized,
    quantize_for,
)

log = logging.getLogger(__name__)

HEAD = "lm_head.weight"


def can_stream(path: str) -> bool:
    """Whether `path` (a .gguf file or an HF directory, resolved) has a format read here tensor by
    tensor: a GGUF, or safetensors (a directory of .bin files loads the old way)."""
    return path.endswith(".gguf") or bool(glob.glob(os.path.join(path, "*.safetensors")))


def load_streamed(path: str, dtype: torch.dtype, mode: str) -> Any:
    """The model at `path` (a .gguf file or an HF directory with safetensors) with `mode`'s codes
    ("gguf", "int8", "int4") attached and its other weights in `dtype`, on the CPU; refused
    before any weight is read if the lean decoder does not serve its family."""
    from transformers import CONFIG_MAPPING, AutoConfig, GenerationConfig, PreTrainedConfig

    gguf = path.endswith(".gguf")
    if mode == "gguf" and not gguf:
        raise ValueError("quantization 'gguf' needs a model loaded from a .gguf file")
    folder = os.path.dirname(os.path.abspath(path)) if gguf else path
    if gguf:  # AutoConfig's own steps, keeping the parsed dict: the GGUF processor's input
        parsed, unused = PreTrainedConfig.get_config_dict(folder, gguf_file=os.path.basename(path))
        config = CONFIG_MAPPING[parsed["model_type"]].from_dict(copy.deepcopy(parsed), **unused)
    else:
        config = AutoConfig.from_pretrained(folder)
    config.name_or_path = folder  # as from_pretrained sets it
    model = meta_skeleton(config)
    check_quantization(model, mode)
    if not gguf:  # what from_pretrained reads besides the weights; a GGUF has none (as there)
        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            pass
    modules = {f"{name}.weight": (name, module) for name, module in linears(model)}
    ties = dict(getattr(model, "all_tied_weights_keys", None) or {})  # target -> source, transformers' own
    head_from = ties.pop(HEAD, None)  # a tied lm_head is made from its source tensor, not read
    rows: dict[str, tuple[int, BlockCodes | None]] = {}

    def wants_codes(key: str) -> bool:  # the file's own blocks: a projection's, or a tied head's source
        return mode == "gguf" and (key == head_from or (key in modules and (key != HEAD or head_from is None)))

    if gguf:
        from orcaserve.scheduler.model.gguf_blocks import stream_gguf

        tensors: Iterator[tuple[str, torch.Tensor, BlockCodes | None]] = stream_gguf(path, model, parsed, wants_codes)
    else:
        tensors = ((key, w, None) for key, w in _safetensors(path))
    for key, w, file_codes in tensors:
        if key == HEAD and head_from is not None:
            continue  # tied: transformers ignores a stored copy too
        for target in [key] + ([HEAD] if key == head_from else []):
            if target not in modules:
                put_tensor(model, target, w.to(dtype))
                continue
            name, module = modules[target]
            codes = file_codes if mode == "gguf" else quantize_for(mode, name, w)
            rows[name] = (w.numel(), codes)
            if codes is None:
                put_tensor(model, target, w.to(dtype))
            else:
                attach(module, codes)
        del w, file_codes
    if head_from is not None and getattr(model.lm_head, CODES, None) is None:
        model.lm_head.weight = model.get_parameter(head_from)  # dense and tied, as from_pretrained ties it
    for target, source in ties.items():
        put_tensor(model, target, model.get_parameter(source))
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path} has no tensor for {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}")
    log_quantized(mode, dtype, [(name, *rows[name]) for name, _ in linears(model) if name in rows])
    setattr(model, QUANTIZED, mode)
    if gguf:
        setattr(model, GGUF_PATH, path)
    return model.eval()


def meta_skeleton(config: Any) -> Any:
    """The model of `config` in fp32 (the dtype from_pretrained builds it in for quantization),
    its parameters on the meta device; buffers real (accelerate's init_empty_weights keeps them)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the folder's safetensors files, upcast to fp32 as from_pretrained(dtype=fp32)
    does. The file is reopened per tensor: a mapping kept open keeps every page it has read in the
    process's RSS, so the whole file would count at the end."""
    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            with safe_open(file, framework="pt") as f:
                tensor = f.get_tensor(key)
            yield key, tensor.to(torch.float32)


def put_tensor(model: Any, key: str, value: torch.Tensor) -> None:
    """Set parameter or buffer `key` of `model` to `value` (a Parameter, as loaded ones are)."""
    owner, _, attr = key.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._buffers:
        module._buffers[attr] = value
        return
    if attr not in module._parameters:
        log.warning("%s is not a parameter of the model: ignored", key)
        return
    old = module._parameters[attr]
    if not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=old.requires_grad if old is not None else False)
    module._parameters[attr] = value
