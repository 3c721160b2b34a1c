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

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from orcaserve.scheduler.errors import UnknownModel
from orcaserve.scheduler.lora.adapter import AdapterError, LoraAdapter, load_adapter
from orcaserve.scheduler.lora.config import check_adapter_name
from orcaserve.scheduler.lora.resident import LoraSet


@dataclass(frozen=True)
class LoraStats:
    """The adapters' numbers at one moment, for metrics (`Engine.snapshot`): per adapter the
    requests that named it and the tokens computed under it (prompt and generated, recomputation
    included), the adapters on the host and stacked, and the loads, unloads, slot swaps and
    evictions so far, the adapters evicted from host memory and those read back from disk."""

    requests: tuple[tuple[str, int], ...]
    tokens: tuple[tuple[str, int], ...]
    loaded: int
    stacked: int
    loads: int
    unloads: int
    swaps: int
    evictions: int
    host_evictions: int = 0
    rereads: int = 0


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
        # Past `max_cpu_loras` the least recently named adapter no request in flight uses leaves host
        # memory and is read back from disk, beside the step loop, when a request names it again
        # (docs/lora.md "More adapters than host memory holds"). `host`: the adapters in host memory,
        # least recently named first; `origin`: each served adapter's directory and digest (what it
        # computes: a read that finds other weights is refused).
        held = loras.adapters.values() if loras is not None else ()
        self.host: OrderedDict[str, None] = OrderedDict((a.name, None) for a in held)
        self.origin: dict[str, tuple[str, str]] = {a.name: (a.path, a.digest()) for a in held}
        self._reads: dict[str, tuple[tuple[str, str], Future[LoraAdapter]]] = {}  # name -> (its origin, the read)
        self._reader: ThreadPoolExecutor | None = None
        self.num_host_evictions = 0
        self.num_rereads = 0
        for name in list(self.host)[max_cpu_loras:]:  # given at start past max_cpu_loras: read, checked, left on disk
            self._evict(name)
        self.num_host_evictions = 0

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
        return load_adapter(name, path, self.loras.base, self.max_rank, self.loras.dtype, self.loras.device)

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
        if not self._make_room():
            raise AdapterError(
                f"max_cpu_loras={self.max_cpu_loras} adapters are in host memory, each used by a request in flight: "
                "retry later"
            )
        loras.add(adapter)
        self.host[adapter.name] = None
        self.origin[adapter.name] = (adapter.path, adapter.digest())
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
            if name in self.host:
                self.loras.remove(name)
                del self.host[name]
            del self.origin[name]
            self.draining.discard(name)

    # ---- adapters past max_cpu_loras: out of host memory, read back on demand --------------------
    def named(self, name: str) -> None:
        """A request naming `name` was queued (engine thread): counted, the adapter marked recently
        used, and read back from disk, beside the step loop, if it is not in host memory."""
        self.requests[name] += 1
        if name in self.host:
            self.host.move_to_end(name)
        elif name in self.origin and name not in self._reads:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
            origin = self.origin[name]
            self._reads[name] = (origin, self._reader.submit(self._read_back, name, *origin))

    def _read_back(self, name: str, path: str, digest: str) -> LoraAdapter:
        """On the reader thread: the adapter read again, refused if it is not the one first read."""
        adapter = self.read(name, path)
        if adapter.digest() != digest:
            raise AdapterError(
                f"LoRA adapter {name!r} ({path}): its files changed since it was loaded: unload it and load it again"
            )
        return adapter

    def tick(self) -> list[tuple[str, Exception]]:
        """Between two steps (engine thread): unloaded adapters dropped (`reap`), adapters read back
        put in host memory (room made by eviction; while every adapter there is in use, the read
        waits). Returns the adapters whose read failed, with why: the engine fails their waiting
        requests (a later request naming one reads it again)."""
        self.reap()
        failed: list[tuple[str, Exception]] = []
        for name, (origin, future) in list(self._reads.items()):
            if not future.done():
                continue
            if self.origin.get(name) != origin:  # unloaded meanwhile (and maybe loaded again from elsewhere)
                del self._reads[name]
                continue
            error = future.exception()
            if error is not None:
                del self._reads[name]
                if not isinstance(error, Exception):
                    raise error  # an interrupt, not the adapter's fault
                failed.append((name, error))
            elif self._make_room():
                del self._reads[name]
                assert self.loras is not None
                self.loras.add(future.result())
                self.host[name] = None
                self.num_rereads += 1
        return failed

    def _make_room(self) -> bool:
        """Room in host memory for one more adapter, evicting the least recently named ones that no
        request in flight uses; False if there is none to evict."""
        assert self.loras is not None
        if len(self.host) < self.max_cpu_loras:
            return True
        busy = {r.lora for r in self.in_flight()}
        victim = next((name for name in self.host if name not in busy), None)
        if victim is None:
            return False
        self._evict(victim)
        return len(self.host) < self.max_cpu_loras or self._make_room()

    def _evict(self, name: str) -> None:
        assert self.loras is not None
        self.loras.remove(name)
        del self.host[name]
        self.num_host_evictions += 1

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
            host_evictions=self.num_host_evictions,
            rereads=self.num_rereads,
        )
