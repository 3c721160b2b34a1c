"""Work handed to the engine loop's thread from another thread, run there between steps (the one
owner of engine state: engine_loop.py), its result or its exception on a future."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopCall:
    """`fn(engine)`, to run on the loop thread; `future` gets what it returns or raises."""

    fn: Callable[[Any], Any]
    future: Future = field(default_factory=Future)

    def run(self, engine: Any) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # the caller gave up waiting
        try:
            self.future.set_result(self.fn(engine))
        except Exception as e:  # the caller's to answer; the loop goes on
            self.future.set_exception(e)
