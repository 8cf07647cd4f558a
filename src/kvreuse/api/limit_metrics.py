"""Prometheus view of a ``TenantLimiter`` (``kvreuse.api.limiter``), read at scrape time.

The executor exports ``kvreuse:tenant_*``, the router ``kvreuse:router_tenant_*``:

- ``..._requests_refused_total{tenant,reason}``: 429s, ``reason`` ``max_in_flight``,
  ``tokens_per_minute`` or ``request_too_large``;
- ``..._requests_in_flight{tenant}``: requests holding a slot now;
- ``..._tokens_charged_total{tenant}``: tokens charged to tenants with a tokens-per-minute
  limit, as settled when each request ended.

``tenant`` is the tenant's name, ``(admin)`` for the admin keys. Tenant names and their
usage are inside the tenant seal: a scraper without the admin key sees ``TenantsHidden`` (every
series summed over tenants, ``tenant="(all)"``), unless the server was started with
``--metrics-tenant-labels`` (``kvreuse.api.tenants.sees_tenants``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvreuse.api.limiter import TenantLimiter, tenant_label


class LimiterCollector(Collector):
    def __init__(self, limiter: TenantLimiter, prefix: str) -> None:
        self.limiter, self.prefix = limiter, prefix  # prefix: "kvreuse:" or "kvreuse:router_"

    def collect(self) -> Iterator[Metric]:
        limiter, p = self.limiter, self.prefix
        refused = CounterMetricFamily(
            f"{p}tenant_requests_refused", "Requests refused (429) by a tenant limit.", labels=["tenant", "reason"]
        )
        for (tenant, reason), n in sorted(limiter.refusals.items()):
            refused.add_metric([tenant, reason], n)
        yield refused
        in_flight = GaugeMetricFamily(
            f"{p}tenant_requests_in_flight", "Requests holding a tenant's in-flight slot.", labels=["tenant"]
        )
        charged = CounterMetricFamily(
            f"{p}tenant_tokens_charged",
            "Tokens charged to a tenant's tokens per minute (settled at each request's end).",
            labels=["tenant"],
        )
        for name in limiter.tenants():  # None: the admin key
            in_flight.add_metric([tenant_label(name)], limiter.in_flight(name))
            if limiter.limits.of(name).tokens_per_minute is not None:
                charged.add_metric([tenant_label(name)], limiter.tokens_charged(name))
        yield in_flight
        yield charged


ALL_TENANTS = "(all)"  # the tenant label of a sum over tenants


class TenantsHidden:
    """``registry`` as a scraper without the admin key sees it: the samples of every family
    with a ``tenant`` label are summed over tenants (per remaining labels) and labelled
    ``tenant="(all)"``; other families unchanged. Pass it to ``generate_latest``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not any("tenant" in sample.labels for sample in family.samples):
                yield family
                continue
            sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                if sample.name.endswith("_created"):  # a timestamp, not a count: no sum of it means anything
                    continue
                labels = {**sample.labels, "tenant": ALL_TENANTS} if "tenant" in sample.labels else sample.labels
                key = (sample.name, tuple(sorted(labels.items())))
                sums[key] = sums.get(key, 0.0) + sample.value
            hidden = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, pairs), value in sums.items():
                hidden.add_sample(name, dict(pairs), value)
            yield hidden
