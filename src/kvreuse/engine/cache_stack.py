"""``CacheStack``: every level that holds KV blocks, as one object.

::

    KVCacheManager (prefix matching, admission)        ── kv
      └─ BlockPool (device blocks, in the runner's KV tensor) ── pool
           └─ HostTier (host copies, None without --host-cache-memory) ── host
                └─ PersistentTiers (disk / remote / object stores, their ledgers) ── stores

The engine's builder (``engine/engine_builder.py``) makes it; the engine hands its ``kv`` to
the scheduler, the PML module cache and the document cache, and calls the methods here
between steps (store changes, retention expiry) and for the operations that concern every
level at once (snapshot, reset, close). Engine thread only, unless a method says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvreuse.tiers.tier_stats import tier_stats

if TYPE_CHECKING:
    from kvreuse.cache.block_pool import BlockPool
    from kvreuse.cache.host_tier import HostTier
    from kvreuse.cache.kv_cache_manager import KVCacheManager
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.events.records import KVSnapshot
    from kvreuse.tiers.persistent import PersistentTiers

IDLE_WAKE_MAX_S = 3600.0  # an idle engine thread wakes at least this often


class CacheStack:
    """The device pool and the tiers below it (``host``, ``stores``: ``None`` when off), the
    prefix-cache manager over them (``kv``) and the event buffer they report to (``events``:
    ``None`` when events are off)."""

    def __init__(self, kv: KVCacheManager, host: HostTier | None, events: EventBuffer | None) -> None:
        self.kv = kv
        self.pool: BlockPool = kv.pool
        self.host = host
        self.stores: PersistentTiers | None = None if host is None else host.below  # type: ignore[assignment]  # HostTier types it as its protocol
        self.events = events

    def pools(self) -> tuple:
        """The device pool, then the tiers below it: the host pool and the stores' ledgers
        (snapshots list every level)."""
        if self.host is None:
            return (self.pool,)
        return (self.pool, self.host.pool, *self.host.ledgers.values())

    def sync_stores(self) -> int:
        """Apply what the disk / remote stores reported since the last call (finished writes,
        removals) to their ledgers, emitting their events. Returns how many changes there were."""
        return 0 if self.host is None else self.host.sync_stores()

    def watch_stores(self, wake: Callable[[], None]) -> None:
        """Have the stores call ``wake()`` (thread-safe, non-blocking) from their threads
        whenever they report a change, so an idle engine thread applies it."""
        if self.stores is not None:
            self.stores.on_change = wake

    @property
    def remote_store_id(self) -> str | None:
        """Identity of the remote store this executor shares (no credentials), or None."""
        return None if self.stores is None else self.stores.remote_store_id

    @property
    def object_store_id(self) -> str | None:
        """Identity of the object store (bucket) this executor shares (no credentials), or None."""
        return None if self.stores is None else self.stores.object_store_id

    def idle(self) -> float | None:
        """What an idle engine thread does: retention durations that ran out fall back to
        priority 35 now (metrics, dashboard and ``BlockUpdated`` events follow, not at the
        next allocation), then the stores' changes are applied. Returns the seconds to sleep
        until the pool's next retention expiry (at least 0.01, at most ``IDLE_WAKE_MAX_S``),
        or ``None`` when none is due."""
        self.pool.expire()
        self.sync_stores()
        due = self.pool.next_expiry()
        return None if due is None else min(max(due - self.pool.clock(), 0.01), IDLE_WAKE_MAX_S)

    def snapshot(self) -> KVSnapshot:
        """Every level's blocks (``pools``) as one ``KVSnapshot`` labelled with the id of the
        last event they reflect, store changes applied first. Raises ``RuntimeError`` when
        events are off."""
        if self.events is None:
            raise RuntimeError("KV events are off (--event-buffer-max-size 0): no snapshot to take")
        self.sync_stores()
        return self.events.snapshot(self.pools())

    def reset(self) -> int:
        """Forget every cached block not in use, on the device and in the host tier; returns
        how many were dropped. The disk and remote stores keep theirs: after the device's
        ``AllBlocksCleared`` (which consumers apply to every level) their ledgers announce
        them again."""
        dropped = 0
        if self.host is not None:  # first, so the device's AllBlocksCleared (if any) is the last word
            dropped += self.host.pool.evict_all_cached()
        dropped += self.pool.evict_all_cached()
        if self.host is not None and not self.pool.cached_hashes():  # the device said AllBlocksCleared
            for ledger in self.host.ledgers.values():
                ledger.announce_all()
        return dropped

    def check_integrity(self) -> None:
        """The pool's and the host tier's own checks; no host block is held between steps.
        Raises ``RuntimeError``. Call between steps."""
        self.pool.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
            if self.host.pool.num_used_blocks:
                raise RuntimeError(f"{self.host.pool.num_used_blocks} host blocks are held between steps")

    def tier_stats(self, block_bytes: int) -> dict[str, dict[str, float]]:
        """``tiers/tier_stats.tier_stats`` of the levels below the device pool; ``{}`` without them."""
        return {} if self.host is None else tier_stats(self.host, block_bytes)

    def close(self) -> None:
        """Finish the disk / remote writes already queued (at most 5 s: what is left is a
        recompute later) and close the remote connections, so a restarted executor finds
        what this one computed. Call when no step runs any more (a graceful stop)."""
        if self.stores is not None:
            self.stores.close()
