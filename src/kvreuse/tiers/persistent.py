"""Disk and shared remote stores below the host tier: the one component that does their IO.

    device pool ──evict──▶ host tier ──evict (spill)──▶ disk store  ┐  (and write-through of
                                                   └──────────────▶ remote store ┘   newly computed
    admission: device ─▶ host ─▶ disk ─▶ remote  (the first tier that holds the next key wins)  blocks)

Writes (``spill``) are encoded on the caller's thread from a CPU copy of the block KV and
put by one background writer, so a slow disk or Redis never stalls a step; a full queue
drops the write (counted). Reads (``match``) are synchronous: the engine needs the KV
before it runs the request. Every failure (absent, corrupt, foreign, store down, breaker
open) is a miss: it costs a recompute, never a request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvreuse.cache.hashing import BlockHash
from kvreuse.events.records import DISK_LEVEL, REMOTE_LEVEL
from kvreuse.tiers.block_codec import BlockRecord, encode_block
from kvreuse.tiers.disk_store import DiskStore
from kvreuse.tiers.namespace import TierNamespace
from kvreuse.tiers.remote_store import RemoteStore

log = logging.getLogger(__name__)



@dataclass
class PersistentStats:
    written_blocks: int = 0  # puts handed to a store that succeeded (disk and remote counted apart)
    dropped_writes: int = 0  # queue full or encoding refused: not written
    disk_hits: int = 0  # blocks read back from disk at admission
    remote_hits: int = 0  # blocks read back from the remote store at admission


@dataclass(frozen=True, slots=True)
class StoredKV:
    """One block read back from a store, verified: what admission onboards."""

    key: BlockHash
    parent_key: BlockHash | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, block_size, head_dim], CPU
    level: str  # DISK_LEVEL or REMOTE_LEVEL


class PersistentTiers:
    """``disk`` and/or ``remote`` for one namespace and one per-block KV layout."""

    def __init__(
        self,
        namespace: TierNamespace,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        disk: DiskStore | None = None,
        remote: RemoteStore | None = None,
        write_through_min_priority: int = 101,
        queue_blocks: int = 4096,
    ) -> None:
        if disk is None and remote is None:
            raise ValueError("PersistentTiers needs a disk or a remote store")
        self.namespace = namespace
        self.block_shape = tuple(block_shape)  # [layers, 2, kv_heads, block_size, head_dim]
        self.dtype = dtype
        self.disk = disk
        self.remote = remote
        self.write_through_min_priority = write_through_min_priority
        self.stats = PersistentStats()
        self._queue: queue.Queue[tuple[BlockHash, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._flushed: threading.Event | None = None  # set by the writer when it reaches flush()'s marker
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ writes
    def writes_through(self, priority: int) -> bool:
        """Whether a newly computed block of ``priority`` is written to the stores at once
        (so another executor can hit it before this one evicts it)."""
        return priority >= self.write_through_min_priority

    def spill(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, tuple[int, ...]]], kv: torch.Tensor) -> None:
        """Queue ``blocks`` (key, parent key, token ids) for the stores; ``kv`` is their KV
        ``[layers, 2, kv_heads, n, block_size, head_dim]`` on the CPU, owned by this call (a
        copy the caller will not write). Never raises for a store problem."""
        for i, (key, parent, tokens) in enumerate(blocks):
            try:
                payload = encode_block(BlockRecord(key, parent, tuple(tokens), kv[:, :, :, i]), self.namespace)
                self._queue.put_nowait((key, payload))
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
        while True:
            item = self._queue.get()
            if item is None:
                if self._flushed is not None:
                    self._flushed.set()
                continue
            key, payload = item
            for store in (self.disk, self.remote):
                if store is not None and store.put(key, payload):  # put never raises: False on failure
                    self.stats.written_blocks += 1

    # ------------------------------------------------------------------ reads
    def match(self, keys: Sequence[BlockHash], token_blocks, parent: BlockHash | None) -> list[StoredKV]:
        """The longest run of ``keys`` (continuing the chain after ``parent``) that the stores
        hold with matching tokens and parent, verified; disk first, then one batched remote
        read for the rest. Reads only."""
        out: list[StoredKV] = []
        tokens = list(token_blocks)  # one entry per key
        if self.disk is not None:
            for key, want in zip(keys, tokens):
                record = self.disk.get(key, shape=self.block_shape, dtype=self.dtype)
                if record is None or not self._continues(record, want, out[-1].key if out else parent):
                    break
                out.append(StoredKV(record.key, record.parent_key, record.token_ids, record.kv, DISK_LEVEL))
        if self.remote is not None and len(out) < len(keys):
            rest = list(keys[len(out):])
            for record, want in zip(self.remote.get_many(rest, shape=self.block_shape, dtype=self.dtype),
                                    tokens[len(out):]):
                if record is None or not self._continues(record, want, out[-1].key if out else parent):
                    break
                out.append(StoredKV(record.key, record.parent_key, record.token_ids, record.kv, REMOTE_LEVEL))
        self.stats.disk_hits += sum(1 for s in out if s.level == DISK_LEVEL)
        self.stats.remote_hits += sum(1 for s in out if s.level == REMOTE_LEVEL)
        return out

    @staticmethod
    def _continues(record: BlockRecord, token_ids, parent: BlockHash | None) -> bool:
        # a key collision or a foreign chain is a miss, never a wrong answer
        return record.token_ids == tuple(token_ids) and record.parent_key == parent

    def close(self) -> None:
        self.flush(5.0)
        if self.remote is not None:
            self.remote.close()
