"""LoRA adapters made with PEFT for the tests, and the references they are held to.

`make_adapter` wraps a private copy of a base model with PEFT, gives the adapter random weights
(B nonzero, so its answers really differ from the base model's), saves it in PEFT's format and
returns the wrapped model: transformers' forward with the adapter applied, the reference."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Any,
    path: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    rslora: bool = False,
    std: float = 0.1,
    layers: list[int] | None = None,
) -> Any:
    """A PEFT LoRA adapter over a copy of `base` (on `layers` only, if given), saved to `path`;
    returns the PEFT model (eval). Both halves are drawn from N(0, std): PEFT's own init leaves B
    zero (no change at all)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        lora_dropout=0.0,
        layers_to_transform=layers,
    )
    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.eval()
    model.save_pretrained(str(path))
    return model


def run_mixed(engine: Any, work: list[tuple[str, list[int], int, str | None]], per_step: int = 2) -> dict[str, Any]:
    """Serve `work` ((request id, prompt, max tokens, adapter)) with staggered arrivals, `per_step`
    new requests every step; the final outputs by request id."""
    from orcaserve.scheduler import SamplingParams

    results: dict[str, Any] = {}
    pending = list(work)
    while pending or engine.has_unfinished():
        for rid, prompt, n, lora in pending[:per_step]:
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora=lora)
        pending = pending[per_step:]
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return results


def record_steps(engine: Any) -> list[Any]:
    """Every step's `LoraStep` (None: no adapter in the step) from now on, in order."""
    seen: list[Any] = []
    loras = engine.runner.loras
    step = loras.step

    def recording(*args: Any) -> Any:
        seen.append(step(*args))
        return seen[-1]

    loras.step = recording
    return seen
