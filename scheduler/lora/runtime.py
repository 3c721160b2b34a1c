"""LoRA adapters added and removed while the engine serves (docs/lora.md "Loading and unloading
while serving").

Reading an adapter (its files, its checks against the base model) touches no engine state:
`read` runs on any thread, beside the step loop, and hands a checked `LoraAdapter` over. The
rest is the engine thread's, between steps: `add` puts the adapter on the host (a slot takes it
when a request needs it: slots.py), `remove` stops new requests naming it at once and drops its
weights once no request in flight uses it (`reap`, each step while one drains). A name loaded
again after an unload gets a new prefix-cache identity: K/V computed under the old weights is
never served under the new ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from orcaserve.scheduler.errors import UnknownModel
from orcaserve.scheduler.lora.adapter import AdapterError, LoraAdapter, load_adapter
from orcaserve.scheduler.lora.config import check_adapter_name
from orcaserve.scheduler.lora.resident import LoraSet


@dataclass(frozen=True)
class LoraStats:
    """The adapters' numbers at one moment, for metrics (`Engine.snapshot`): per adapter the
    requests that named it and the tokens computed under it (prompt and generated, recomputation
    included), the adapters on the host and stacked, and the loads, unloads, slot swaps and
    evictions so far."""

    requests: tuple[tuple[str, int], ...]
    tokens: tuple[tuple[str, int], ...]
    loaded: int
    stacked: int
    loads: int
    unloads: int
    swaps: int
    evictions: int


class LoraRegistry:
    """The adapters served by name, each with the identity its prefix-cache keys carry (`keys`,
    which the intake reads: a request may name an adapter only while it is here), and those
    unloaded but still finishing requests (`draining`)."""

    def __init__(
        self, loras: LoraSet | None, max_cpu_loras: int, max_rank: int, in_flight: Callable[[], Iterable[Any]] = tuple
    ) -> None:
        self.loras = loras
        self.in_flight = in_flight  # the requests in flight (their `lora`): the engine's
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        # name -> prefix-cache identity: the name for an adapter loaded at start (the keys it always
        # had), "name <n>" for the n-th runtime load (a space: no name holds one, so none collides).
        self.keys: dict[str, str] = {name: name for name in (loras.names if loras is not None else ())}
        self.draining: set[str] = set()
        self.num_loads = 0  # adapters loaded while serving
        self.num_unloads = 0
        self.requests: Counter[str] = Counter()  # requests that named each adapter (Engine.add_request)
        self._generation = 0

    @property
    def enabled(self) -> bool:
        return self.loras is not None

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, read and checked against the base model (on any thread: no
        engine state is touched). Raises AdapterError naming what is wrong."""
        if self.loras is None:
            raise AdapterError("this engine serves no LoRA adapters (set enable_lora or lora_adapters)")
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise AdapterError(str(e)) from None
        return load_adapter(name, path, self.loras.base, self.max_rank, self.loras.dtype, torch.device("cpu"))

    def add(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` from now on (engine thread). Raises AdapterError when its name is taken
        or `max_cpu_loras` adapters are on the host already."""
        loras = self.loras
        if loras is None:
            raise AdapterError("this engine serves no LoRA adapters (set enable_lora or lora_adapters)")
        if adapter.name in self.keys:
            raise AdapterError(f"a LoRA adapter named {adapter.name!r} is loaded already: unload it first")
        if adapter.name in self.draining:
            raise AdapterError(f"LoRA adapter {adapter.name!r} is unloading (requests still use it): retry later")
        if len(loras.adapters) >= self.max_cpu_loras:
            raise AdapterError(f"max_cpu_loras={self.max_cpu_loras} adapters are loaded: unload one first")
        loras.add(adapter)
        self._generation += 1
        self.keys[adapter.name] = f"{adapter.name} {self._generation}"
        self.num_loads += 1

    def remove(self, name: str) -> None:
        """Stop serving `name` (engine thread): new requests naming it are refused from now on;
        requests in flight finish under it. Raises UnknownModel for a name not served."""
        if name not in self.keys:
            raise UnknownModel(name, sorted(self.keys))
        del self.keys[name]
        self.draining.add(name)
        self.num_unloads += 1
        self.reap()

    def reap(self) -> None:
        """Drop the weights of each unloaded adapter no request in flight names any more."""
        if not self.draining or self.loras is None:
            return
        busy = {r.lora for r in self.in_flight()}
        for name in [n for n in self.draining if n not in busy]:
            self.loras.remove(name)
            self.draining.discard(name)

    def stats(self) -> LoraStats | None:
        loras = self.loras
        if loras is None:
            return None
        return LoraStats(
            requests=tuple(self.requests.items()),
            tokens=tuple(loras.tokens.items()),
            loaded=len(loras.adapters),
            stacked=sum(name is not None for name in loras.slots.names),
            loads=self.num_loads,
            unloads=self.num_unloads,
            swaps=loras.slots.num_swaps,
            evictions=loras.slots.num_evictions,
        )
