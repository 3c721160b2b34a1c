"""A request's scheduling state, owned by the engine thread."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

import torch

from orcaserve.scheduler.core.outputs import RequestTimes
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.prompt import ChatPrompt
from orcaserve.scheduler.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from orcaserve.scheduler.core.slo_class import SloClass
    from orcaserve.scheduler.core.token_logprob import TokenLogprob
    from orcaserve.scheduler.model.grammar import GrammarState

_arrival_counter = itertools.count()
PLACEHOLDER = -1  # a token the device is still sampling (docs/host-overlap.md "Placeholders")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, preempted and waiting to be recomputed, or suspended (KV kept)
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Tokens, progress and KV ownership of one request.

    `num_computed_tokens` counts tokens whose K/V are in the cache. A step schedules some of the
    remaining `num_tokens - num_computed_tokens`; when that catches up with `num_tokens`, the step
    samples a new token. Prefill, chunked prefill, decode and recompute after preemption are all
    this one rule.
    """

    def __init__(
        self, request: EngineRequest, eos_token_ids: frozenset[int] = frozenset(), slo: SloClass | None = None
    ) -> None:
        """`request` as the engine admitted it: its prompt is token ids (`Engine.add_request`
        tokenizes); `slo` its latency class, resolved from `request.slo_class` by the engine."""
        if isinstance(request.prompt, (str, ChatPrompt)):
            raise TypeError("a Request is built from token ids: Engine.add_request tokenizes the prompt")
        # What the request asked for, as one object (docs/engine.md "Where a per-request field
        # goes"); the fields the scheduler reads every step are copied below.
        self.engine_request = request
        request_id, prompt_token_ids, params = request.request_id, request.prompt, request.params
        arrival_time = request.arrival_time if request.arrival_time is not None else time.time()
        self.request_id = request_id
        # A choice of a request with n > 1 (choices.py): its outputs carry the parent's id and its
        # index; a request of its own is its own group, index 0.
        self.group_id = request_id
        self.index = 0
        # The prompt's log-probabilities (params.prompt_logprobs; the engine computes them once).
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # One per output token when the request asked for them (params.logprobs), else None.
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.priority = request.priority
        self.arrival_seq = next(_arrival_counter)  # FCFS tie-break, stable under equal times
        self.times = RequestTimes(arrival=arrival_time)
        # `times` as the outputs of a running request show them, one copy shared by them all
        # (set with the first token; they change again only when it finishes: postprocess.py).
        self.times_shown: RequestTimes | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        # Prefix caching: the salt isolates this request's cached blocks from other salts';
        # block_keys are its full blocks' keys, computed once (kv_cache_manager.py);
        # num_cached_tokens are the prompt tokens its first admission found in the cache.
        self.cache_salt = request.cache_salt
        # Its LoRA adapter (None: the base model): the runner groups its rows by it, and its cache
        # keys carry it, so K/V computed under one adapter serve no other (docs/lora.md).
        self.lora = request.lora
        self.lora_key = request.lora  # the adapter's identity in cache keys (a reloaded name: a new one)
        self.block_keys: list[bytes] = []
        self.num_cached_tokens = 0
        # Fair share (fair_share.py): the tenant served, and how many leading prompt tokens were
        # charged to it already or came from the cache at first admission (never charged again).
        self.tenant = request.tenant
        self.prompt_charged = 0
        # Seat handover (fair, docs/fair-share.md "Seat handover"): waiting with its blocks and computed
        # tokens kept, to resume where it stopped; and the step that last admitted it.
        self.suspended = False
        self.admitted_step = -1
        # Latency targets (core/slo_class.py, slo_budget.py): its class, and whether it was found unable to make
        # its TTFT (served best effort from then on, and counted).
        self.slo = slo
        self.slo_missed = False
        self.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.needs_host = params.needs_host  # read once: the engine asks every step (launch.needs_host)
        # Its consumer reads its final output alone: postprocess builds no other (read once, as above).
        self.final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        # Structured outputs: the matcher the sampler masks this row by (the engine sets it).
        self.grammar: GrammarState | None = None
        self.generator: torch.Generator | None = None
        # A step in flight samples this request's last token (a PLACEHOLDER in all_token_ids), in
        # this row of its ids; `final_in_flight`: that token reaches a length limit, so the
        # request is not scheduled again (docs/host-overlap.md).
        self.pending_row = -1
        self.final_in_flight = False
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)

    def add_placeholder(self, row: int) -> None:
        """A launched step samples this request's next token, in `row` of its ids; the token
        takes the placeholder's place when it comes back (`Postprocessor.step`)."""
        self.all_token_ids.append(PLACEHOLDER)
        self.pending_row = row

    @property
    def targeted(self) -> bool:
        """It has a latency target (docs/latency-targets.md): it goes before untargeted requests."""
        return self.slo is not None and self.slo.targeted

    def sort_key(self, by_priority: bool) -> tuple[int, int]:
        """Smaller runs first; the largest is the first to be preempted."""
        return (self.priority if by_priority else 0, self.arrival_seq)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/{self.num_tokens})"
        )
