"""Which host-resident LoRA adapters are stacked for the steps: `max_loras` slots, changed by LRU
between steps (docs/lora.md "More adapters than a step holds").

The scheduler admits a request of an adapter only once the adapter holds a slot (`admit`): it
takes a free slot, or the one of the least recently used adapter that no running request uses.
When every slot holds an adapter some running request uses, the request waits. This object is
bookkeeping alone (names, order, counts); the weights follow it when the step runs
(`LoraSet.step`, resident.py), from the copies already in host memory: no adapter is read again.
It is the engine thread's, like the scheduler that calls it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Collection


class LoraWait(enum.Enum):
    """Why a waiting request of an adapter is not admitted in a step (`RunningBatch.waits_for_lora`)."""

    SLOT = "slot"  # every slot holds an adapter a running request uses (or an earlier request waits for one)
    READING = "reading"  # the adapter is being read back from disk (runtime.py)


class LoraSlots:
    """`max_loras` slots; `names[i]` the adapter slot i holds (None: free)."""

    def __init__(self, max_loras: int, host: Collection[str] | None = None) -> None:
        self.names: list[str | None] = [None] * max_loras
        self.host = host  # the adapters in host memory (None: any): only they may take a slot
        self._lru: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.num_swaps = 0  # adapters given a slot (the first time included)
        self.num_evictions = 0  # adapters that lost their slot to another

    def __contains__(self, name: str) -> bool:
        return name in self._lru

    def slot_of(self, name: str) -> int:
        return self._lru[name]

    def can_take(self, name: str, in_use: Callable[[], Collection[str | None]]) -> bool:
        """Whether `admit(name, in_use)` would succeed; changes nothing."""
        return name in self._lru or self._slot_for(name, in_use) is not None

    def admit(self, name: str, in_use: Callable[[], Collection[str | None]]) -> bool:
        """Make `name` stacked for the step being built: True if it is (now), False if every slot
        holds an adapter of `in_use()` (the adapters running requests use: never evicted), or if
        `name` is not in host memory."""
        if name in self._lru:
            self._lru.move_to_end(name)
            return True
        slot = self._slot_for(name, in_use)
        if slot is None:
            return False
        held = self.names[slot]
        if held is not None:
            del self._lru[held]
            self.num_evictions += 1
        self.names[slot] = name
        self._lru[name] = slot
        self.num_swaps += 1
        return True

    def _slot_for(self, name: str, in_use: Callable[[], Collection[str | None]]) -> int | None:
        """The slot `name`, not stacked, would take: a free one, else that of the least recently
        used adapter no running request uses; None if there is none or `name` is not in host memory."""
        if not self.on_host(name):
            return None
        if None in self.names:
            return self.names.index(None)
        busy = in_use()
        victim = next((held for held in self._lru if held not in busy), None)
        return None if victim is None else self._lru[victim]

    def on_host(self, name: str) -> bool:
        """`name` is in host memory (not being read back from disk: runtime.py)."""
        return self.host is None or name in self.host

    def drop(self, name: str) -> None:
        """`name` is unloaded: its slot is free (the caller knows no running request uses it)."""
        slot = self._lru.pop(name, None)
        if slot is not None:
            self.names[slot] = None
