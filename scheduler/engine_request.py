"""`EngineRequest`: everything one request asks of the engine, as one typed, frozen object.

The protocol layer builds it (handler/openai/protocol.py, from the body; handler/openai/tenancy.py
adds what the gateway's headers say), `EngineLoop.submit` queues it, `Engine.add_request` checks
and tokenizes it, and the scheduler's `Request` keeps it (`Request.engine_request`). A field is
added here, parsed where the request is parsed, and read where it is used: no signature between
them changes (docs/engine.md, "Where a per-request field goes").

It imports neither the engine nor the handler, so both can import it.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

from orcaserve.scheduler.errors import InvalidRequest
from orcaserve.scheduler.prompt import Prompt
from orcaserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class EngineRequest:
    """One request, as asked; checked at construction (`InvalidRequest` names the field).

    `prompt`: text, a `ChatPrompt` (rendered at admission) or token ids; the engine replaces it by
    its token ids when it admits the request. `params`: how it is sampled (a `SamplingParams`,
    itself checked at construction; the object is frozen, the parameters are the caller's and
    must not change once submitted). The rest is keyword-only:
    - `priority`: smaller runs first under the `priority` policy;
    - `timeout`: seconds from submission to the final output (`EngineLoop` enforces it; the
      offline `Engine` does not);
    - `tenant`: whom the request is served for (the `fair` policy's share, per-tenant metrics);
      None is one tenant;
    - `cache_salt`: requests share cached prefix blocks only with requests of the same salt (None
      is a salt of its own); the server derives it (handler/openai/tenancy.py), never a client alone;
    - `slo_class`: a class of the engine's `slo_classes`, whose latency targets the scheduler keeps;
      None: no target; a class the engine does not know is refused when it is added;
    - `lora`: the LoRA adapter it is served under, a name of the engine's `lora_adapters`
      (docs/lora.md); None: the base model; a name the engine does not serve is refused when it
      is added (`UnknownModel`);
    - `arrival_time`: when it arrived (`time.time()`); None: when the engine adds it.
    """

    request_id: str
    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    _: KW_ONLY
    priority: int = 0
    timeout: float | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    slo_class: str | None = None
    lora: str | None = None
    arrival_time: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise InvalidRequest(f"request id must be a string, got {type(self.request_id).__name__}")
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(self.params).__name__}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidRequest(f"priority must be an integer, got {self.priority!r}", param="priority")
        if self.timeout is not None and not (_is_number(self.timeout) and self.timeout >= 0):
            raise InvalidRequest(f"timeout must be a number of seconds, got {self.timeout!r}", param="timeout")
        for name in ("cache_salt", "tenant", "slo_class", "lora"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}", param=name)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
