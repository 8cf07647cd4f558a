"""Prometheus families of the KV tiers (host, disk, remote, object), from an ``EngineStats`` snapshot.

``server.metrics``' engine collector yields them on every scrape: hits by tier, blocks /
bytes / seconds moved per direction, host occupancy by priority, each tier's ledger of
stored / removed / held blocks, and the disk / remote / object stores' own counters and levels.
Nothing without tiers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvreuse.engine.outputs import EngineStats

_TIER_COUNTERS = {  # host-tier stat -> (metric, help, direction)
    "offloaded_blocks": ("kvreuse:kv_tier_blocks_moved", "Blocks moved between tiers.", "device_to_host"),
    "onboarded_blocks": ("kvreuse:kv_tier_blocks_moved", "Blocks moved between tiers.", "host_to_device"),
    "loaded_blocks": ("kvreuse:kv_tier_blocks_moved", "Blocks moved between tiers.", "store_to_device"),
    "offloaded_bytes": ("kvreuse:kv_tier_bytes_moved", "Bytes moved between tiers.", "device_to_host"),
    "onboarded_bytes": ("kvreuse:kv_tier_bytes_moved", "Bytes moved between tiers.", "host_to_device"),
    "loaded_bytes": ("kvreuse:kv_tier_bytes_moved", "Bytes moved between tiers.", "store_to_device"),
    "offload_seconds": (
        "kvreuse:kv_tier_transfer_seconds",
        "Seconds spent moving blocks between tiers.",
        "device_to_host",
    ),
    "onboard_seconds": ("kvreuse:kv_tier_transfer_seconds", "Seconds spent moving blocks between tiers.", "to_device"),
}


_LEDGER_STATS = {  # tier_stats keys every lower level has -> (metric, help); by tier label
    "blocks_stored": (
        "kvreuse:kv_tier_blocks_stored",
        "Blocks a tier reported stored (its BlocksStored events).",
        CounterMetricFamily,
    ),
    "blocks_removed": (
        "kvreuse:kv_tier_blocks_removed",
        "Blocks a tier reported removed (its BlocksRemoved events).",
        CounterMetricFamily,
    ),
    "blocks_held": (
        "kvreuse:kv_tier_blocks_held",
        "Blocks a tier holds now, as its events report them.",
        GaugeMetricFamily,
    ),
}


_STORE_GAUGES = {  # the stores' stats() that are levels, not counts
    "entries": "Blocks the store holds.",
    "bytes": "Bytes the store holds.",
    "breaker_open": "1 while the store's circuit breaker skips it.",
}


def gauge_family(name: str, doc: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    """A gauge family holding one sample, ``value`` at label ``values``."""
    family = GaugeMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family


def tier_metrics(s: EngineStats, labels: list[str], values: list[str]) -> Iterator[Metric]:
    """Hits by tier, blocks / bytes / seconds moved per direction, host occupancy by priority,
    and the disk / remote / object stores' own counters. Nothing without tiers."""
    by_tier, tiers = s.prefix_cache_hits_tokens_by_tier, s.tiers
    if not tiers:
        return
    from kvreuse.events.records import DISK_LEVEL, HOST_LEVEL, OBJECT_LEVEL, REMOTE_LEVEL, TIER_NAMES

    hits = CounterMetricFamily(
        "kvreuse:prefix_cache_hits_by_tier", "Prompt tokens found in the cache, by tier.", labels=[*labels, "tier"]
    )
    for level, name in TIER_NAMES.items():
        hits.add_metric([*values, name], by_tier.get(level, 0))
    yield hits
    host = tiers.get(HOST_LEVEL, {})
    families: dict[str, CounterMetricFamily] = {}
    for stat, (metric, doc, direction) in _TIER_COUNTERS.items():
        family = families.setdefault(metric, CounterMetricFamily(metric, doc, labels=[*labels, "direction"]))
        family.add_metric([*values, direction], host.get(stat, 0))
    yield from families.values()
    for stat, doc in (("num_blocks", "Blocks in the host tier."), ("num_cached_blocks", "Blocks the host tier holds.")):
        gauge = GaugeMetricFamily(f"kvreuse:host_tier_{stat}", doc, labels=labels)
        gauge.add_metric(values, host.get(stat, 0))
        yield gauge
    held = GaugeMetricFamily(
        "kvreuse:host_tier_blocks_by_priority", "Host-tier blocks, by retention priority.", labels=[*labels, "priority"]
    )
    for key, n in sorted(host.items()):
        if key.startswith("blocks_priority_"):
            held.add_metric([*values, key.removeprefix("blocks_priority_")], n)
    yield held
    yield gauge_family(
        "kvreuse:kv_tier_writes_pending",
        "Disk / remote / object writes queued or in progress.",
        labels,
        values,
        host.get("tier_writes_pending", 0),
    )
    for stat, (metric, doc, kind) in _LEDGER_STATS.items():
        family = kind(metric, doc, labels=[*labels, "tier"])
        for level in (HOST_LEVEL, DISK_LEVEL, REMOTE_LEVEL, OBJECT_LEVEL):
            if level in tiers:
                family.add_metric([*values, TIER_NAMES[level]], tiers[level].get(stat, 0))
        yield family
    for level in (DISK_LEVEL, REMOTE_LEVEL, OBJECT_LEVEL):
        if level in tiers:
            name = level.lower()
            store = CounterMetricFamily(
                f"kvreuse:{name}_tier_events", f"The {TIER_NAMES[level]} store's counters.", labels=[*labels, "event"]
            )
            for key, n in sorted(tiers[level].items()):
                if key not in _STORE_GAUGES and key not in _LEDGER_STATS:
                    store.add_metric([*values, key], n)
            yield store
            for key in sorted(_STORE_GAUGES.keys() & tiers[level].keys()):  # levels, not counts: they go down
                yield gauge_family(f"kvreuse:{name}_tier_{key}", _STORE_GAUGES[key], labels, values, tiers[level][key])
