"""Where a decode step's time goes at a few rows (`orcaserve-bench latency --breakdown`): the
engine's `step` timed whole and in its parts by wrapping them on one engine (nothing in the engine
changes): the model run (`runner.execute`: step inputs, the forward, the lm_head), of it the
lm_head's GEMM, the sampler (`sampler.sample`: the argmax over the vocabulary at temperature 0),
the post-processing (`postprocessor.step`: tokens appended, detokenized, stops checked), and the
rest (scheduling, the step's bookkeeping). Figures and what was cut: docs/one-stream.md."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PARTS = ("model", "lm_head", "sampler", "postprocess")


Clock = Callable[[], float]


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any], clock: Clock) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            totals[name] += clock() - t

    return wrapper


def breakdown(
    engine: Any, prompts: list[list[int]], output_len: int, clock: Clock = time.perf_counter
) -> dict[str, float]:
    """ms per decode step of each part, over the decode steps of one run of `prompts` (the steps
    with a prompt chunk are left out); `host` is the step less the model run and the sampler.
    `clock`: wall time, or `time.thread_time` (with one torch thread every part runs on this one,
    and its CPU time is what a loaded machine does not inflate)."""
    from orcaserve.scheduler.sampling_params import SamplingParams

    totals = dict.fromkeys(PARTS, 0.0)
    runner, sampler, post = engine.runner, engine.sampler, engine.postprocessor
    saved = (runner.execute, sampler.sample, post.step)
    model = runner.model
    head = getattr(model, "lm_head", None)
    runner.execute = _timed(totals, "model", runner.execute, clock)
    sampler.sample = _timed(totals, "sampler", sampler.sample, clock)
    post.step = _timed(totals, "postprocess", post.step, clock)
    hook = None
    if head is not None:  # the lean decoder calls lm_head's forward, through the module hooks
        starts: list[float] = []
        pre = head.register_forward_pre_hook(lambda *_: starts.append(clock()))
        hook = (
            pre,
            head.register_forward_hook(
                lambda *_: totals.__setitem__("lm_head", totals["lm_head"] + clock() - starts.pop())
            ),
        )
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
        for h in hook or ():
            h.remove()
    ms = {k: 1e3 * v / steps for k, v in totals.items()}
    ms["step"] = 1e3 * wall / steps
    ms["host"] = ms["step"] - ms["model"] - ms["sampler"]
    ms["steps"] = steps
    return ms
