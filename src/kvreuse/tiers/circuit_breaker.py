"""A circuit breaker: stop calling a store that keeps failing, probe it again after a cool-down.

States (``BreakerState``)::

    CLOSED --(failure_threshold consecutive failures)--> OPEN
    OPEN   --(cooldown_s elapsed; the next allow() is the probe)--> HALF_OPEN
    HALF_OPEN --(probe succeeds)--> CLOSED      HALF_OPEN --(probe fails)--> OPEN (cool-down restarts)

While OPEN, and while a HALF_OPEN probe is in flight, ``allow()`` is False and the caller
skips the store (a miss, a recompute). Every call that ``allow()`` let through must report
``record_success()`` or ``record_failure()``. Thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are skipped until the cool-down ends
    HALF_OPEN = "half_open"  # one probe call is in flight


class CircuitBreaker:
    """Counts consecutive failures; see the module docstring for the state machine."""

    def __init__(
        self, failure_threshold: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0  # consecutive, since the last success
        self._opened_at = 0.0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether to call the store now. In OPEN after the cool-down, True once (the probe)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> bool:
        """The call worked. True when this closed the breaker (the store is back)."""
        with self._lock:
            closed_now = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._failures = 0
            return closed_now

    def record_failure(self) -> bool:
        """The call failed. True when this opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self.failure_threshold
            ):
                opened_now = self._state is BreakerState.CLOSED
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                return opened_now
            return False
