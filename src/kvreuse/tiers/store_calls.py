"""One call to a shared store (Redis, S3) under its circuit breaker, counted and logged.

``GuardedCalls.run(operation)`` is what the remote and object stores do around every network
call::

    breaker open?  -> skipped (counted), nothing sent
    operation()    -> raised one of ``errors``: counted (``timeouts`` or ``errors``), warned
                      once per streak, the breaker told (``breaker_opened`` when it opens)
                   -> returned: the breaker told (a log line when this closed it)

It never raises for a store failure: the answer is ``(True, result)`` or ``(False, None)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from kvreuse.tiers.circuit_breaker import BreakerState, CircuitBreaker
from kvreuse.tiers.store_counters import FailureStreak, StoreCounters

_T = TypeVar("_T")  # what a store operation returns

# the counters every guarded store keeps (a store may add its own after these)
STORE_COUNTERS = (
    "hits",
    "misses",
    "puts",
    "put_failures",
    "errors",
    "timeouts",
    "skipped",
    "corrupt",
    "foreign",
    "breaker_opened",
)


class GuardedCalls:
    """Runs a store's operations under ``breaker``, counting into ``counters`` (which must
    declare ``STORE_COUNTERS``). ``what`` names the store in log lines ("remote cache");
    ``errors`` are the exceptions that mean the store failed (anything else is a bug and
    propagates), ``timeouts`` the subset counted as ``timeouts``."""

    def __init__(
        self,
        what: str,
        *,
        breaker: CircuitBreaker,
        counters: StoreCounters,
        streak: FailureStreak,
        errors: tuple[type[BaseException], ...],
        timeouts: tuple[type[BaseException], ...],
        logger: logging.Logger,
    ) -> None:
        self.what = what
        self.breaker = breaker
        self._counters = counters
        self._streak = streak
        self._errors = errors
        self._timeouts = timeouts
        self._logger = logger

    def run(
        self, operation: Callable[[], _T], *, before_probe: Callable[[], object] | None = None
    ) -> tuple[bool, _T | None]:
        """(True, what ``operation`` returned), or (False, None) when it was skipped or
        failed. ``before_probe`` runs first, inside the guard, when this call is the
        breaker's probe (HALF_OPEN)."""
        if not self.breaker.allow():
            self._counters.add("skipped")
            return False, None
        probe = self.breaker.state is BreakerState.HALF_OPEN
        try:
            if probe and before_probe is not None:
                before_probe()
            result = operation()
        except self._errors as exc:
            self._counters.add("timeouts" if isinstance(exc, self._timeouts) else "errors")
            self._streak.failed("%s: %s", type(exc).__name__, exc)
            if self.breaker.record_failure():
                self._counters.add("breaker_opened")
                self._logger.warning(
                    "%s: circuit breaker open after %d consecutive failures; skipping the store for %.1f s",
                    self.what,
                    self.breaker.failure_threshold,
                    self.breaker.cooldown_s,
                )
            return False, None
        if self.breaker.record_success():
            self._logger.info("%s: circuit breaker closed, store reachable again", self.what)
        self._streak.succeeded()
        return True, result

    def breaker_open(self) -> int:
        """1 while calls are skipped or a probe is in flight, else 0 (``stats``' ``breaker_open``)."""
        return int(self.breaker.state is not BreakerState.CLOSED)
