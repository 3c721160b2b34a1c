"""Where a decode step's time goes at a few rows (`orcaserve-bench latency --breakdown`): the
engine's `step` timed whole and in its parts by wrapping them on one engine (nothing in the engine
changes): the model run (`runner.execute`: step inputs, the forward, the lm_head), the sampler
(`sampler.sample`: the argmax over the vocabulary at temperature 0), the post-processing
(`postprocessor.step`: tokens appended, detokenized, stops checked), and the rest (scheduling, the
step's bookkeeping). On the lean decoder the model run is split further, op by op: each
projection's GEMM (the lm_head's too) with the weight bytes it reads, the attention, and the
element-wise ops, and `layer`, the layers run in one C++ call a step (scheduler/model/layer_call.py:
their GEMMs and ops are then in it, not in their own columns); `forward_rest` is the forward less
those (Python, embedding, rotary tables, the final norm), and `inputs` the model run less the
forward (the step's input tensors, the attention plan). Figures and what was cut:
docs/one-stream.md."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PARTS = ("model", "lm_head", "sampler", "postprocess")
# The lean decoder's ops, timed where it calls them (`decoder.py`): the layers' GEMMs, then the rest.
GEMMS = ("qkv", "o", "gate_up", "down")
OPS = ("attention", "add_rms_norm", "rope_store_kv", "silu_mul", "layer")

Clock = Callable[[], float]


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any], clock: Clock) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            totals[name] += clock() - t

    return wrapper


class _TimedGemm:
    """A decoder GEMM (`Linear`, `QuantLinear`, ...) timed per call; its attributes read through."""

    def __init__(self, gemm: Any, totals: dict[str, float], name: str, clock: Clock) -> None:
        self.gemm, self.call = gemm, _timed(totals, name, gemm, clock)
        # a greedy step's argmax inside the lm_head's GEMM (QuantLinear.argmax): timed as the GEMM
        self.argmax_call = _timed(totals, name, gemm.argmax, clock) if hasattr(gemm, "argmax") else None

    def __call__(self, x: Any) -> Any:
        return self.call(x)

    def argmax(self, x: Any) -> Any:
        return self.argmax_call(x) if self.argmax_call is not None else None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.gemm, attr)


def _wrap_decoder(decoder: Any, backend: Any, totals: dict[str, float], clock: Clock) -> Callable[[], None]:
    """Time the decoder's ops into `totals`; returns what undoes it."""
    saved: list[tuple[Any, str, Any]] = []  # (object, attribute, its own value or None: the class's)

    def swap(obj: Any, attr: str, new: Any) -> None:
        saved.append((obj, attr, vars(obj).get(attr)))
        setattr(obj, attr, new)

    for layer in decoder.layers:
        for name in GEMMS:
            swap(layer, name, _TimedGemm(getattr(layer, name), totals, name, clock))
    swap(decoder, "lm_head", _TimedGemm(decoder.lm_head, totals, "lm_head", clock))
    for name in ("add_rms_norm", "rope_store_kv", "silu_mul"):
        attr = name.replace("_kv", "") + "_op"
        if getattr(decoder, attr, None) is not None:
            swap(decoder, attr, _timed(totals, name, getattr(decoder, attr), clock))
    swap(backend, "attend", _timed(totals, "attention", backend.attend, clock))
    call = getattr(decoder, "layer_call", None)
    if call is not None:  # every layer in one call a step (LayerCall.all)
        swap(call, "all", _timed(totals, "layer", call.all, clock))
    swap(decoder, "forward", _timed(totals, "forward", decoder.forward, clock))

    def undo() -> None:
        for obj, attr, old in reversed(saved):
            if old is None:
                delattr(obj, attr)  # a method: the class's shows again
            else:
                setattr(obj, attr, old)

    return undo


def weight_bytes(decoder: Any, dtype: Any) -> dict[str, int]:
    """The weight bytes each GEMM reads in one step (all layers), as dram.bytes_per_token counts them."""
    import torch

    dense = torch.finfo(dtype).bits // 8

    def nbytes(g: Any) -> int:
        return g.nbytes() if hasattr(g, "nbytes") else g.in_features * g.out_features * dense

    out = {name: sum(nbytes(getattr(layer, name)) for layer in decoder.layers) for name in GEMMS}
    out["lm_head"] = nbytes(decoder.lm_head)
    return out


def breakdown(
    engine: Any, prompts: list[list[int]], output_len: int, clock: Clock = time.perf_counter
) -> dict[str, float]:
    """ms per decode step of each part, over the decode steps of one run of `prompts` (the steps
    with a prompt chunk are left out); `host` is the step less the model run and the sampler.
    On the lean decoder also each op of GEMMS, OPS and `lm_head`, and `forward_rest`.
    `clock`: wall time, or `time.thread_time` (with one torch thread every part runs on this one,
    and its CPU time is what a loaded machine does not inflate)."""
    from orcaserve.scheduler.sampling_params import SamplingParams

    runner, sampler, post = engine.runner, engine.sampler, engine.postprocessor
    decoder = runner.decoder
    names = PARTS + ((*GEMMS, *OPS, "forward") if decoder is not None else ())
    totals = dict.fromkeys(names, 0.0)
    saved = (runner.execute, sampler.sample, post.step)
    runner.execute = _timed(totals, "model", runner.execute, clock)
    sampler.sample = _timed(totals, "sampler", sampler.sample, clock)
    post.step = _timed(totals, "postprocess", post.step, clock)
    undo = _wrap_decoder(decoder, runner.backend, totals, clock) if decoder is not None else None
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", p, params)
        engine.step()  # the prompts (one chunk each at these lengths)
        for k in totals:
            totals[k] = 0.0
        steps, start = 0, clock()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        wall = clock() - start
    finally:
        runner.execute, sampler.sample, post.step = saved
        if undo is not None:
            undo()
    ms = {k: 1e3 * v / steps for k, v in totals.items()}
    ms["step"] = 1e3 * wall / steps
    ms["host"] = ms["step"] - ms["model"] - ms["sampler"]
    if decoder is not None:
        forward = ms.pop("forward")
        ms["forward_rest"] = forward - sum(ms[k] for k in (*GEMMS, *OPS, "lm_head"))
        ms["inputs"] = ms["model"] - forward  # the step's input tensors and attention plan
    ms["steps"] = steps
    return ms
