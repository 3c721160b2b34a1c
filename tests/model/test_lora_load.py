"""Adapters that cannot be served exactly are refused at load with a message naming what is wrong,
and so are the combinations LoRA is not built for (docs/lora.md "What is refused")."""

from __future__ import annotations

import json

import pytest
import torch
from lora_adapters import make_adapter
from safetensors.torch import load_file, save_file

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.scheduler import EngineConfig
from orcaserve.scheduler.lora.adapter import AdapterError
from orcaserve.scheduler.lora.config import LoraUnsupported

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def base():
    return tiny_family("LlamaForCausalLM")


@pytest.fixture
def adapter(base, tmp_path):
    """A good adapter's directory, for each test to spoil."""
    make_adapter(base, tmp_path / "ad", seed=1, r=8, targets=("q_proj", "v_proj", "down_proj"))
    return tmp_path / "ad"


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_weights(path, edit):
    tensors = load_file(str(path / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS))


def test_a_good_adapter_loads(base, adapter, engine_for):
    engine = engine_for(base, lora_adapters={"ad": str(adapter)})
    (loaded,) = engine.runner.loras.adapters.values()
    assert loaded.rank == 8 and loaded.scale == 2.0 and loaded.modules == {"q_proj", "v_proj", "down_proj"}
    assert engine.lora_names == ["ad"]


def _first(prefix: str):
    return lambda t: next(k for k in t if prefix in k)


SPOILERS = {
    "no config": (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
    "bad json": (lambda p: (p / "adapter_config.json").write_text("{"), "not valid JSON"),
    "no weights": (lambda p: (p / WEIGHTS).unlink(), "no adapter_model.safetensors"),
    "garbled weights": (lambda p: (p / WEIGHTS).write_bytes(b"\x10\x00garbage"), "cannot be read"),
    "dora": (lambda p: _edit_config(p, use_dora=True), "use_dora=True is not supported"),
    "bias": (lambda p: _edit_config(p, bias="all"), "bias='all' is not supported"),
    "modules to save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "rank pattern": (lambda p: _edit_config(p, rank_pattern={"q_proj": 4}), "rank_pattern"),
    "not lora": (lambda p: _edit_config(p, peft_type="IA3"), "peft_type 'IA3'"),
    "rank above max": (lambda p: _edit_config(p, r=32), "rank 32 is above max_lora_rank=16"),
    "rank mismatch": (lambda p: _edit_config(p, r=4), r"has shape \(8, 128\), expected \(4, 128\) \(rank 4\)"),
    "target not listed": (lambda p: _edit_config(p, target_modules=["q_proj"]), "not named in target_modules"),
    "embedding target": (
        lambda p: _edit_config(p, target_modules=["q_proj", "embed_tokens"]),
        r"target_modules \['embed_tokens'\] not supported",
    ),
    "half missing": (
        lambda p: _edit_weights(p, lambda t: t.pop(_first("q_proj.lora_B")(t))),
        "lora_A without its other half",
    ),
    "wrong shape": (
        lambda p: _edit_weights(p, lambda t: t.update({_first("v_proj.lora_B")(t): torch.zeros(48, 8)})),
        r"shape \(48, 8\), expected \(32, 8\)",
    ),
    "layer beyond the model": (
        lambda p: _edit_weights(
            p, lambda t: t.update({k.replace("layers.1.", "layers.7."): v.clone() for k, v in list(t.items())})
        ),
        "layer 7, the base model has 2 layers",
    ),
    "foreign tensor": (
        lambda p: _edit_weights(p, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})),
        "is not a LoRA weight of a decoder projection",
    ),
    "not finite": (
        lambda p: _edit_weights(p, lambda t: t[_first("down_proj.lora_A")(t)].fill_(float("nan"))),
        "not finite",
    ),
}


@pytest.mark.parametrize("case", SPOILERS)
def test_a_bad_adapter_is_refused_naming_what_is_wrong(case, base, adapter, engine_for):
    spoil, message = SPOILERS[case]
    spoil(adapter)
    with pytest.raises(AdapterError, match=message) as e:
        engine_for(base, lora_adapters={"ad": str(adapter)})
    assert "'ad'" in str(e.value)


def test_an_adapter_for_another_model_is_refused(base, tmp_path, engine_for):
    wider = tiny_family("LlamaForCausalLM", hidden_size=96)
    make_adapter(wider, tmp_path / "w", seed=1)
    with pytest.raises(AdapterError, match=r"has shape \(96, 8\), expected \(64, 8\)"):
        engine_for(base, lora_adapters={"w": str(tmp_path / "w")})
    with pytest.raises(AdapterError, match="not a directory"):
        engine_for(base, lora_adapters={"w": str(tmp_path / "nowhere")})


def test_a_model_outside_the_lean_decoder_is_refused(adapter, engine_for):
    gemma = tiny_family("GemmaForCausalLM", head_dim=16)
    with pytest.raises(LoraUnsupported, match="lean decoder"):
        engine_for(gemma, lora_adapters={"ad": str(adapter)})


@pytest.mark.parametrize(
    "args, message",
    [
        ({"tensor_parallel_size": 2}, "not split over ranks"),
        ({"quantization": "int8"}, "quantization='int8'"),
        ({"device": "cuda"}, "not yet on a GPU"),
    ],
)
def test_combinations_not_built_are_refused_before_loading(args, message):
    with pytest.raises(LoraUnsupported, match=message):
        EngineConfig(**{"lora_adapters": {"a": "/nowhere"}, **args})


@pytest.mark.parametrize(
    "args, message",
    [
        ({"lora_adapters": {"a b": "/x"}}, "adapter name 'a b'"),
        ({"lora_adapters": {"a": ""}}, "needs a directory path"),
        ({"lora_adapters": ["a"]}, "mapping of adapter name"),
        ({"max_lora_rank": 0}, "max_lora_rank must be a positive integer"),
        ({"max_loras": True}, "max_loras must be a positive integer"),
        ({"max_cpu_loras": 0}, "max_cpu_loras must be a positive integer"),
        ({"max_loras": 2, "max_cpu_loras": 1, "enable_lora": True}, "max_cpu_loras=1 is below max_loras=2"),
        ({"enable_lora": "yes"}, "enable_lora must be true or false"),
    ],
)
def test_bad_lora_arguments_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**args)


def test_the_gpu_checks_opt_in_alone_lifts_the_device_refusal(monkeypatch):
    """On a CUDA device adapters are refused unless the GPU check's step sets its variable to "1"."""
    from orcaserve.scheduler.lora.config import GPU_CHECK_ENV, check_lora_config

    args = dict(tensor_parallel_size=1, quantization=None, device=torch.device("cuda"))
    monkeypatch.setenv(GPU_CHECK_ENV, "true")  # only "1" counts
    with pytest.raises(LoraUnsupported, match="not yet on a GPU"):
        check_lora_config({"a": "/x"}, None, 16, **args)
    monkeypatch.setenv(GPU_CHECK_ENV, "1")
    check_lora_config({"a": "/x"}, None, 16, **args)
