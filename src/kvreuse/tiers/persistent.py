"""Disk, shared remote and object stores below the host tier: the one component that does their IO.

    device pool ──evict──▶ host tier ──evict (spill)──▶ disk store    ┐  (and write-through of
                                                   ├──────────────▶ remote store  ┤   newly computed
                                                   └──────────────▶ object store ┘   blocks)
    admission: device ─▶ host ─▶ disk ─▶ remote ─▶ object  (the first tier that holds the next key wins)

Writes (``spill``) are encoded on the caller's thread from a CPU copy of the block KV and
put by one background writer, so a slow disk, Redis or S3 never stalls a step; a full queue
drops the write (counted). Reads (``match``) are synchronous: the engine needs the KV
before it runs the request. Every failure (absent, corrupt, foreign, store down, breaker
open) is a miss: it costs a recompute, never a request.

What the stores hold is reported, never emitted from here: every change seen (a write the
store acknowledged, a block the disk already held at start, a block verified on a read, a
disk entry that left the index, a remote key or object found missing, an object the object
store deleted) is a ``StoreChange`` on a
thread-safe queue; the engine thread takes them (``take_changes``) into its ledgers, which
emit the KV events (``cache.store_ledger``). The writer calls ``on_change`` whenever it runs
out of work (and every ``WAKE_EVERY`` writes of a long burst), so an idle engine thread wakes
up to apply what it finished; changes seen on the engine thread are applied by it anyway.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.store_ledger import StoreChange
from kvreuse.events.records import DISK_LEVEL, OBJECT_LEVEL, REMOTE_LEVEL
from kvreuse.tiers.block_codec import BlockHeader, BlockRecord, encode_block
from kvreuse.tiers.disk_store import DiskStore
from kvreuse.tiers.namespace import TierNamespace
from kvreuse.tiers.remote_store import RemoteStore

if TYPE_CHECKING:
    from kvreuse.tiers.object_store import ObjectStore  # boto3: imported only where an object tier is built

    SharedStore = RemoteStore | ObjectStore  # stores other executors write too: a miss there is news

log = logging.getLogger(__name__)

WAKE_EVERY = 32  # finished writes between on_change calls while the writer stays busy
SpilledBlock = tuple[BlockHash, BlockHash | None, tuple[int, ...], int]  # key, parent key, token ids, depth


@dataclass
class PersistentStats:
    written_blocks: int = 0  # puts handed to a store that succeeded (disk and remote counted apart)
    dropped_writes: int = 0  # queue full or encoding refused: not written
    disk_hits: int = 0  # blocks read back from disk at admission
    remote_hits: int = 0  # blocks read back from the remote store at admission
    object_hits: int = 0  # blocks read back from the object store at admission


@dataclass(frozen=True, slots=True)
class StoredKV:
    """One block read back from a store, verified: what admission onboards."""

    key: BlockHash
    parent_key: BlockHash | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, block_size, head_dim], CPU
    level: str  # DISK_LEVEL, REMOTE_LEVEL or OBJECT_LEVEL


class PersistentTiers:
    """``disk``, ``remote`` and/or ``objects`` for one namespace and one per-block KV layout."""

    def __init__(
        self,
        namespace: TierNamespace,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        disk: DiskStore | None = None,
        remote: RemoteStore | None = None,
        objects: ObjectStore | None = None,
        write_through_min_priority: int = 101,
        queue_blocks: int = 4096,
    ) -> None:
        if disk is None and remote is None and objects is None:
            raise ValueError("PersistentTiers needs a disk, a remote or an object store")
        self.namespace = namespace
        self.block_shape = tuple(block_shape)  # [layers, 2, kv_heads, block_size, head_dim]
        self.dtype = dtype
        self.disk = disk
        self.remote = remote
        self.objects = objects
        self.write_through_min_priority = write_through_min_priority
        self.stats = PersistentStats()
        # called by the writer thread when changes wait: must be thread-safe and never block
        self.on_change: Callable[[], None] | None = None
        self._changes: queue.SimpleQueue[StoreChange] = queue.SimpleQueue()
        self._queue: queue.Queue[tuple[SpilledBlock, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._pending = 0  # writes queued and not finished (both stores tried)
        self._pending_lock = threading.Lock()
        self._flushed: threading.Event | None = None  # set by the writer when it reaches flush()'s marker
        # shared-store reads in flight, each with the (level, key)s the writer had acknowledged
        # since it began (under the lock): a miss of one of those predates the write, keep it
        self._remote_lock = threading.Lock()
        self._remote_reads: list[set[tuple[str, BlockHash]]] = []
        if disk is not None:
            disk.listen(lambda key: self._note(StoreChange(DISK_LEVEL, key, False)))
            self._announce_disk(disk)
        if objects is not None:  # deleted objects: refused, past their age, purged
            objects.listen(lambda key: self._note(StoreChange(OBJECT_LEVEL, key, False)))
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    @property
    def stores(self) -> dict[str, DiskStore | SharedStore]:
        """The stores present by cache level, nearest first (``DISK``, ``REMOTE``, ``OBJECT``)."""
        found = ((DISK_LEVEL, self.disk), (REMOTE_LEVEL, self.remote), (OBJECT_LEVEL, self.objects))
        return {level: store for level, store in found if store is not None}

    @property
    def levels(self) -> tuple[str, ...]:
        """The cache levels of the stores present: ``DISK``, ``REMOTE``, ``OBJECT``."""
        return tuple(self.stores)

    @property
    def remote_store_id(self) -> str | None:
        """The remote store's identity (``RemoteStore.identity``: no credentials), or None."""
        return None if self.remote is None else self.remote.identity

    @property
    def object_store_id(self) -> str | None:
        """The object store's identity (``ObjectStore.identity``: no credentials), or None."""
        return None if self.objects is None else self.objects.identity

    @property
    def pending_writes(self) -> int:
        """Writes queued or in progress now."""
        return self._pending

    # ------------------------------------------------------------------ changes
    def take_changes(self) -> list[StoreChange]:
        """Every change queued since the last call, in the order seen. Any thread (the engine's)."""
        out: list[StoreChange] = []
        while True:
            try:
                out.append(self._changes.get_nowait())
            except queue.Empty:
                return out

    def _note(self, change: StoreChange) -> None:
        self._changes.put(change)

    def _announce_disk(self, disk: DiskStore) -> None:
        """Report the blocks the disk held at start (its rebuilt index), from their headers.
        A block's depth is its chain position among them (0 when its parent is not there)."""
        headers: dict[BlockHash, BlockHeader] = {}
        for key in disk.keys():  # noqa: SIM118 - DiskStore.keys() is a snapshot under its lock, not a dict view
            found = disk.header(key)
            if found is not None:  # unreadable: get() will refuse it, nothing to announce
                headers[key] = found
        depths: dict[BlockHash, int] = {}
        for key in headers:
            if key in depths:
                continue
            chain = [key]  # walk up to a block of known depth or the first one not on disk
            while len(chain) <= len(headers):  # (a cycle of keys cannot happen; bounded anyway)
                parent = headers[chain[-1]].parent_key
                if parent not in headers or parent in depths:
                    break
                chain.append(parent)
            parent = headers[chain[-1]].parent_key
            depth = -1 if parent is None else depths.get(parent, -1)
            for k in reversed(chain):
                depth += 1
                depths[k] = depth
        for key, found in headers.items():
            self._note(StoreChange(DISK_LEVEL, key, True, found.parent_key, found.token_ids, depths[key]))

    # ------------------------------------------------------------------ writes
    def writes_through(self, priority: int) -> bool:
        """Whether a newly computed block of ``priority`` is written to the stores at once
        (so another executor can hit it before this one evicts it)."""
        return priority >= self.write_through_min_priority

    def spill(self, blocks: Sequence[SpilledBlock], kv: torch.Tensor) -> None:
        """Queue ``blocks`` (key, parent key, token ids, depth) for the stores; ``kv`` is their
        KV ``[layers, 2, kv_heads, n, block_size, head_dim]`` on the CPU, owned by this call (a
        copy the caller will not write). Never raises for a store problem. Each store that
        acknowledges a block reports it (``take_changes``)."""
        for i, block in enumerate(blocks):
            key, parent, tokens, _ = block
            try:
                payload = encode_block(BlockRecord(key, parent, tuple(tokens), kv[:, :, :, i]), self.namespace)
                with self._pending_lock:
                    self._queue.put_nowait((block, payload))
                    self._pending += 1
            except queue.Full:
                self.stats.dropped_writes += 1
            except ValueError as exc:  # a block the codec refuses (cannot happen for pool blocks)
                self.stats.dropped_writes += 1
                log.warning("KV tier: block %s not written: %s", bytes(key).hex()[:16], exc)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, shutdown). Returns whether it finished."""
        done = threading.Event()
        self._flushed = done
        try:
            self._queue.put(None, timeout=timeout_s)  # a marker: the writer sets ``_flushed`` on it
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def _write_loop(self) -> None:
        finished = 0
        while True:
            item = self._queue.get()
            if item is None:
                if self._flushed is not None:
                    self._flushed.set()
                continue
            (key, parent, tokens, depth), payload = item
            try:  # the stores' put never raises by contract; a bug there must not stop every later write
                self._write(key, parent, tokens, depth, payload)
            except Exception:  # logged; the block is a recompute later
                self.stats.dropped_writes += 1
                log.exception("KV tier: writing block %s failed", bytes(key).hex()[:16])
            with self._pending_lock:
                self._pending -= 1
                idle = self._pending == 0
            finished += 1
            if (idle or finished % WAKE_EVERY == 0) and self.on_change is not None:
                self.on_change()

    def _write(self, key: BlockHash, parent: BlockHash | None, tokens, depth: int, payload: bytes) -> None:
        if self.disk is not None:
            # reported under the disk's lock, so before any removal of the entry is
            stored = StoreChange(DISK_LEVEL, key, True, parent, tuple(tokens), depth)
            if self.disk.put(key, payload, on_stored=lambda: self._note(stored)):  # never raises
                self.stats.written_blocks += 1
        for level, shared in ((REMOTE_LEVEL, self.remote), (OBJECT_LEVEL, self.objects)):
            if shared is not None and shared.put(key, payload):
                self.stats.written_blocks += 1
                with self._remote_lock:
                    self._note(StoreChange(level, key, True, parent, tuple(tokens), depth))
                    for acked in self._remote_reads:
                        acked.add((level, key))

    # ------------------------------------------------------------------ reads
    def match(
        self, keys: Sequence[BlockHash], token_blocks, parent: BlockHash | None, depth: int = 0
    ) -> list[StoredKV]:
        """The longest run of ``keys`` (continuing the chain after ``parent``; ``keys[0]`` at
        chain position ``depth``) that the stores hold with matching tokens and parent,
        verified; disk first, then one batched remote read for the rest, then the object
        store's parallel reads for what is still missing. Reads only, and reports what it
        learnt: each block used is held; a shared key that the store said it lacks (absent,
        or refused and deleted) is not."""
        out: list[StoredKV] = []
        tokens = list(token_blocks)  # one entry per key
        if self.disk is not None:
            for key, want in zip(keys, tokens):
                # held is reported under the disk's lock, if the entry is still indexed: never
                # after a removal the writer thread made while this read verified the block
                at = depth + len(out)

                def on_hit(found: BlockRecord, at: int = at) -> None:
                    self._note(self._held(found, DISK_LEVEL, at))

                record = self.disk.get(key, shape=self.block_shape, dtype=self.dtype, on_hit=on_hit)
                if record is None or not self._continues(record, want, out[-1].key if out else parent):
                    break
                out.append(StoredKV(record.key, record.parent_key, record.token_ids, record.kv, DISK_LEVEL))
        for level, shared in ((REMOTE_LEVEL, self.remote), (OBJECT_LEVEL, self.objects)):
            if shared is None or len(out) == len(keys):
                continue
            found = self._fetch_shared(level, shared, list(keys[len(out) :]))
            for record, want in zip(found or (), tokens[len(out) :]):
                if record is None or not self._continues(record, want, out[-1].key if out else parent):
                    break
                out.append(self._used(record, level, depth + len(out)))
        self.stats.disk_hits += sum(1 for s in out if s.level == DISK_LEVEL)
        self.stats.remote_hits += sum(1 for s in out if s.level == REMOTE_LEVEL)
        self.stats.object_hits += sum(1 for s in out if s.level == OBJECT_LEVEL)
        return out

    def _fetch_shared(self, level: str, store: SharedStore, keys: list[BlockHash]) -> list[BlockRecord | None] | None:
        """``store.fetch_many`` (Redis: one answer per key; S3: the leading run, possibly
        shorter), reporting each key the store answered without as not held, unless the writer
        had its write of that key acknowledged meanwhile (the miss may predate it: the key is
        held now). None: the store did not answer, nothing learnt."""
        acked: set[tuple[str, BlockHash]] = set()
        with self._remote_lock:
            self._remote_reads.append(acked)
        found = None
        try:
            found = store.fetch_many(keys, shape=self.block_shape, dtype=self.dtype)
        finally:
            with self._remote_lock:
                self._remote_reads.remove(acked)
                for key, record in zip(keys, found or ()):
                    if record is None and (level, key) not in acked:
                        self._note(StoreChange(level, key, False))
        return found

    def _used(self, record: BlockRecord, level: str, depth: int) -> StoredKV:
        self._note(self._held(record, level, depth))
        return StoredKV(record.key, record.parent_key, record.token_ids, record.kv, level)

    @staticmethod
    def _held(record: BlockRecord, level: str, depth: int) -> StoreChange:
        return StoreChange(level, record.key, True, record.parent_key, record.token_ids, depth)

    @staticmethod
    def _continues(record: BlockRecord, token_ids, parent: BlockHash | None) -> bool:
        # a key collision or a foreign chain is a miss, never a wrong answer
        return record.token_ids == tuple(token_ids) and record.parent_key == parent

    def close(self) -> None:
        self.flush(5.0)
        if self.remote is not None:
            self.remote.close()
        if self.objects is not None:
            self.objects.close()
