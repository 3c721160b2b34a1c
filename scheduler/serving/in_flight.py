"""The engine loop's admission count: sequences in flight, the bound on those that wait, and the
requests refused before they ran (docs/serving.md, "Limits and refusals")."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from orcaserve.scheduler.errors import EngineError, Overloaded, ShuttingDown

log = logging.getLogger(__name__)

# Retry-after hint (seconds) for requests refused because this engine stopped: a supervised
# worker is replaced, or another serves the retry.
RESTART_S = 5


class InFlight:
    """Counts the sequences submitted and not finished (a request with `n` choices is n of them;
    a finished choice leaves at once), refuses what would wait beyond `max_waiting`, and counts
    refusals by the error's `reason` in `refused`, telling `on_refused` of each.

    Submitters (any thread) and the loop thread share it; one lock guards all of it.
    """

    def __init__(self, max_waiting: int | None, on_refused: Callable[[EngineError], None] | None) -> None:
        self.max_waiting = max_waiting
        self.on_refused = on_refused
        self.refused: Counter[str] = Counter()  # requests refused before they ran, by reason
        self.count = 0
        self.closed = False
        self._lock = threading.Lock()

    def admit(self, n: int, seats: int | None) -> None:
        """Count `n` more sequences, or raise `ShuttingDown` (closed, or no engine: `seats` None)
        or `Overloaded` (the waiting queue is full). What will wait is what the engine's `seats`
        cannot take: running or not yet, every sequence in flight holds a seat or a place in the
        queue."""
        with self._lock:
            if self.closed or seats is None:
                raise self._refuse(ShuttingDown("the engine is not running", retry_after=RESTART_S))
            waiting = max(0, self.count - seats)
            if self.max_waiting is not None and self.count + n - seats > self.max_waiting:
                raise self._refuse(
                    Overloaded(
                        f"server overloaded: {waiting} sequences are already waiting "
                        f"(max_waiting_requests={self.max_waiting}); retry later",
                        retry_after=1,
                    )
                )
            self.count += n

    def release(self, seqs: int, refusal: EngineError | None = None) -> None:
        """`seqs` sequences finished; `refusal` ended a request before any output."""
        with self._lock:
            self.count -= seqs
            if refusal is not None:
                self._refuse(refusal)

    def close(self) -> None:
        """No submission is admitted after this."""
        with self._lock:
            self.closed = True

    def _refuse(self, error: EngineError) -> EngineError:
        """Count `error` (the lock held), tell `on_refused`, and return it."""
        self.refused[error.reason] += 1
        if self.on_refused is not None:
            try:
                self.on_refused(error)
            except Exception:
                log.exception("on_refused callback failed")
        return error
