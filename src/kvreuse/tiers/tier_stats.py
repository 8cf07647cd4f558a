"""Building the tiers below the device pool from the engine's settings, and reading their stats.

The engine calls ``build_host_tier`` at start (``--host-cache-memory``, ``--disk-cache-dir``,
``--remote-cache``) and ``tier_stats`` for ``EngineStats.tiers``; ``AsyncEngine.stats`` reads
``store_stats`` live (the stores move on between steps). Nothing here runs per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvreuse.cache.eviction import make_policy
from kvreuse.cache.host_tier import HostTier, OffloadPolicy
from kvreuse.events.records import DISK_LEVEL, HOST_LEVEL, REMOTE_LEVEL

if TYPE_CHECKING:
    from kvreuse.engine.llm_engine import EngineConfig
    from kvreuse.engine.model_runner import KVLayout
    from kvreuse.tiers.persistent import PersistentTiers


def build_host_tier(config: "EngineConfig", layout: "KVLayout", loaded: Any, events: Any,
                    bytes_per_block: int) -> HostTier | None:
    """The host tier (with the disk / remote stores below it), or ``None`` when
    ``--host-cache-memory`` holds no block. Its ``mover`` is set once the runner exists.
    Raises ``ValueError`` for a malformed ``--remote-cache`` URL."""
    num_host_blocks = int(config.host_cache_memory_gib * 2**30) // bytes_per_block
    if num_host_blocks <= 0:
        return None
    return HostTier(
        num_host_blocks, config.block_size, events=events, below=build_stores(config, layout, loaded),
        policy=make_policy(config.eviction_policy, num_blocks=num_host_blocks),
        offload_policy=OffloadPolicy(config.host_offload_min_priority),
    )


def build_stores(config: "EngineConfig", layout: "KVLayout", loaded: Any) -> "PersistentTiers | None":
    """The disk / remote stores below the host tier, or ``None`` when neither is set."""
    if config.disk_cache_dir is None and config.remote_cache is None:
        return None
    from kvreuse.tiers.disk_store import DiskStore
    from kvreuse.tiers.namespace import TierNamespace
    from kvreuse.tiers.persistent import PersistentTiers
    from kvreuse.tiers.remote_store import RemoteStore

    namespace = TierNamespace(loaded.fingerprint, config.hash_algorithm, config.block_size)
    disk = None if config.disk_cache_dir is None else DiskStore(
        config.disk_cache_dir, int(config.disk_cache_size_gib * 2**30), namespace=namespace,
        ttl_s=config.disk_cache_ttl_s)
    remote = None if config.remote_cache is None else RemoteStore(config.remote_cache, namespace=namespace)
    shape = (layout.num_layers, 2, layout.num_kv_heads, config.block_size, layout.head_dim)
    return PersistentTiers(namespace, shape, loaded.dtype, disk=disk, remote=remote,
                           write_through_min_priority=config.tier_write_through_min_priority)


def tier_stats(host: HostTier, block_bytes: int) -> dict[str, dict[str, float]]:
    """Counters and gauges per lower tier: ``CPU`` (the host tier), ``DISK``, ``REMOTE``. Each
    level has ``blocks_stored`` / ``blocks_removed`` (blocks its events reported stored and
    removed since start) and ``blocks_held`` (held now, as announced)."""
    pool, s = host.pool, host.stats
    out: dict[str, dict[str, float]] = {HOST_LEVEL: {
        "num_blocks": pool.num_blocks, "num_cached_blocks": pool.num_cached_blocks,
        "offloaded_blocks": s.offloaded_blocks, "onboarded_blocks": s.onboarded_blocks,
        "loaded_blocks": s.loaded_blocks, "skipped_blocks": s.skipped_blocks, "dropped_blocks": s.dropped_blocks,
        "offloaded_bytes": s.offloaded_blocks * block_bytes, "onboarded_bytes": s.onboarded_blocks * block_bytes,
        "loaded_bytes": s.loaded_blocks * block_bytes,
        "offload_seconds": s.offload_seconds, "onboard_seconds": s.onboard_seconds,
        **{f"blocks_priority_{p}": n for p, n in pool.blocks_by_priority().items()},
        # host blocks enter only by offload, so every one offloaded and not held now has left
        # (and none is held by a request between steps, when stats are taken)
        "blocks_stored": s.offloaded_blocks, "blocks_removed": s.offloaded_blocks - pool.num_cached_blocks,
        "blocks_held": pool.num_cached_blocks,
    }}
    below = host.below
    if below is not None:
        for level, counters in store_stats(below).items():
            ledger = host.ledgers[level]
            out[level] = counters | {"blocks_stored": ledger.num_stored, "blocks_removed": ledger.num_removed,
                                     "blocks_held": len(ledger)}
        out[HOST_LEVEL]["tier_writes_dropped"] = below.stats.dropped_writes
        out[HOST_LEVEL]["tier_writes_pending"] = below.pending_writes
    return out


def store_stats(stores: "PersistentTiers") -> dict[str, dict[str, float]]:
    """The disk / remote stores' counters and gauges, per level (``DISK``, ``REMOTE``). Safe
    from any thread (the stores count under their own locks): they change on the writer
    thread and on the breaker's clock, between engine steps too, so readers take them live."""
    return {level: {k: float(v) for k, v in store.stats().items()}
            for level, store in ((DISK_LEVEL, stores.disk), (REMOTE_LEVEL, stores.remote)) if store is not None}
