"""The engine's request intake: a request checked and queued (`add`), or stopped (`abort`,
`abort_all`). A component the `Engine` (engine.py) owns: it holds references to the engine's
queues, given at construction, and the state of its own (the latency classes, the detokenizer's
byte table)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.choices import Choices
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.core.postprocess import Postprocessor
from orcaserve.scheduler.core.prompt_jobs import PromptJobs
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.core.slo_class import SloClass
from orcaserve.scheduler.core.stats import EngineStats
from orcaserve.scheduler.detokenizer import FastDecoding, IncrementalDetokenizer, fast_decoding
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import InvalidRequest, UnknownModel
from orcaserve.scheduler.model.grammar import Grammars
from orcaserve.scheduler.model.model_runner import ModelRunner
from orcaserve.scheduler.model.prompt_logprobs import PromptLogprobs
from orcaserve.scheduler.prompt import encode_prompt
from orcaserve.scheduler.sampling_params import SamplingParams


@dataclass(eq=False, repr=False, kw_only=True)
class RequestIntake:
    """`Engine`'s requests in and out of its queues (on the engine thread, as the step): the
    engine's parts it works with, given once; `on_freed` runs after an abort freed blocks (the
    engine records its occupancy)."""

    config: EngineConfig
    tokenizer: Any  # a transformers tokenizer
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    scheduler: Scheduler
    runner: ModelRunner
    grammars: Grammars
    choices: Choices
    prompt_jobs: PromptJobs
    postprocessor: Postprocessor
    stats: EngineStats
    on_freed: Callable[[], None]
    # The LoRA adapters served, each with its prefix-cache identity (docs/lora.md; lora/runtime.py).
    lora_names: Mapping[str, str] = field(default_factory=dict)
    # Its own: the latency classes (checked by the engine: `Engine.slo_classes`), and the
    # detokenizer's byte table, one per engine.
    slo_classes: dict[str, SloClass] = field(default_factory=dict)
    _detok_fast: FastDecoding | None = field(init=False)

    def __post_init__(self) -> None:
        self._detok_fast = fast_decoding(self.tokenizer)

    def add(self, request: EngineRequest) -> None:
        """Queue a request; raises InvalidRequest (a ValueError naming the parameter) for an
        empty, too long or malformed prompt, a biased token outside the vocabulary, a latency
        class the engine does not know (param "slo_class") or a LoRA adapter it does not serve
        (`UnknownModel`, param "lora"). Nothing is queued unless everything
        succeeded. A text or chat prompt is tokenized here, on the caller's thread: `EngineLoop`
        passes token ids, tokenized off the engine thread (`admission.py`)."""
        slo_class, params = request.slo_class, request.params
        if slo_class is not None and slo_class not in self.slo_classes:
            known = ", ".join(sorted(self.slo_classes)) or "none"
            raise InvalidRequest(f"slo_class {slo_class!r} is not a class of this server (known: {known})", "slo_class")
        slo = self.slo_classes.get(slo_class) if slo_class is not None else None
        if request.lora is not None and request.lora not in self.lora_names:
            raise UnknownModel(request.lora, sorted(self.lora_names))
        ids = encode_prompt(self.tokenizer, request.prompt, self.vocab_size, self.max_model_len)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequest(
                f"logit_bias token ids must be below the vocabulary size {self.vocab_size}", param="logit_bias"
            )
        if params.structured_outputs is not None:  # a cache hit when admission compiled it
            self.grammars.compile(params.structured_outputs)  # raises GrammarError (an InvalidRequest)
        # The request as admitted: its token ids, and when it arrived.
        arrival = request.arrival_time or time.time()
        request = dataclasses.replace(request, prompt=ids, arrival_time=arrival)
        request_id = request.request_id

        def make(rid: str, p: SamplingParams) -> Request:
            return Request(dataclasses.replace(request, request_id=rid, params=p), self.eos_token_ids, slo)

        if request_id in self.choices or request_id in self.scheduler.requests or request_id in self.prompt_jobs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if params.n == 1:
            now = reqs = [Request(request, self.eos_token_ids, slo)]
        else:  # the prompt's blocks are shared through the prefix cache (core/choices.py)
            now, reqs = self.choices.split(request_id, params, make, self.config.enable_prefix_caching)
        for req in reqs:
            if req.lora is not None:
                req.lora_key = self.lora_names[req.lora]
            self.postprocessor.add(
                req.request_id, IncrementalDetokenizer(self.tokenizer, params.stop, self._detok_fast)
            )
        if params.prompt_logprobs is not None:  # one forward of the prompt, shared by the choices,
            # a chunk per step (`step`); a chunk of max_num_batched_tokens rows costs about one full
            # step (the forward of as many tokens, plus every row's logits), so no step takes double.
            rows = self.config.max_num_batched_tokens
            job = PromptLogprobs(self.runner, ids, params.prompt_logprobs, rows, lora=request.lora)
            self.prompt_jobs.hold(request_id, job, reqs, now)
            return
        for req in now:
            self.scheduler.add_request(req)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (None if unknown; with
        n > 1 the last choice's, see `abort_all`). `reason` becomes its finish reason ("abort", or
        "timeout" for a deadline)."""
        outs = self.abort_all(request_id, reason)
        return outs[-1] if outs else None

    def abort_all(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """Stop every unfinished choice of a request; their final outputs, by index."""
        group = self.choices.members(request_id)
        single = self.scheduler.requests.get(request_id)
        waiting_job = self.prompt_jobs.drop(request_id)  # its job is dropped with it
        reqs = group if group is not None else [single] if single is not None else waiting_job
        held = {id(r) for r in self.choices.take_held(request_id) + waiting_job}
        outs = []
        for req in reqs:
            if req.status == RequestStatus.FINISHED:
                continue
            if id(req) in held:  # never scheduled: nothing to free
                req.status, req.finish_reason = RequestStatus.FINISHED, reason
            else:
                self.scheduler.finish_request(req, reason)
            self.stats.num_aborted += 1
            outs.append(self.postprocessor.finish(req, []))
        if outs:
            self.on_freed()
        return outs
