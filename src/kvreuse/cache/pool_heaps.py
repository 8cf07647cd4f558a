"""The block pool's two lazy heaps: evictable leaves by the eviction policy's sort key, and
released blocks' pending expiries by clock time.

Lazy: an entry is valid only while its ``version`` matches the block's, so a hit or a
priority change just bumps the block's version (O(1)) and a pop skips stale entries. Every
push and pop is O(log n), amortised over the stale entries.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.cache.kv_block import KVBlock

__all__ = ["EvictionHeap", "ExpiryHeap"]


class EvictionHeap:
    """Cached leaf blocks, smallest ``sort_key`` first."""

    def __init__(self) -> None:
        self._entries: list[tuple[tuple, int, int, int]] = []  # (key, seq, version, block_id)
        self._seq = 0  # ties on the key pop in push order

    def push(self, key: tuple, block: KVBlock) -> None:
        """Enter ``block`` at its current version under ``key``."""
        self._seq += 1
        heapq.heappush(self._entries, (key, self._seq, block.version, block.block_id))

    def pop_victim(self, blocks: Sequence[KVBlock]) -> KVBlock:
        """The block of the smallest valid entry (same version, unheld, keyed, no cached
        child), found in ``blocks`` by id; stale entries on the way are dropped. Raises
        ``RuntimeError`` when no entry is valid (the caller's free count was wrong)."""
        while self._entries:
            _, _, version, block_id = heapq.heappop(self._entries)
            block = blocks[block_id]
            if (
                block.version == version
                and block.ref_count == 0
                and block.block_hash is not None
                and block.num_cached_children == 0
            ):
                return block
        raise RuntimeError("no evictable block although the free count says there is one")


class ExpiryHeap:
    """Released blocks' ``expires_at``, earliest first (entries may be cancelled since)."""

    def __init__(self) -> None:
        self._entries: list[tuple[float, int, int]] = []  # (expires_at, version, block_id)

    def push(self, block: KVBlock) -> None:
        """Enter ``block``'s ``expires_at`` (not None) at its current version."""
        assert block.expires_at is not None  # the caller's contract (above)
        heapq.heappush(self._entries, (block.expires_at, block.version, block.block_id))

    def next_expiry(self) -> float | None:
        """Clock time of the earliest entry, or None."""
        return self._entries[0][0] if self._entries else None

    def pop_due(self, now: float) -> Iterator[tuple[float, int]]:
        """Pop every entry due by ``now``, earliest first, as ``(expires_at, block_id)``; the
        caller checks each against its block (it may have been cancelled or renewed)."""
        while self._entries and self._entries[0][0] <= now:
            expires_at, _, block_id = heapq.heappop(self._entries)
            yield expires_at, block_id
