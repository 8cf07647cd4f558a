"""The router's Prometheus metrics: decisions per executor and policy, retries, overlap,
executors up and index size. Each router has its own registry (several can share a process).

Names share the executors' ``kvreuse:`` prefix with ``router_`` in front:
``kvreuse:router_decisions_total{executor,policy}``, ``kvreuse:router_overlap_blocks_total``
and ``kvreuse:router_prompt_blocks_total`` (their ratio is the routed prefix-hit rate),
``kvreuse:router_retries_total``, ``kvreuse:router_streams_cut_total``,
``kvreuse:router_migrations_total{outcome}``, ``kvreuse:router_executor_up``,
``kvreuse:router_executor_load_blocks``, ``kvreuse:router_executor_in_flight``,
``kvreuse:router_index_keys``; with tenant limits, ``kvreuse:router_tenant_*``
(``kvreuse.api.limit_metrics``, registered by ``build_router_app``).

The gauges are read at scrape time from the executors and the index handed in (the router's
own, never replaced), not from the router itself.

``executor`` is the executor's id (``Executor.id``, its place in ``--executor`` order, as
``/v1/route/executors`` lists it beside its URL): ``/metrics`` is open to scrapers, and
executor addresses are for admin keys only (issue 31's tenant seal). ``executor_urls``
(``kvreuse route --metrics-executor-urls``, for a ``/metrics`` only trusted scrapers reach)
labels them with their URLs instead."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from kvreuse.router.executors import Executor
    from kvreuse.router.index import KVIndex
    from kvreuse.router.policy import Candidate, Decision


class RouterMetrics:
    def __init__(
        self, policy_name: str, executors: Mapping[str, Executor], index: KVIndex, *, executor_urls: bool = False
    ) -> None:
        """``policy_name`` labels the decisions; ``executors`` (by name) and ``index`` are read
        at each scrape; ``executor_urls``: label executors with their URLs, not their ids."""
        self.registry = CollectorRegistry()
        self.executors = executors
        self.executor_urls = executor_urls
        self.decisions = Counter(
            "kvreuse:router_decisions",
            "Routing decisions by executor and policy.",
            ["executor", "policy"],
            registry=self.registry,
        )
        self.overlap_blocks = Counter(
            "kvreuse:router_overlap_blocks", "Prompt blocks the chosen executor held.", registry=self.registry
        )
        self.prompt_blocks = Counter(
            "kvreuse:router_prompt_blocks", "Full prompt blocks of routed requests.", registry=self.registry
        )
        self.retries = Counter(
            "kvreuse:router_retries",
            "Requests retried on another executor before their first byte.",
            registry=self.registry,
        )
        self.streams_cut = Counter(
            "kvreuse:router_streams_cut",
            "Streams whose executor failed mid-response (ended with an error event).",
            registry=self.registry,
        )
        self.migrations = Counter(
            "kvreuse:router_migrations",
            "Streams whose executor failed mid-response, by what the router did (kvreuse.router.migration).",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(_StateCollector(executors, index, self.executor_label))
        self._policy = policy_name

    def decision(self, decision: Decision, candidates: Sequence[Candidate]) -> None:
        """Count one routing decision among ``candidates`` (the chosen one is among them)."""
        choice = decision.choice
        self.decisions.labels(self.executor_label(self.executors[choice]), self._policy).inc()
        chosen = next(c for c in candidates if c.name == choice)
        self.overlap_blocks.inc(chosen.overlap_blocks)
        self.prompt_blocks.inc(chosen.prompt_blocks)

    def executor_label(self, executor: Executor) -> str:
        """The ``executor`` label: its id, or its URL with ``executor_urls``."""
        return executor.url if self.executor_urls or executor.id is None else str(executor.id)

    def migration(self, outcome: str) -> None:
        self.migrations.labels(outcome).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StateCollector:
    def __init__(self, executors: Mapping[str, Executor], index: KVIndex, label_of: Callable[[Executor], str]) -> None:
        self.executors = executors
        self.index = index
        self.label_of = label_of

    def collect(self):
        up = GaugeMetricFamily(
            "kvreuse:router_executor_up", "1 while the executor passes health checks.", labels=["executor"]
        )
        load = GaugeMetricFamily(
            "kvreuse:router_executor_load_blocks", "Load blocks the policy sees.", labels=["executor"]
        )
        inflight = GaugeMetricFamily("kvreuse:router_executor_in_flight", "Requests in flight.", labels=["executor"])
        for e in self.executors.values():
            label = self.label_of(e)
            up.add_metric([label], 1.0 if e.healthy else 0.0)
            load.add_metric([label], e.load_blocks)
            inflight.add_metric([label], e.in_flight)
        yield up
        yield load
        yield inflight
        yield GaugeMetricFamily(
            "kvreuse:router_index_keys", "Distinct block keys in the index.", value=self.index.num_keys
        )
