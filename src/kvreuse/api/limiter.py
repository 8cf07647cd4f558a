"""Per-tenant admission: requests in flight and tokens per minute, for the executor and the
router alike. Pure policy: no IO, no threads, and the clock is injected (``clock()``
returns seconds, ``time.monotonic`` by default), so every value is exact under a test clock.

A request's life, as the HTTP layer drives it (``kvreuse.api.middleware.TenantLimitMiddleware``
and the routes)::

    lease = limiter.open(tenant)         # takes an in-flight slot, or LimitExceeded("max_in_flight")
    lease.reserve(prompt, completion)    # takes prompt + max_tokens from the tenant's bucket,
                                         #   or LimitExceeded("tokens_per_minute" / "request_too_large")
    lease.record(used)                   # as usage becomes known (prompt + completion tokens so far)
    lease.close()                        # frees the slot; the bucket is charged `used` instead of
                                         #   the reservation (refund, or debt when used > reserved)

Tokens per minute is a token bucket per tenant: it holds at most ``tokens_per_minute``
tokens, starts full and refills continuously at ``tokens_per_minute / 60`` per second. A
request is admitted when the bucket holds its whole reservation (its prompt tokens plus
every choice's ``max_tokens``: what it may use at most), which is taken at once; at close
the bucket gets back what the request did not use, or gives up what it used beyond the
reservation (the level may go below zero: the next request waits for that debt too). A
reservation larger than the bucket could ever hold is refused for good
(``request_too_large``). A lease whose usage was never recorded is charged its reservation.

Each tenant (and the admin keys together, ``tenant`` ``None``) has its own slots and bucket:
a tenant at its limit is refused at once and never delays another one. Nothing is queued.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.api.tenant_limits import Limits, TenantLimits

ADMIN_LABEL = "(admin)"  # the admin keys' name in messages and metrics (no tenant can be named so)
IN_FLIGHT_RETRY_S = 1.0  # Retry-After for a full in-flight limit: when a slot frees is not known


def tenant_label(tenant: str | None) -> str:
    return ADMIN_LABEL if tenant is None else tenant


class LimitExceeded(Exception):
    """A refusal, as OpenAI words a 429: ``type`` ``"requests"`` or ``"tokens"``, ``code``
    ``"rate_limit_exceeded"``. ``reason`` is the limit (``max_in_flight``,
    ``tokens_per_minute``, ``request_too_large``); ``retry_after_s`` is ``None`` when
    retrying cannot help (the request is larger than the limit allows)."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, tenant: str | None, reason: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.message, self.tenant, self.reason, self.retry_after_s = message, tenant, reason, retry_after_s

    @property
    def type(self) -> str:
        return "requests" if self.reason == "max_in_flight" else "tokens"

    @property
    def param(self) -> str | None:
        return "max_tokens" if self.reason == "request_too_large" else None

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` (which the
        official client prefers), or ``x-should-retry: false`` when retrying cannot help."""
        if self.retry_after_s is None:
            return {"x-should-retry": "false"}
        ms = math.ceil(round(self.retry_after_s * 1000, 6))
        return {"retry-after": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}


class TokenBucket:
    """``tokens_per_minute`` tokens at most, refilled at ``tokens_per_minute / 60`` per
    second, full at ``now``. The level may go below zero (a debt)."""

    def __init__(self, tokens_per_minute: int, now: float) -> None:
        self.capacity = tokens_per_minute
        self._level = float(tokens_per_minute)
        self._at = now

    def level(self, now: float) -> float:
        """The tokens held at ``now`` (``now`` never goes back: an earlier one counts as the last)."""
        if now > self._at:
            self._level = min(float(self.capacity), self._level + (now - self._at) * self.capacity / 60.0)
            self._at = now
        return self._level

    def wait_s(self, tokens: int, now: float) -> float:
        """Seconds until the bucket holds ``tokens`` (0 when it does now)."""
        return max(0.0, (tokens - self.level(now)) * 60.0 / self.capacity)

    def take(self, tokens: int, now: float) -> None:
        self._level = self.level(now) - tokens

    def give(self, tokens: int, now: float) -> None:
        """Return unused tokens (never above the capacity)."""
        self._level = min(float(self.capacity), self.level(now) + tokens)


@dataclass
class _TenantState:
    limits: Limits
    bucket: TokenBucket | None  # None: no tokens_per_minute limit
    in_flight: int = 0
    tokens_charged: int = 0  # settled charges of closed leases


class TenantLimiter:
    """The slots and buckets of every tenant under ``limits``. Not thread-safe: one event
    loop drives it (each executor or router process has one)."""

    def __init__(self, limits: TenantLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._states: dict[str | None, _TenantState] = {}
        self.refusals: dict[tuple[str, str], int] = {}  # (tenant label, reason) -> refused requests

    def _state(self, tenant: str | None) -> _TenantState:
        state = self._states.get(tenant)
        if state is None:
            limits = self.limits.of(tenant)
            tpm = limits.tokens_per_minute
            state = _TenantState(limits, None if tpm is None else TokenBucket(tpm, self.clock()))
            self._states[tenant] = state
        return state

    def _refuse(self, tenant: str | None, reason: str, message: str, retry_after_s: float | None) -> LimitExceeded:
        key = (tenant_label(tenant), reason)
        self.refusals[key] = self.refusals.get(key, 0) + 1
        return LimitExceeded(message, tenant=tenant, reason=reason, retry_after_s=retry_after_s)

    def open(self, tenant: str | None) -> Lease:
        """A lease holding one of ``tenant``'s in-flight slots. Raises ``LimitExceeded``
        (``max_in_flight``) when all are taken."""
        state = self._state(tenant)
        cap = state.limits.max_in_flight
        if cap is not None and state.in_flight >= cap:
            raise self._refuse(
                tenant,
                "max_in_flight",
                f"Too many requests in flight for {_who(tenant)}: {state.in_flight} running, its "
                f"max_in_flight limit is {cap}; retry when one finishes",
                IN_FLIGHT_RETRY_S,
            )
        state.in_flight += 1
        return Lease(self, tenant, state)

    def in_flight(self, tenant: str | None) -> int:
        state = self._states.get(tenant)
        return 0 if state is None else state.in_flight

    def tokens_available(self, tenant: str | None) -> float | None:
        """What ``tenant``'s bucket holds now (``None``: no tokens_per_minute limit)."""
        bucket = self._state(tenant).bucket
        return None if bucket is None else bucket.level(self.clock())

    def tokens_charged(self, tenant: str | None) -> int:
        state = self._states.get(tenant)
        return 0 if state is None else state.tokens_charged

    def tenants(self) -> list[str | None]:
        """Tenants seen so far (the admin keys as ``None``), in first-seen order."""
        return list(self._states)


class Lease:
    """One request's in-flight slot and token reservation. ``close`` is idempotent."""

    def __init__(self, limiter: TenantLimiter, tenant: str | None, state: _TenantState) -> None:
        self._limiter, self.tenant, self._state = limiter, tenant, state
        self.reserved = 0
        self.used: int | None = None  # None: not known (charged the reservation)
        self.closed = False

    @property
    def limits_tokens(self) -> bool:
        """Whether the tenant has a tokens_per_minute limit (worth counting tokens for)."""
        return self._state.bucket is not None

    def reserve(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Take ``prompt_tokens + completion_tokens`` (the most the request may use) from
        the tenant's bucket. Raises ``LimitExceeded``: ``request_too_large`` when that is
        more than the limit, ``tokens_per_minute`` when the bucket does not hold it now
        (with the wait until it will). Once per lease; nothing without a limit."""
        bucket = self._state.bucket
        if bucket is None:
            return
        assert self.reserved == 0 and not self.closed, "reserve once, before close"
        cost = prompt_tokens + completion_tokens
        asked = f"requested {cost} (prompt {prompt_tokens} + up to {completion_tokens} completion tokens)"
        who = _who(self.tenant)
        if cost > bucket.capacity:
            raise self._limiter._refuse(
                self.tenant,
                "request_too_large",
                f"Request too large for {who} on tokens per minute: limit {bucket.capacity}, {asked}; lower "
                "max_tokens (or n, or the prompt), or raise its tokens_per_minute",
                None,
            )
        now = self._limiter.clock()
        wait = bucket.wait_s(cost, now)
        if wait > 0:
            raise self._limiter._refuse(
                self.tenant,
                "tokens_per_minute",
                f"Rate limit reached for {who} on tokens per minute: limit {bucket.capacity}, available "
                f"{math.floor(bucket.level(now))}, {asked}; retry in {wait:.1f}s",
                wait,
            )
        bucket.take(cost, now)
        self.reserved = cost

    def record(self, used: int) -> None:
        """The tokens the request has used so far (prompt + completion, as its usage counts them)."""
        self.used = used

    def close(self) -> None:
        """Free the slot; charge ``used`` (the reservation when not recorded) instead of the reservation."""
        if self.closed:
            return
        self.closed = True
        state = self._state
        state.in_flight -= 1
        charged = self.reserved if self.used is None else self.used
        state.tokens_charged += charged
        if state.bucket is not None:
            now = self._limiter.clock()
            if charged < self.reserved:
                state.bucket.give(self.reserved - charged, now)
            elif charged > self.reserved:
                state.bucket.take(charged - self.reserved, now)


def _who(tenant: str | None) -> str:
    return "the admin keys" if tenant is None else f"tenant {tenant}"
