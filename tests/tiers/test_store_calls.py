"""GuardedCalls: one store call under the breaker, with an injected clock and plain
operations (the stores' own tests run it against real Redis and S3 servers)."""

import logging

import pytest

from kvreuse.tiers.circuit_breaker import BreakerState, CircuitBreaker
from kvreuse.tiers.store_calls import STORE_COUNTERS, GuardedCalls
from kvreuse.tiers.store_counters import FailureStreak, StoreCounters

logger = logging.getLogger("test_store_calls")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _calls(clock: Clock) -> tuple[GuardedCalls, StoreCounters]:
    counters = StoreCounters(STORE_COUNTERS)
    calls = GuardedCalls(
        "test store",
        breaker=CircuitBreaker(failure_threshold=2, cooldown_s=10, clock=clock),
        counters=counters,
        streak=FailureStreak(logger, "test store"),
        errors=(ConnectionError, TimeoutError),
        timeouts=(TimeoutError,),
        logger=logger,
    )
    return calls, counters


def _raise(exc: BaseException):
    def operation():
        raise exc

    return operation


def test_failures_are_counted_open_the_breaker_and_a_probe_closes_it():
    clock = Clock()
    calls, counters = _calls(clock)
    assert calls.run(lambda: 7) == (True, 7)
    assert calls.run(_raise(TimeoutError("slow"))) == (False, None)
    assert calls.run(_raise(ConnectionError("down"))) == (False, None)  # the second opens it
    assert calls.breaker.state is BreakerState.OPEN and calls.breaker_open() == 1
    ran = []
    assert calls.run(lambda: ran.append(1)) == (False, None)  # skipped: not run
    assert ran == []
    probes = []
    clock.now = 10.0
    assert calls.run(lambda: "back", before_probe=lambda: probes.append(1)) == (True, "back")
    assert probes == [1]
    assert calls.breaker.state is BreakerState.CLOSED and calls.breaker_open() == 0
    assert calls.run(lambda: 1, before_probe=lambda: probes.append(2)) == (True, 1)  # not a probe
    assert probes == [1]
    snapshot = counters.snapshot()
    assert (snapshot["timeouts"], snapshot["errors"], snapshot["skipped"], snapshot["breaker_opened"]) == (1, 1, 1, 1)


def test_a_failing_probe_reopens_and_other_exceptions_propagate():
    clock = Clock()
    calls, counters = _calls(clock)
    calls.run(_raise(ConnectionError()))
    calls.run(_raise(ConnectionError()))
    clock.now = 10.0
    assert calls.run(lambda: 1, before_probe=_raise(ConnectionError("still down"))) == (False, None)
    assert calls.breaker.state is BreakerState.OPEN
    assert counters.snapshot()["errors"] == 3 and counters.snapshot()["breaker_opened"] == 1
    fresh, _ = _calls(Clock())
    with pytest.raises(ValueError):  # a bug, not a store failure
        fresh.run(_raise(ValueError("bug")))
