"""Prometheus metrics for one server app, in a registry of its own (no process globals).

Two sources:

* the engine's cumulative ``EngineStats`` snapshot, read at scrape time by a collector
  (prefix-cache queries/hits in tokens, hit rate, blocks free/cached/in use, requests
  running/waiting, evictions and blocks by ``priority``);
* per-request observations the routes make as outputs stream out (TTFT, inter-token
  latency, per-request time per output token, end-to-end latency, prompt tokens computed
  vs reused, finished requests by reason).

SPEC 8 asks for each of: prefix-cache queries and hits in tokens (``prefix_cache_queries``,
``prefix_cache_hits``), hit rate (``prefix_cache_hit_rate``), evictions and blocks held by
priority (``evictions``, ``blocks_by_priority``), TTFT and per-token latency histograms
(``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``request_time_per_output_token_seconds``), tokens computed vs reused
(``prompt_tokens_computed`` / ``prompt_tokens_reused``, and ``tokens_computed`` with decode),
events dropped (``kv_events_dropped``, present while events are on). With tenant limits,
``tenant_requests_refused{tenant,reason}``, ``tenant_requests_in_flight`` and
``tenant_tokens_charged`` (``kvreuse.api.limit_metrics``). ``/v1/messages`` adds
``cache_breakpoint_tokens{class,ttl}`` and ``messages_prompt_tokens{kind}``. Router decisions are
on the router's own ``/metrics`` (``kvreuse:router_decisions``, ``kvreuse.router.metrics``).
``tests/server/test_metrics.py`` asserts every one of them with exact values.

Names follow vLLM's with the ``kvreuse:`` prefix (``vllm:prefix_cache_queries`` ->
``kvreuse:prefix_cache_queries_total``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvreuse.server.tier_metrics import (
    gauge_family,
    tier_metrics as _tier_metrics,  # tests import it from here
)

if TYPE_CHECKING:
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import RequestOutput

# vLLM's TTFT buckets, trimmed; CPU prefill of long prompts runs into seconds.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Reads the engine's latest stats snapshot on every scrape."""

    def __init__(self, engine: AsyncEngine, model_name: str, event_buffer: Any = None) -> None:
        self._engine = engine
        self._model_name = model_name
        self._event_buffer = event_buffer  # an EventBuffer (thread-safe reads), or None: events off

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        labels, values = ["model_name"], [self._model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return gauge_family(name, doc, labels, values, value)

        yield counter(
            "kvreuse:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries_tokens,
        )
        yield counter(
            "kvreuse:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits_tokens
        )
        rate = s.prefix_cache_hits_tokens / s.prefix_cache_queries_tokens if s.prefix_cache_queries_tokens else 0.0
        yield gauge("kvreuse:prefix_cache_hit_rate", "Cumulative prefix-cache hit rate (tokens).", rate)
        yield gauge("kvreuse:num_blocks_total", "KV blocks in the device pool.", s.num_blocks)
        yield gauge(
            "kvreuse:num_blocks_free", "Blocks holding no KV (free + cached + used == total).", s.num_free_blocks
        )
        yield gauge("kvreuse:num_blocks_cached", "Cached blocks no request holds.", s.num_cached_blocks)
        yield gauge("kvreuse:num_blocks_used", "Blocks held by running requests.", s.num_used_blocks)
        yield gauge(
            "kvreuse:kv_cache_usage_perc",
            "Fraction of blocks held by running requests.",
            s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0,
        )
        yield gauge("kvreuse:num_requests_running", "Requests being prefilled or decoded.", s.num_running)
        yield gauge("kvreuse:num_requests_waiting", "Requests queued for memory or a batch slot.", s.num_waiting)
        evictions = CounterMetricFamily(
            "kvreuse:evictions", "Cached blocks evicted, by retention priority.", labels=[*labels, "priority"]
        )
        for priority, count in sorted(s.evictions_by_priority.items()):
            evictions.add_metric([*values, str(priority)], count)
        yield evictions
        held = GaugeMetricFamily(
            "kvreuse:blocks_by_priority", "Registered blocks, by retention priority.", labels=[*labels, "priority"]
        )
        for priority, count in sorted(s.blocks_by_priority.items()):
            held.add_metric([*values, str(priority)], count)
        yield held
        yield counter("kvreuse:num_preemptions", "Requests preempted for memory (recomputed later).", s.num_preemptions)
        yield counter(
            "kvreuse:tokens_computed",
            "Tokens run through the model (prefill, decode and PML module precompute).",
            s.tokens_computed,
        )
        yield counter(
            "kvreuse:spec_decode_num_draft_tokens",
            "Prompt-lookup draft tokens verified.",
            s.spec_decode_num_draft_tokens,
        )
        yield counter(
            "kvreuse:spec_decode_num_accepted_tokens",
            "Of the draft tokens verified, those accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        if self._event_buffer is not None:
            events = self._event_buffer.stats()
            yield counter(
                "kvreuse:kv_events_dropped", "KV events dropped from the full event buffer.", events["num_dropped"]
            )
            yield gauge("kvreuse:kv_events_last_id", "Id of the newest KV event.", events["last_event_id"])
        refused = CounterMetricFamily(
            "kvreuse:schema_store_refused",
            "Schema-dir files refused (recomputed), by reason.",
            labels=[*labels, "reason"],
        )
        for reason, n in sorted(s.schema_store_refused.items()):
            refused.add_metric([*values, reason], n)
        yield refused
        filled = CounterMetricFamily(
            "kvreuse:schema_modules_filled",
            "PML modules put into the pool, by source (computed, or loaded from --schema-dir).",
            labels=[*labels, "source"],
        )
        for source, n in sorted(s.schema_modules_filled.items()):
            filled.add_metric([*values, source], n)
        yield filled
        yield counter(
            "kvreuse:schema_precompute_slices",
            "Engine steps that ran a slice of a schema registration.",
            s.schema_slices,
        )
        yield gauge(
            "kvreuse:schemas_registering", "Schema registrations queued or being precomputed.", s.schemas_registering
        )
        yield counter(
            "kvreuse:seam_repair_tokens",
            "Assembled tokens (PML modules, documents) recomputed by blend (--blend-*, a request's blend).",
            s.seam_repair_tokens,
        )
        yield counter(
            "kvreuse:document_tokens_computed",
            "Document tokens run through the model (chat messages "
            "marked kvreuse.document, completions documents), with the text they are encoded after.",
            s.document_tokens_computed,
        )
        yield counter(
            "kvreuse:document_tokens_reused",
            "Document tokens found cached when a request acquired its documents.",
            s.document_tokens_reused,
        )
        yield from _tier_metrics(s, labels, values)
        yield gauge(
            "kvreuse:block_pool_integrity_ok",
            "1 if the last idle integrity check passed.",
            0.0 if self._engine.integrity_error else 1.0,
        )


class RequestTracker:
    """Observes one request's outputs as they stream; call ``observe`` for each output."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._start = time.monotonic()
        self._first: float | None = None  # when the first token arrived
        self._last: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if output.new_token_ids:
            if self._last is None:
                self._first = now
                self._m.ttft.labels(self._m.model_name).observe(now - self._start)
            else:
                # One output may carry several tokens (stop-string holdback): spread the gap.
                self._m.itl.labels(self._m.model_name).observe((now - self._last) / len(output.new_token_ids))
            self._last = now
        if output.finished:
            m, name = self._m, self._m.model_name
            m.e2e.labels(name).observe(now - self._start)
            if self._first is not None and len(output.output_token_ids) > 1:
                m.tpot.labels(name).observe((now - self._first) / (len(output.output_token_ids) - 1))
            m.prompt_tokens.labels(name).inc(output.num_prompt_tokens)
            m.generation_tokens.labels(name).inc(len(output.output_token_ids))
            m.tokens_reused.labels(name).inc(output.num_cached_tokens)
            m.tokens_computed.labels(name).inc(output.num_prompt_tokens - output.num_cached_tokens)
            m.finished.labels(name, output.finish_reason or "unknown").inc()


class ServerMetrics:
    """The app's registry and the request-level instruments."""

    def __init__(self, engine: AsyncEngine, model_name: str, *, event_buffer: Any = None, limiter: Any = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(
            "kvreuse:time_to_first_token_seconds",
            "Time from request arrival to first token.",
            labels,
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "kvreuse:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.tpot = Histogram(
            "kvreuse:request_time_per_output_token_seconds",
            "Per request: time from the first to the last token over the tokens after the first.",
            labels,
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "kvreuse:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            registry=r,
            buckets=_E2E_BUCKETS,
        )
        self.prompt_tokens = Counter("kvreuse:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(
            "kvreuse:generation_tokens", "Generated tokens of finished requests.", labels, registry=r
        )
        self.tokens_computed = Counter(
            "kvreuse:prompt_tokens_computed", "Prompt tokens prefilled from scratch.", labels, registry=r
        )
        self.tokens_reused = Counter(
            "kvreuse:prompt_tokens_reused", "Prompt tokens served from the prefix cache.", labels, registry=r
        )
        self.finished = Counter(
            "kvreuse:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r
        )
        # /v1/messages (docs/anthropic.md): what cache_control asked for, and usage as Anthropic counts it
        self.breakpoint_tokens = Counter(
            "kvreuse:cache_breakpoint_tokens",
            "Prompt tokens under cache_control breakpoints, by the class that set "
            "their priority (tools, system, document, history) and ttl.",
            [*labels, "class", "ttl"],
            registry=r,
        )
        self.cache_usage_tokens = Counter(
            "kvreuse:messages_prompt_tokens",
            "Prompt tokens of /v1/messages: cache_read, cache_creation, input.",
            [*labels, "kind"],
            registry=r,
        )
        r.register(_EngineCollector(engine, model_name, event_buffer))
        if limiter is not None:  # a TenantLimiter
            from kvreuse.api.limit_metrics import LimiterCollector

            r.register(LimiterCollector(limiter, "kvreuse:"))

    def observe_cache_control(self, ranges: list[tuple[str, str, int]], read: int, created: int, plain: int) -> None:
        """One finished ``/v1/messages`` request: its breakpoint ranges as ``(class, ttl,
        tokens)`` and its prompt's read / created / plain input tokens."""
        for cls, ttl, n in ranges:
            self.breakpoint_tokens.labels(self.model_name, cls, ttl).inc(n)
        for kind, n in (("cache_read", read), ("cache_creation", created), ("input", plain)):
            self.cache_usage_tokens.labels(self.model_name, kind).inc(n)

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self, *, show_tenants: bool = True) -> tuple[bytes, str]:
        """The exposition text and its content type; without ``show_tenants`` the tenant
        series are summed over tenants (``kvreuse.api.limit_metrics.TenantsHidden``)."""
        if show_tenants:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from kvreuse.api.limit_metrics import TenantsHidden

        return generate_latest(TenantsHidden(self.registry)), CONTENT_TYPE_LATEST
