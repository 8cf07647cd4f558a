"""What this executor tells the world the disk and remote stores hold: one ledger per store level.

The stores do their IO on their own thread (``tiers.persistent.PersistentTiers``), so their
contents change off the engine thread. They never touch the event buffer: every change they
see (a write that succeeded, a block found or verified on a read, a block they dropped)
becomes a ``StoreChange`` in a thread-safe queue, and the engine thread applies those to the
ledgers between steps (``HostTier.sync_stores``). A ledger emits the events and answers
snapshots like a ``BlockPool`` of its level, so the snapshot plus later events equal the
ledgers at every instant, whatever the stores' threads are doing::

    writer thread / reads ──StoreChange──▶ queue ──engine thread──▶ StoreLedger(DISK) ──▶ EventSink
                                                                   StoreLedger(REMOTE) ─┘

What a ledger holds (docs/events.md, "Disk and remote blocks"):

- ``DISK``: the store's index exactly. Every entry that enters it (a write, a file found at
  start) is announced, every entry that leaves it (size cap, idle TTL, a refused file, a
  file gone) is removed, in the order the store's lock saw them.
- ``REMOTE``: what this executor wrote (Redis acknowledged) or read back verified, and has
  not seen missing since. Redis may expire, evict or flush keys unseen; a read that misses
  a key the ledger holds removes it. Other executors' writes are theirs to announce.
- ``OBJECT`` (an S3 bucket): as ``REMOTE``, and an object this executor deleted itself
  (refused on a read, past its age) is removed too.

Stores keep no retention: a block there has the default priority, and a read-back block is
registered on the device at it. A store block is a copy, so a key can be in a ledger and in
the device or host pool at once (the snapshot lists it once per level). No IO here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.kv_block import DEFAULT_PRIORITY
from kvreuse.events.records import BlocksRemoved, BlocksStored, EventSink, StoredBlock


@dataclass(frozen=True, slots=True)
class StoreChange:
    """One change a store saw, made on any thread, applied on the engine thread."""

    level: str  # DISK_LEVEL, REMOTE_LEVEL or OBJECT_LEVEL
    key: BlockHash
    held: bool  # True: the store holds the block now; False: it does not (any more)
    parent_key: BlockHash | None = None  # with held: the block's parent, tokens and chain position
    token_ids: tuple[int, ...] = ()
    depth: int = 0


@dataclass(frozen=True, slots=True)
class LedgerBlock:
    """A block a store holds, in the attributes ``take_snapshot`` reads from pool blocks."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    depth: int
    priority: int = DEFAULT_PRIORITY
    ref_count: int = 0  # a store block is never held by a request


class StoreLedger:
    """The blocks of one store level as this executor announces them. Engine thread only."""

    def __init__(self, cache_level: str, block_size: int, *, events: EventSink | None = None) -> None:
        self.cache_level = cache_level
        self.block_size = block_size
        self._events = events
        self._blocks: dict[BlockHash, LedgerBlock] = {}  # oldest announcement first
        self.num_stored = 0  # blocks announced since start (BlocksStored at this level)
        self.num_removed = 0  # blocks removed since start (BlocksRemoved at this level)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._blocks

    def cached_hashes(self) -> list[LedgerBlock]:
        """Every block announced and not removed (for snapshots; ``BlockPool``'s name)."""
        return list(self._blocks.values())

    def apply(self, changes: Iterable[StoreChange]) -> None:
        """Apply changes in order: a block newly held is announced (``BlocksStored``), one no
        longer held is removed (``BlocksRemoved``, one event per run of removals); a change
        that changes nothing (held again, or gone and never announced) emits nothing."""
        gone: list[BlockHash] = []
        for change in changes:
            if change.held:
                if change.key not in self._blocks:
                    self._flush_removed(gone)
                    self._store(change)
            elif self._blocks.pop(change.key, None) is not None:
                gone.append(change.key)
        self._flush_removed(gone)

    def announce_all(self) -> None:
        """Announce every block again (after ``AllBlocksCleared``, which a consumer applies to
        every level, while the stores still hold their blocks). Parents first."""
        for block in sorted(self._blocks.values(), key=lambda b: b.depth):
            self._emit_stored(block)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if an entry is filed under another key or held by a request."""
        for key, block in self._blocks.items():
            if block.block_hash != key or block.ref_count or len(block.token_ids) > self.block_size:
                raise RuntimeError(f"{self.cache_level} ledger entry {bytes(key).hex()[:16]} is inconsistent: {block}")
        if self.num_stored - self.num_removed != len(self._blocks):
            raise RuntimeError(
                f"{self.cache_level} ledger: {self.num_stored} stored - {self.num_removed} removed "
                f"!= {len(self._blocks)} held"
            )

    # ------------------------------------------------------------------ internals
    def _store(self, change: StoreChange) -> None:
        block = LedgerBlock(change.key, change.parent_key, tuple(change.token_ids), change.depth)
        self._blocks[change.key] = block
        self.num_stored += 1
        self._emit_stored(block)

    def _emit_stored(self, block: LedgerBlock) -> None:
        if self._events is not None:
            stored = StoredBlock(block.block_hash, block.token_ids, block.priority, self.cache_level)
            self._events.append(BlocksStored(block.parent_hash, (stored,), self.block_size))

    def _flush_removed(self, gone: list[BlockHash]) -> None:
        if not gone:
            return
        self.num_removed += len(gone)
        if self._events is not None:
            self._events.append(BlocksRemoved(tuple(gone), self.cache_level))
        gone.clear()
