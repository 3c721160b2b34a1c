"""Per-request sampling parameters, validated at construction: a bad value raises `InvalidRequest`
(a ValueError) naming the field."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from orcaserve.scheduler.errors import InvalidRequest
from orcaserve.scheduler.spec.config import MAX_SPECULATIVE_TOKENS
from orcaserve.scheduler.structured_outputs import StructuredOutputs

# Most alternatives a request may ask for with each token (vLLM's default `max_logprobs`; OpenAI's
# chat allows 20 too).
MAX_LOGPROBS = 20

# Most tokens one request may bias, and the largest bias (OpenAI's range): a bound on the work the
# sampler does for a request on every step, and -100 / 100 already ban / force a token.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0

# Most sequences one request may ask for (`n`): each is a request of its own in the batch.
MAX_N = 16


class RequestOutputKind(enum.Enum):
    """Which outputs a request's consumer reads (vLLM's `RequestOutputKind`, less its
    cumulative kind): DELTA, one after every step that gave it a token (a streaming client);
    FINAL_ONLY, its final output alone (a client answered once it finished): the engine builds no
    output for its other steps, and the final one is the same as DELTA's last."""

    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    `temperature=0` (or below 1e-5) is greedy. `top_k` 0 or -1 and `top_p=1` disable those filters. `seed` gives the
    request its own random generator, so its tokens do not depend on what else runs in the batch.
    `stop` strings end generation and are not included in the text. `logprobs` (0 to
    MAX_LOGPROBS) reports each sampled token's log-probability with that many most likely
    alternatives; None reports nothing. `logit_bias` maps token ids to a value in [-100, 100]
    added to that token's logit before penalties and sampling (not to the reported
    log-probabilities, which stay the model's). `structured_outputs` constrains the output to a
    JSON schema, any JSON object, a regex or a choice of strings (model/grammar.py); a dict is
    taken as StructuredOutputs' arguments.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Sequences sampled from the prompt (1 to MAX_N), each with its own random stream (seed + i).
    n: int = 1
    # The prompt's log-probabilities with this many alternatives each (0 to MAX_LOGPROBS; `echo`).
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    # Which of the request's outputs the engine builds (a string is taken as the kind's value).
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # Speculative decoding (docs/speculative-decoding.md): at most this many proposed tokens per
    # step for this request; 0 turns it off; None: the engine's setting.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, low=1)
        self.temperature = _check_float("temperature", self.temperature, low=0.0)
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k, low=-1, high=1 << 31)  # beyond any vocabulary; int32-safe
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequest(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", param="repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name)))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed >= 1 << 64:  # torch.Generator.manual_seed takes 64 bits
                raise InvalidRequest(f"seed must be < 2**64, got {self.seed}", param="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop must hold non-empty strings, got {s!r}", param="stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, high=1 << 63)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS + 1)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        _check_int("n", self.n, low=1, high=MAX_N + 1)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS + 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", param="ignore_eos")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                kinds = ", ".join(repr(k.value) for k in RequestOutputKind)
                raise InvalidRequest(
                    f"output_kind must be one of {kinds}, got {self.output_kind!r}", param="output_kind"
                ) from None
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, low=0, high=MAX_SPECULATIVE_TOKENS + 1)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidRequest(
                f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r}",
                param="structured_outputs",
            )

    @property
    def greedy(self) -> bool:
        # Temperatures this small only turn logits into overflowing infinities.
        return self.temperature < 1e-5

    @property
    def needs_host(self) -> bool:
        """Whether a row samples from host state its previous token changes: a grammar's mask,
        or penalties over the tokens so far (docs/host-overlap.md "Synchronous rows")."""
        return (
            self.structured_outputs is not None
            or self.repetition_penalty != 1.0
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; an unknown key raises ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise InvalidRequest(f"unknown sampling parameter {key!r}")
        return cls(**values)


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", param=name)
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be >= {low}, got {value}", param=name)
    if high is not None and value >= high:
        raise InvalidRequest(f"{name} must be < {high}, got {value}", param=name)


def _check_logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"logit_bias must map token ids to numbers, got {type(value).__name__}", param="logit_bias"
        )
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(
            f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}", param="logit_bias"
        )
    checked = {}
    for token, bias in value.items():
        _check_int("logit_bias", token, low=0, high=1 << 63)
        bias = _check_float("logit_bias", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for token {token}",
                param="logit_bias",
            )
        checked[token] = bias
    return checked


def _check_float(name: str, value: Any, low: float | None = None) -> float:
    """`value` as a float: integers are accepted (JSON has one number type) but converted, since
    one beyond int64 would overflow the sampler's tensors."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", param=name)
    try:
        number = float(value)
    except OverflowError:
        raise InvalidRequest(
            f"{name} must be finite, got an integer of {int(value).bit_length()} bits", param=name
        ) from None
    if math.isnan(number):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", param=name)
    if math.isinf(number):
        raise InvalidRequest(f"{name} must be finite, got {value!r}", param=name)
    if low is not None and number < low:
        raise InvalidRequest(f"{name} must be >= {low}, got {value}", param=name)
    return number
