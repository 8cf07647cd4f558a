"""The circuit breaker's state machine, with an injected clock."""

import pytest

from kvreuse.tiers.circuit_breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_opens_after_threshold_and_probes_after_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    assert breaker.allow() and not breaker.record_failure()
    assert breaker.allow() and not breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow() and breaker.record_failure()  # the third one opens it
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 9.9
    assert not breaker.allow()
    clock.now = 10.0
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one probe at a time
    assert not breaker.record_failure()  # the probe failed: open again, not "newly opened"
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 20.0
    assert breaker.allow() and breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()


def test_a_success_resets_the_count():
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1, clock=Clock())
    breaker.record_failure()
    assert not breaker.record_success()  # already closed
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_invalid_settings():
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=-1)
