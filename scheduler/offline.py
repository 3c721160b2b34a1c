"""Offline use: run prompts to completion on an engine the caller's thread owns (`Engine.generate`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Protocol

from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.prompt import Prompt
from orcaserve.scheduler.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_ids = itertools.count()  # request ids unique in the process


class Steps(Protocol):
    """What `generate` needs of an engine."""

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> object: ...

    def step(self) -> list[RequestOutput]: ...


def generate(
    engine: Steps,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
) -> list[RequestOutput]:
    """Run all prompts to completion; final outputs in the order of the prompts (a prompt with
    `n` choices gives n outputs, by index)."""
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    # Only the final outputs are read here: the others need not be built.
    params = [p if p.output_kind is FINAL_ONLY else dataclasses.replace(p, output_kind=FINAL_ONLY) for p in params]
    ids = [f"generate-{next(_ids)}" for _ in prompts]
    try:
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p)
    except ValueError:
        for rid in ids:
            engine.abort(rid)
        raise
    final: dict[tuple[str, int], RequestOutput] = {}
    while len(final) < sum(p.n for p in params):
        for out in engine.step():
            if out.finished:
                final[out.request_id, out.index] = out
    return [final[rid, i] for rid, p in zip(ids, params) for i in range(p.n)]
