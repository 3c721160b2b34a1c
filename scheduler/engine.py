"""The engine: step = schedule -> run the model -> sample -> postprocess (core/postprocess.py)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orcaserve.kernels import get_backend
from orcaserve.scheduler import engine_build, offline
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.choices import Choices
from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.core.postprocess import Postprocessor
from orcaserve.scheduler.core.prompt_job_step import advance_prompt_job
from orcaserve.scheduler.core.prompt_jobs import PromptJobs
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.scheduler import Scheduler, SchedulerOutput
from orcaserve.scheduler.core.slo_class import SloClass, check_slo_classes
from orcaserve.scheduler.core.stats import EngineStats, StepTrace
from orcaserve.scheduler.core.stats_snapshot import StatsSnapshot
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.intake import RequestIntake
from orcaserve.scheduler.launch import BatchModel, Failures, Launched, needs_host, run_batch
from orcaserve.scheduler.lora.config import lora_limits
from orcaserve.scheduler.lora.load import load_lora_set
from orcaserve.scheduler.lora.runtime import LoraRegistry
from orcaserve.scheduler.model.build import allocate_kv_caches
from orcaserve.scheduler.model.grammar import Grammars
from orcaserve.scheduler.model.loader import eos_token_ids
from orcaserve.scheduler.model.model_runner import CausalLM, ModelRunner
from orcaserve.scheduler.model.sampler import Sampler
from orcaserve.scheduler.prompt import Prompt
from orcaserve.scheduler.sampling_params import SamplingParams
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.decoding import SpecDecoding
from orcaserve.scheduler.spec.target import Target

TRACE_STEPS = 100_000


class Engine:
    """Iteration-level LLM engine. Not thread-safe: one thread owns it (see `EngineLoop`)."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        runner_factory: Callable[..., ModelRunner] = ModelRunner,  # a split model's: parallel/launch.py
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        # LoRA adapters, read and checked before the lean decoder takes the projections over (docs/lora.md).
        loras = load_lora_set(model, config)
        self.kv_caches = allocate_kv_caches(model, config, num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        shares = TenantShares(config.tenant_weights, config.prompt_token_weight, config.output_token_weight)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            shares,
            prefill_cap=config.fair_prefill_cap,
            lora_slots=None if loras is None else loras.slots,  # a request runs once its adapter is stacked
        )
        self.runner = runner_factory(
            model,
            self.kv_caches,
            config.block_size,
            get_backend(config.resolved_backend()),
            self.device,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            cuda_graphs=config.resolved_cuda_graphs(),
        )
        self.runner.loras = loras  # each step's rows grouped by adapter (lora/resident.py)
        self.runner.warm_up(config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler()
        self.grammars = Grammars(tokenizer, self.vocab_size)  # structured outputs, compiled once each
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.choices = Choices()  # requests with n > 1
        self.prompt_jobs = PromptJobs()  # requests held while their prompt's log-probabilities compute
        self.stats = EngineStats(num_blocks=num_blocks)
        # Each request's outputs: tokens appended and detokenized, stops and limits checked.
        self.postprocessor = Postprocessor(self.scheduler, self.choices, self.stats, max_model_len)
        # The adapters served by name, loaded and unloaded while serving too (lora/runtime.py); an
        # unloaded one is dropped once no request in flight names it.
        max_cpu_loras = lora_limits(config.lora_adapters, config.max_loras, config.max_cpu_loras)[1]
        self.loras = LoraRegistry(loras, max_cpu_loras, config.max_lora_rank, self._in_flight)
        # Requests in (checked, tokenized, queued) and out (aborts): intake.py.
        self.intake = RequestIntake(
            config=config,
            tokenizer=tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=self.eos_token_ids,
            scheduler=self.scheduler,
            runner=self.runner,
            grammars=self.grammars,
            choices=self.choices,
            prompt_jobs=self.prompt_jobs,
            postprocessor=self.postprocessor,
            stats=self.stats,
            on_freed=self._record_occupancy,
            lora_names=self.loras.keys,
        )
        self.slo_classes = config.slo_classes  # docs/latency-targets.md
        # The last TRACE_STEPS steps: a serving worker with tracing on must not grow without bound.
        self.trace: deque[StepTrace] | None = deque(maxlen=TRACE_STEPS) if config.trace else None
        self.async_scheduling = config.resolved_async_scheduling()
        self._inflight: Launched | None = None  # the step on the device, not yet post-processed
        # Test hook: called with each step's batch before the model runs; raising fails that step.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        spec = SpeculativeConfig.parse(config.speculative)  # docs/speculative-decoding.md
        target = Target(config, tokenizer, self.vocab_size, max_model_len, num_blocks)
        self.spec = SpecDecoding(spec, target) if spec else None  # a draft model loads here

    @classmethod
    def from_pretrained(cls, path: str, **engine_args) -> Engine:
        """Load `path` (HF directory, .gguf file, or hub id in the local Hugging Face cache) and
        build an engine for it (engine_build.py)."""
        return engine_build.from_pretrained(cls, path, **engine_args)

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer, config: EngineConfig | None = None, **engine_args) -> Engine:
        """Build an engine around a loaded transformers model (moved to the config's device and
        dtype), sizing the KV cache from `kv_cache_memory`. The engine takes over the model: its
        attention is routed through the paged cache from now on."""
        return engine_build.from_model(cls, model, tokenizer, config or EngineConfig(**engine_args))

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters served (`lora_adapters`, then those loaded since): a request's `lora` names one."""
        return list(self.loras.keys)

    @property
    def slo_classes(self) -> dict[str, SloClass]:
        return self.intake.slo_classes

    @slo_classes.setter
    def slo_classes(self, classes: Mapping[str, Any] | None) -> None:
        """The latency classes, as `slo_classes` in the config or already checked; the step-cost
        model is fitted only while there are some, since nothing else reads it
        (docs/host-overlap.md "Cheaper host work per request")."""
        checked = classes is not None and all(isinstance(c, SloClass) for c in classes.values())
        self.intake.slo_classes = dict(classes) if checked and classes is not None else check_slo_classes(classes)
        self.scheduler.step_costs = bool(self.intake.slo_classes)

    # ---- requests in and out (intake.py) -------------------------------------------------------
    def add_request(
        self,
        request: EngineRequest | str,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        **fields: Any,
    ) -> None:
        """Queue `request`: checked, tokenized on this thread, queued (`RequestIntake.add`; an
        InvalidRequest names the parameter). The offline form `add_request(request_id, prompt,
        params, priority=..., tenant=...)` builds the `EngineRequest` (any of its fields by keyword)."""
        if not isinstance(request, EngineRequest):
            if prompt is None:
                raise TypeError("add_request needs a prompt with a request id")
            request = EngineRequest(request, prompt, params if params is not None else SamplingParams(), **fields)
        elif prompt is not None or params is not None or fields:
            raise TypeError("add_request takes an EngineRequest alone, or a request id, a prompt and fields")
        self.intake.add(request)
        if request.lora is not None:
            self.loras.named(request.lora)  # per-adapter metrics; read back from disk if evicted

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        return self.intake.abort(request_id, reason)  # its final output (`RequestIntake.abort`)

    def abort_all(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        return self.intake.abort_all(request_id, reason)  # every unfinished choice's final output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.prompt_jobs) > 0 or self._inflight is not None

    def snapshot(self) -> StatsSnapshot:
        """The numbers metrics read, as of now (core/stats_snapshot.py); on the thread that owns the engine."""
        spec = None if self.spec is None else self.spec.stats
        return StatsSnapshot.of(self.stats, self.scheduler.shares, self.scheduler.cost, spec, self.loras.stats())

    def _in_flight(self) -> tuple[Request, ...]:
        return (*self.scheduler.requests.values(), *self.prompt_jobs.requests(), *self.choices.requests())

    def _record_occupancy(self) -> None:
        self.stats.record_occupancy(self.scheduler, self.kv, held=self.prompt_jobs.num_requests)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that produced a token (one that
        asked for `RequestOutputKind.FINAL_ONLY`: its final output alone).

        With `async_scheduling` the step launches its batch and then post-processes the previous
        one, whose ids the device sampled meanwhile: outputs come a step later, and are exactly
        the synchronous engine's (docs/host-overlap.md). A request whose model run or sampling
        fails gets a final output with `finish_reason="error"` and `error` set, and gives its
        blocks back; the batch is re-run without it (`launch.run_batch`), so its batch-mates go on. A
        failure while post-processing one request fails that request alone. Before the batch,
        one chunk of the oldest prompt log-probabilities job (core/prompt_job_step.py).
        """
        started = time.time()
        unreadable = dict(self.loras.tick())  # adapters unloaded, and read back from disk (lora/runtime.py)
        outputs = self._collect() if self.prompt_jobs else []  # a prompt job runs on the host
        if unreadable:  # an adapter that could not be read back: its waiting requests fail
            waiting = [r for r in self.scheduler.requests.values() if r.status == RequestStatus.WAITING]
            outputs += [self._fail(r, e) for r in waiting if (e := unreadable.get(r.lora or ""))]
        outputs += advance_prompt_job(self.prompt_jobs, self.scheduler, self.choices, self._fail)
        sched = self.scheduler.schedule()
        outputs += [self.postprocessor.finish(req, []) for req in self.scheduler.take_rejected()]
        if self._inflight is not None and (sched.is_empty or needs_host(sched.sampling)):
            outputs += self._collect()  # the previous step's ids first (docs/host-overlap.md "Synchronous rows")
            alive = sched.subset([r for r, req in sched.requests.items() if req.status == RequestStatus.RUNNING])
            alive.preempted, sched = sched.preempted, alive
        if sched.is_empty:
            if self.prompt_jobs or outputs:
                self._record_occupancy()
            return outputs
        if self.spec is not None:
            self.spec.propose(sched, self.scheduler.budget_left, self.kv)
        launched, failed = self._launch(sched)
        if self.spec is not None and launched is not None:
            self.spec.accept(sched, launched)  # before the scheduler advances: only accepted K/V counts
        outputs += [self._fail(req, error) for req, error in failed]
        outputs += self._collect()  # the previous step's, while this one runs on the device
        self.scheduler.update_after_step(sched)  # before the placeholders: it counts sampled tokens
        if launched is not None and self.async_scheduling:  # (the synchronous engine appends at once)
            launched.add_placeholders(self.max_model_len)
        self._inflight = launched
        if not self.async_scheduling:
            outputs += self._collect()
        for req in self.choices.release():  # further choices, once the first holds the prompt
            self.scheduler.add_request(req, front=True)
        now = time.time()
        self.scheduler.record_step_time(sched, now - started)  # the step-cost model learns
        self.stats.record_step(sched, self.scheduler, self.kv, held=self.prompt_jobs.num_requests)
        if self.trace is not None:
            self.trace.append(StepTrace.of(sched, self.kv, started, now, self.scheduler))
        return outputs if self.spec is None else self.spec.end_step(outputs, sched, now - started)

    def _launch(self, sched: SchedulerOutput) -> tuple[Launched | None, Failures]:
        """Queue the batch on the device (launch.py); `step` then makes each sampling request's
        next token a placeholder, filled on the device in the next step's inputs
        (`StepBuffers.patch`) and on the host by `_collect`."""
        # What `run_batch` uses, read at each step: a benchmark's stub device swaps runner and sampler.
        batch = BatchModel(self.runner, self.kv, self.sampler, self.grammars)
        parts, failed = run_batch(batch, sched, self.fault_hook)
        if not parts:
            return None, failed
        launched = Launched.of(parts, self.runner.to_host)
        self.runner.buffers.prev_tokens = launched.tokens
        return launched, failed

    def _collect(self) -> list[RequestOutput]:
        """Post-process the step in flight, if any: wait for its ids (the step's one host sync)
        and give each request its token. A request finished since it was launched (a stop found
        a step late, an abort, a deadline, a failure) drops its token."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return []
        return self.postprocessor.step(launched.reqs, launched.host_ids(), launched.logprobs, self._fail)

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """Finish `req` as failed (`Postprocessor.fail`) and record the occupancy its freed blocks changed."""
        out = self.postprocessor.fail(req, error)
        self._record_occupancy()
        return out

    # ---- offline use -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; final outputs in the order of the prompts (a prompt with
        `n` choices gives n outputs, by index): offline.py."""
        return offline.generate(self, prompts, params)
