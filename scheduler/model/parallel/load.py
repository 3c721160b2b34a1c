"""One rank's slice of a model, read from its files slice by slice (docs/tensor-parallel.md,
"Loading").

safetensors: each tensor's slice is read through `safe_open(...).get_slice`, so a rank never
holds more than its slices plus one slice being converted. GGUF: the file's tensors come one at a
time from `stream_gguf` (dequantized in fp32, as transformers' loader makes them), each sliced at
once: the peak is the rank's slices plus one whole tensor in fp32 (the embedding, for SmolLM2
49152 x 576, 113 MB). The skeleton is built with the rank's head and intermediate counts
(`Shard.local_config`), so the lean decoder runs it unchanged apart from its collectives.
"""

from __future__ import annotations

import copy
import glob
import os
from collections.abc import Iterator
from typing import Any

import torch

from orcaserve.scheduler.model.families import lean_supports
from orcaserve.scheduler.model.parallel.shard import EMBED, HEAD, Shard, TensorParallelUnsupported
from orcaserve.scheduler.model.stream_load import meta_skeleton, put_tensor


def read_config(path: str) -> tuple[Any, dict | None]:
    """(transformers config, the GGUF's parsed metadata dict or None) of a .gguf file or HF dir."""
    from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig

    if path.endswith(".gguf"):
        folder = os.path.dirname(os.path.abspath(path))
        parsed, unused = PreTrainedConfig.get_config_dict(folder, gguf_file=os.path.basename(path))
        config = CONFIG_MAPPING[parsed["model_type"]].from_dict(copy.deepcopy(parsed), **unused)
        config.name_or_path = folder
        return config, parsed
    config = AutoConfig.from_pretrained(path)
    config.name_or_path = path
    return config, None


def load_shard(path: str, shard_rank: int, world: int, dtype: torch.dtype) -> Any:
    """The model at `path` (a .gguf file or an HF directory with safetensors, resolved) with this
    rank's slices of every weight in `dtype`, on the CPU; its config keeps the whole vocabulary."""
    from transformers import GenerationConfig

    gguf = path.endswith(".gguf")
    if not gguf and not glob.glob(os.path.join(path, "*.safetensors")):
        raise TensorParallelUnsupported(f"{path} has no safetensors: tensor parallelism reads slices of them")
    config, parsed = read_config(path)
    full = meta_skeleton(config)  # weightless: the tensors' names, ties and the GGUF name map
    if getattr(config, "quantization_config", None) and config.model_type == "bitnet":
        raise TensorParallelUnsupported("a packed BitNet checkpoint: its ternary projections are not split yet")
    if not lean_supports(full):
        raise TensorParallelUnsupported(
            f"{type(full).__name__} runs through transformers' forward: tensor parallelism needs the lean decoder"
        )
    shard = Shard.of(config, shard_rank, world)
    model = meta_skeleton(shard.local_config(config))
    if not gguf:
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
    ties = dict(getattr(full, "all_tied_weights_keys", None) or {})  # target -> source
    head_from = ties.pop(HEAD, None)
    tensors = _gguf_slices(path, full, parsed, shard) if gguf else _safetensors_slices(path, shard)
    for key, w in tensors:
        if key == HEAD and head_from is not None:
            continue
        w = _padded(w.to(dtype), shard, key)
        put_tensor(model, key, w)
        if key == head_from:
            put_tensor(model, HEAD, w)  # tied: the same slice of the same rows
    for target, source in ties.items():
        put_tensor(model, target, model.get_parameter(source))
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path} has no tensor for {', '.join(missing[:8])}")
    return model.eval()


def _padded(w: torch.Tensor, shard: Shard, key: str) -> torch.Tensor:
    """A vocabulary slice grown to V_r rows with zeros (the last rank's, when V_r * N > V)."""
    if key not in (EMBED, HEAD) or w.shape[0] == shard.vocab_rows:
        return w
    return torch.cat([w, w.new_zeros(shard.vocab_rows - w.shape[0], *w.shape[1:])])


def _cut(w: Any, shard: Shard, key: str) -> torch.Tensor:
    """This rank's slice of `w` (a tensor or a safetensors slice), fp32; zeros for a bias added elsewhere."""
    spec = shard.rows(key)
    if spec is None:
        out = w[:] if not isinstance(w, torch.Tensor) else w
    else:
        dim, start, stop = spec
        stop = min(stop, (w.shape if isinstance(w, torch.Tensor) else w.get_shape())[dim])
        index = [slice(None)] * (2 if dim else 1)
        index[dim] = slice(start, stop)
        out = w[tuple(index)]
    out = out.to(torch.float32)
    return torch.zeros_like(out) if shard.bias_elsewhere(key) else out.clone()


def _safetensors_slices(folder: str, shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
        for key in keys:  # reopened per tensor: pages read stay in RSS while a mapping is open
            with safe_open(file, framework="pt") as f:
                yield key, _cut(f.get_slice(key), shard, key)


def _gguf_slices(path: str, full: Any, parsed: dict | None, shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    from orcaserve.scheduler.model.gguf_blocks import stream_gguf

    for key, w, _ in stream_gguf(path, full, parsed or {}, lambda _key: False):
        yield key, _cut(w, shard, key)
        del w
