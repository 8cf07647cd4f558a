"""The tenant limiter as a pure policy under a test clock: in-flight slots, the token bucket
(reserve at admission, refund or debt at close, refill), the refusals and their headers."""

from __future__ import annotations

import pytest

from kvreuse.api.limiter import LimitExceeded, TenantLimiter, TokenBucket
from kvreuse.api.tenant_limits import Limits, TenantLimits


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _refusal(call) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as info:
        call()
    return info.value


def test_in_flight_slots_are_per_tenant_and_freed_once():
    limiter = TenantLimiter(TenantLimits(default=Limits(max_in_flight=2)), Clock())
    first, second = limiter.open("acme"), limiter.open("acme")
    refused = _refusal(lambda: limiter.open("acme"))
    assert (refused.reason, refused.type, refused.code, refused.param, refused.tenant) == (
        "max_in_flight",
        "requests",
        "rate_limit_exceeded",
        None,
        "acme",
    )
    assert refused.message == (
        "Too many requests in flight for tenant acme: 2 running, its max_in_flight limit is 2; retry when one finishes"
    )
    assert refused.headers() == {"retry-after": "1", "retry-after-ms": "1000"}
    other = limiter.open("globex")  # acme at its limit costs globex nothing
    admins = [limiter.open(None) for _ in range(50)]  # admin keys: unlimited unless [admin] says so
    assert (limiter.in_flight("acme"), limiter.in_flight("globex"), limiter.in_flight(None)) == (2, 1, 50)
    first.close()
    first.close()  # idempotent: frees one slot, not two
    assert limiter.in_flight("acme") == 1
    third = limiter.open("acme")
    assert _refusal(lambda: limiter.open("acme")).reason == "max_in_flight"
    for lease in (second, third, other, *admins):
        lease.close()
    assert [limiter.in_flight(t) for t in ("acme", "globex", None)] == [0, 0, 0]
    assert limiter.refusals == {("acme", "max_in_flight"): 2}
    assert limiter.tenants() == ["acme", "globex", None]


def test_admin_limits_apply_to_the_admin_keys_together():
    limiter = TenantLimiter(TenantLimits(admin=Limits(max_in_flight=1)), Clock())
    lease = limiter.open(None)
    refused = _refusal(lambda: limiter.open(None))
    assert refused.message.startswith("Too many requests in flight for the admin keys: 1 running")
    assert limiter.refusals == {("(admin)", "max_in_flight"): 1}
    lease.close()
    limiter.open("acme").close()  # tenants get [default], which is unlimited here


def test_tokens_are_reserved_at_admission_and_settled_to_the_usage_at_close():
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(default=Limits(tokens_per_minute=600)), clock)  # 10 tokens/s
    assert limiter.tokens_available("acme") == 600.0  # a bucket starts full
    a = limiter.open("acme")
    a.reserve(20, 100)
    assert (a.reserved, limiter.tokens_available("acme")) == (120, 480.0)
    b = limiter.open("acme")
    refused = _refusal(lambda: b.reserve(100, 400))  # 500 > 480: 20 tokens short = 2 s of refill
    assert (refused.reason, refused.type, refused.retry_after_s) == ("tokens_per_minute", "tokens", 2.0)
    assert refused.message == (
        "Rate limit reached for tenant acme on tokens per minute: limit 600, available 480, "
        "requested 500 (prompt 100 + up to 400 completion tokens); retry in 2.0s"
    )
    assert refused.headers() == {"retry-after": "2", "retry-after-ms": "2000"}
    assert limiter.tokens_available("globex") == 600.0  # another tenant's bucket is its own
    clock.t += 1.5  # +15 tokens
    a.record(70)  # it stopped early: 50 of its 120 come back
    a.close()
    assert (limiter.tokens_available("acme"), limiter.tokens_charged("acme")) == (545.0, 70)
    b.reserve(100, 400)  # the same request fits now
    assert limiter.tokens_available("acme") == 45.0
    b.close()  # usage never recorded (the router saw no usage): the reservation is the charge
    assert (limiter.tokens_available("acme"), limiter.tokens_charged("acme")) == (45.0, 570)
    c = limiter.open("acme")
    refused = _refusal(lambda: c.reserve(40, 10))  # 5 short: 0.5 s, rounded up to 1 s for Retry-After
    assert (refused.retry_after_s, refused.headers()) == (0.5, {"retry-after": "1", "retry-after-ms": "500"})
    c.close()  # refused before it reserved: charged nothing
    assert limiter.tokens_charged("acme") == 570
    clock.t += 3600.0
    assert limiter.tokens_available("acme") == 600.0  # refills up to the limit, never past it
    assert limiter.refusals == {("acme", "tokens_per_minute"): 2}


def test_usage_beyond_the_reservation_is_a_debt_the_next_request_waits_for():
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(default=Limits(tokens_per_minute=120)), clock)  # 2 tokens/s
    lease = limiter.open("acme")
    lease.reserve(10, 10)
    lease.record(150)  # e.g. a prompt the estimate undercounted
    lease.close()
    assert limiter.tokens_available("acme") == -30.0
    nxt = limiter.open("acme")
    refused = _refusal(lambda: nxt.reserve(1, 1))
    assert (refused.retry_after_s, refused.message.split("available ")[1][:3]) == (16.0, "-30")
    clock.t += 16.0
    nxt.reserve(1, 1)
    assert limiter.tokens_available("acme") == 0.0


def test_a_request_larger_than_the_limit_is_refused_for_good():
    limiter = TenantLimiter(TenantLimits(tenants={"acme": Limits(tokens_per_minute=100)}), Clock())
    lease = limiter.open("acme")
    refused = _refusal(lambda: lease.reserve(60, 41))
    assert (refused.reason, refused.type, refused.param, refused.retry_after_s) == (
        "request_too_large",
        "tokens",
        "max_tokens",
        None,
    )
    assert refused.message == (
        "Request too large for tenant acme on tokens per minute: limit 100, requested 101 "
        "(prompt 60 + up to 41 completion tokens); lower max_tokens (or n, or the prompt), or "
        "raise its tokens_per_minute"
    )
    assert refused.headers() == {"x-should-retry": "false"}  # the official client does not retry it
    assert limiter.tokens_available("acme") == 100.0
    lease.reserve(60, 40)  # exactly the limit fits
    lease.close()
    assert limiter.refusals == {("acme", "request_too_large"): 1}


def test_a_tenant_without_a_token_limit_reserves_nothing():
    limiter = TenantLimiter(TenantLimits(default=Limits(max_in_flight=1)), Clock())
    lease = limiter.open("acme")
    assert not lease.limits_tokens
    lease.reserve(10**9, 10**9)
    assert (lease.reserved, limiter.tokens_available("acme")) == (0, None)
    lease.close()


def test_token_bucket_refill_and_wait():
    bucket = TokenBucket(60, now=0.0)  # 1 token/s
    bucket.take(60, 0.0)
    assert (bucket.level(10.0), bucket.wait_s(15, 10.0), bucket.wait_s(10, 10.0)) == (10.0, 5.0, 0.0)
    bucket.give(100, 10.0)
    assert bucket.level(10.0) == 60.0
    assert bucket.level(5.0) == 60.0  # a clock that goes back changes nothing
