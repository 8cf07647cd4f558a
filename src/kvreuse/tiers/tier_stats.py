"""Reading the stats of the tiers below the device pool.

The engine calls ``tier_stats`` for ``EngineStats.tiers``; ``AsyncEngine.stats`` reads
``store_stats`` live (the stores move on between steps). Nothing here runs per step; the
tiers themselves are built by ``engine/engine_builder.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from kvreuse.events.records import HOST_LEVEL

if TYPE_CHECKING:
    from kvreuse.cache.host_tier import HostTier
    from kvreuse.tiers.persistent import PersistentTiers


def tier_stats(host: HostTier, block_bytes: int) -> dict[str, dict[str, float]]:
    """Counters and gauges per lower tier: ``CPU`` (the host tier), ``DISK``, ``REMOTE``,
    ``OBJECT``. Each level has ``blocks_stored`` / ``blocks_removed`` (blocks its events
    reported stored and removed since start) and ``blocks_held`` (held now, as announced)."""
    pool, s = host.pool, host.stats
    out: dict[str, dict[str, float]] = {
        HOST_LEVEL: {
            "num_blocks": pool.num_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "offloaded_blocks": s.offloaded_blocks,
            "onboarded_blocks": s.onboarded_blocks,
            "loaded_blocks": s.loaded_blocks,
            "skipped_blocks": s.skipped_blocks,
            "dropped_blocks": s.dropped_blocks,
            "offloaded_bytes": s.offloaded_blocks * block_bytes,
            "onboarded_bytes": s.onboarded_blocks * block_bytes,
            "loaded_bytes": s.loaded_blocks * block_bytes,
            "offload_seconds": s.offload_seconds,
            "onboard_seconds": s.onboard_seconds,
            **{f"blocks_priority_{p}": n for p, n in pool.blocks_by_priority().items()},
            # host blocks enter only by offload, so every one offloaded and not held now has left
            # (and none is held by a request between steps, when stats are taken)
            "blocks_stored": s.offloaded_blocks,
            "blocks_removed": s.offloaded_blocks - pool.num_cached_blocks,
            "blocks_held": pool.num_cached_blocks,
        }
    }
    if host.below is not None:
        below = cast("PersistentTiers", host.below)  # what engine_builder puts under the host tier
        for level, counters in store_stats(below).items():
            ledger = host.ledgers[level]
            out[level] = counters | {
                "blocks_stored": ledger.num_stored,
                "blocks_removed": ledger.num_removed,
                "blocks_held": len(ledger),
            }
        out[HOST_LEVEL]["tier_writes_dropped"] = below.stats.dropped_writes
        out[HOST_LEVEL]["tier_writes_pending"] = below.pending_writes
    return out


def store_stats(stores: PersistentTiers) -> dict[str, dict[str, float]]:
    """The disk / remote / object stores' counters and gauges, per level (``DISK``, ``REMOTE``,
    ``OBJECT``). Safe from any thread (the stores count under their own locks): they change on
    the writer thread and on the breaker's clock, between engine steps too, so readers take
    them live."""
    return {level: {k: float(v) for k, v in store.stats().items()} for level, store in stores.stores.items()}
