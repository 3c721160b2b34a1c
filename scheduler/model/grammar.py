"""Structured outputs on xgrammar: grammars compiled once per constraint, a matcher per request.

xgrammar was chosen over llguidance by measurement (docs/structured-outputs.md#structured-outputs-and-tool-calls,
"How"): its token masks cost less per row, and its slower compile runs on the admission thread,
off the engine's.

Threads: `Grammars.compile` runs on the admission thread (and, for a cache hit or offline use,
on the engine thread); a `GrammarState` is the engine thread's alone.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from orcaserve.scheduler.errors import InvalidRequest
from orcaserve.scheduler.structured_outputs import StructuredOutputs

# Compiled grammars kept (least recently used dropped first); one holds its token-mask cache,
# tens of KiB to a few MiB at a 49152-token vocabulary.
CACHE_ENTRIES = 256
_ANY_OBJECT = '{"type": "object"}'


class GrammarError(InvalidRequest):
    """A constraint that cannot be compiled, or output that left its grammar; `param` names the
    request field the constraint came from."""


def _xgr() -> Any:
    import xgrammar  # imported on first use: engines without structured requests never load it

    return xgrammar


def _reason(e: Exception) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e).strip())


def _no_raw_controls(ebnf: str) -> str:
    """xgrammar 0.2.9 lets a string with a length bound (`maxLength`, ...) hold raw control
    characters (its character class excludes only quote, backslash, CR and LF), which JSON forbids
    unescaped; its unbounded strings exclude U+0000-U+001F. Found by the fuzz test in
    tests/engine/test_structured_engine.py; excluded here the way the unbounded strings do."""
    return ebnf.replace(r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")


class Grammars:
    """Compiles `StructuredOutputs` for one tokenizer and vocabulary; a cache shared by the
    admission thread (which compiles) and the engine thread (which finds them compiled)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:  # ~0.2 s for 49152 tokens, once per engine
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar for `spec` (cached); raises GrammarError naming what is wrong."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        compiler = self._get_compiler()
        try:
            if spec.json is not None or spec.json_object:
                # Compact JSON (", " and ": ", no other whitespace): free whitespace lets a small
                # model pad forever; json_object is a schema for any object, not strict.
                grammar = _xgr().Grammar.from_json_schema(
                    spec.json or _ANY_OBJECT, any_whitespace=False, strict_mode=spec.strict and not spec.json_object
                )
                compiled = compiler.compile_grammar(_no_raw_controls(str(grammar)))
            elif spec.regex is not None:
                compiled = compiler.compile_regex(spec.regex)
            else:
                assert spec.choice is not None  # StructuredOutputs sets exactly one
                compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        except Exception as e:  # xgrammar raises RuntimeError for a schema, regex or grammar it refuses
            what = "JSON schema" if spec.json is not None else "regex" if spec.regex is not None else "choice"
            raise GrammarError(f"{spec.param}: invalid or unsupported {what}: {_reason(e)}", spec.param) from None
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: StructuredOutputs | None, stop_token_ids: frozenset[int]) -> GrammarState | None:
        """A new request's matcher for `spec` (None for an unconstrained request)."""
        if spec is None:
            return None
        return GrammarState(self.compile(spec), stop_token_ids, self.vocab_size, spec.param)


class GrammarState:
    """One request's position in its grammar. The request's stop tokens end it once the grammar
    is complete; without any (`ignore_eos` and no `stop_token_ids`) it ends as soon as the
    grammar is. Preemption recomputes K/V but keeps the output tokens, so the state stays right
    without a rollback."""

    def __init__(self, compiled: Any, stop_token_ids: frozenset[int], vocab_size: int, param: str) -> None:
        stops = sorted(t for t in stop_token_ids if t < vocab_size)
        self._matcher = _xgr().GrammarMatcher(
            compiled, override_stop_tokens=stops or None, terminate_without_stop_token=not stops
        )
        self._param = param

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([S, ceil(V / 32)] int32, CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance by the sampled token; raises GrammarError if the grammar does not allow it
        (a row whose mask allowed nothing samples an arbitrary token): that request fails alone."""
        if not self._matcher.accept_token(token):
            raise GrammarError(f"{self._param}: the output left its grammar at token {token}", self._param)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class MaskBuffer:
    """The host bitmask the sampler fills each step ([rows, ceil(V / 32)] int32), allocated once
    and grown as needed: a fresh one a step is an op the engine thread waits for. Rows without a
    grammar keep stale bits; only the rows named are ever applied."""

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None

    def get(self, rows: int, vocab: int) -> torch.Tensor:
        words = (vocab + 31) // 32
        if self._mask is None or self._mask.shape[0] < rows or self._mask.shape[1] != words:
            self._mask = _xgr().allocate_token_bitmask(max(rows, 32), vocab)
        return self._mask[:rows]


def apply_grammars(logits: torch.Tensor, states: Sequence[GrammarState | None], buffer: MaskBuffer) -> None:
    """Set to -inf, in place, the logits of tokens each constrained row's grammar forbids; rows
    whose state is None are not touched. logits: [S, V]; states: one per row.

    On a GPU no step-time sync is added: the masks are filled on the host and go over in one
    pinned non-blocking copy, unpacked there."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    bitmask = buffer.get(len(states), logits.shape[1])  # [S, ceil(V / 32)] int32
    for i in rows:
        states[i].fill(bitmask, i)  # type: ignore[union-attr]  # rows holds the rows with a state
    if logits.device.type == "cpu":
        _xgr().apply_token_bitmask_inplace(logits, bitmask, indices=rows)  # C++, in place
        return
    dev = logits.device
    bits = bitmask[rows].pin_memory().to(dev, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]  # [R, V]
    idx = torch.tensor(rows, dtype=torch.long, pin_memory=True).to(dev, non_blocking=True)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
