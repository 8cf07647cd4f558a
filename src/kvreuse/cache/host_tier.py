"""The host tier: a second ``BlockPool`` that keeps what the device pool evicts.

TensorRT-LLM's secondary memory, vLLM's CPU offloading, SGLang HiCache's host tier: a device
block chosen for eviction whose priority is at least ``OffloadPolicy.min_priority`` is
copied to a host block instead of being dropped, and registered there under the same key,
parent, tokens and retention. The host pool has its own eviction policy and retention, and
its own events (cache level ``CPU``, vLLM's medium name for host memory).

Admission matches device -> host: the device pool's longest cached run, then the host
pool's continuation of that chain. Host blocks found are *onboarded*: copied into fresh
device blocks, registered there, and forgotten by the host (the tiers are exclusive, so a
block occupies one of them and device + host hold ``device + host`` distinct blocks).

Nothing here touches a tensor: bytes move through a ``KVMover`` given by the edge (the
engine's model runner; ``None`` in the simulator, where only bookkeeping exists).

The stores below (disk, remote) change on their own thread; what they report is applied here,
on the engine thread, to one ``StoreLedger`` per store level (``sync_stores``), which emits
their KV events and answers snapshots (``cache.store_ledger``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvreuse.cache.block_pool import BlockPool, Clock
from kvreuse.cache.eviction import EvictionPolicy
from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.kv_block import DEFAULT_PRIORITY, EvictedBlock, KVBlock
from kvreuse.cache.store_ledger import StoreChange, StoreLedger
from kvreuse.events.records import HOST_LEVEL, EventSink


class KVMover(Protocol):
    """Moves block KV between the device storage and the host storage (the edge: the model
    runner on CUDA/CPU). Every call copies whole blocks, one call per batch; copies are
    complete (or ordered before any later write to the source) when they return. KV
    tensors are opaque here: ``[layers, 2, kv_heads, n, block_size, head_dim]`` on the CPU."""

    def offload(self, device_block_ids: Sequence[int], host_block_ids: Sequence[int]) -> None: ...

    def onboard(self, host_block_ids: Sequence[int], device_block_ids: Sequence[int]) -> None: ...

    def read_host(self, host_block_ids: Sequence[int]) -> Any: ...

    def read_device(self, device_block_ids: Sequence[int]) -> Any: ...

    def write_device(self, device_block_ids: Sequence[int], kv: Any) -> None: ...


class LoadedBlock(Protocol):
    """A block read back from a persistent store (``tiers.persistent.StoredKV``, frozen: its
    fields are read-only here too)."""

    @property
    def key(self) -> BlockHash: ...

    @property
    def parent_key(self) -> BlockHash | None: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def kv(self) -> Any: ...

    @property
    def level(self) -> str: ...


class Stores(Protocol):
    """The disk / remote stores below the host tier (``tiers.persistent.PersistentTiers``):
    they do their own IO; this tier only hands them blocks (key, parent key, token ids,
    depth), asks them for chains, and takes the changes they saw (thread-safe)."""

    @property
    def levels(self) -> tuple[str, ...]:  # the cache level of each store present
        ...

    def spill(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, tuple[int, ...], int]], kv: Any) -> None: ...

    def writes_through(self, priority: int) -> bool: ...

    def match(
        self, keys: Sequence[BlockHash], token_blocks, parent: BlockHash | None, depth: int = 0
    ) -> Sequence[LoadedBlock]: ...

    def take_changes(self) -> list[StoreChange]: ...


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """Which evicted device blocks go down to the host: priority >= ``min_priority``
    (TensorRT-LLM offloads blocks of priority >= 35 by default). A pure score."""

    min_priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        if not 0 <= self.min_priority <= 101:
            raise ValueError(f"--host-offload-min-priority must be in [0, 101] (101: never), got {self.min_priority}")

    def offloads(self, block: EvictedBlock) -> bool:
        return block.priority >= self.min_priority


@dataclass
class TierStats:
    """Counters since start: blocks offloaded to host, onboarded back, dropped by the host."""

    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    loaded_blocks: int = 0  # read back from the disk / remote stores into device blocks
    skipped_blocks: int = 0  # evicted below the priority gate: dropped, not offloaded
    dropped_blocks: int = 0  # passed the gate but found no room (host blocks all held)
    offload_seconds: float = 0.0
    onboard_seconds: float = 0.0


class HostTier:
    """Host pool of ``num_blocks`` blocks below a device pool. Engine thread only.

    The caller (``KVCacheManager``) hands it every batch of device evictions before the
    evicted device slots are written again (``offload``), and asks it to continue a chain
    at admission (``match`` then ``onboard``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        policy: EvictionPolicy | None = None,
        offload_policy: OffloadPolicy = OffloadPolicy(),
        mover: KVMover | None = None,
        clock: Clock = time.monotonic,
        events: EventSink | None = None,
        timer: Callable[[], float] = time.perf_counter,
        below: Stores | None = None,
    ) -> None:
        self.pool = BlockPool(
            num_blocks,
            block_size,
            policy=policy,
            clock=clock,
            events=events,
            cache_level=HOST_LEVEL,
            record_evictions=below is not None,
        )
        self.below = below  # disk / remote: host evictions spill there, admission reads there last
        # what the stores hold, as this executor announces it: one ledger per store level
        self.ledgers = {
            level: StoreLedger(level, block_size, events=events)
            for level in (below.levels if below is not None else ())
        }
        self.offload_policy = offload_policy
        self.mover = mover
        self.stats = TierStats()
        self._timer = timer

    # ------------------------------------------------------------------ device -> host
    def offload(self, evicted: Sequence[EvictedBlock]) -> int:
        """Keep the evicted device blocks that pass the gate: one host block each (evicting
        host leaves when full), their KV copied from the device slots (which must not have
        been written since the eviction), registered under the same key and retention.
        Blocks already on the host are skipped. Returns how many were copied."""
        wanted = [e for e in evicted if self.offload_policy.offloads(e)]
        skipped = len(evicted) - len(wanted)
        self.stats.skipped_blocks += skipped
        wanted = [e for e in wanted if self.pool.get_cached(e.block_hash) is None]
        room = self.pool.num_free_blocks
        # parents first (a chain arrives leaf first from the device); with less room than
        # blocks (host blocks held by an admission in progress), the shallowest are kept:
        # a block is reachable only through its parent
        wanted.sort(key=lambda e: e.depth)
        self.stats.dropped_blocks += max(len(wanted) - room, 0)
        wanted = wanted[:room]
        if not wanted:
            return 0
        started = self._timer()
        host = self.pool.allocate(len(wanted))
        spilled = self.pool.take_evicted()
        if spilled and self.below is not None and self.mover is not None:
            # read before the copy below overwrites those host blocks
            kv = self.mover.read_host([e.block_id for e in spilled])
            self.below.spill([(e.block_hash, e.parent_hash, e.token_ids, e.depth) for e in spilled], kv)
        if self.mover is not None:
            self.mover.offload([e.block_id for e in wanted], [b.block_id for b in host])
        for block, e in zip(host, wanted):
            kept = self.pool.register(
                block,
                e.block_hash,
                e.parent_hash,
                e.token_ids,
                depth=e.depth,
                priority=e.priority,
                duration_s=e.duration_s,
            )
            assert kept is block  # filtered above: the key was not on the host
        self.pool.release(reversed(host))
        self.stats.offloaded_blocks += len(host)
        self.stats.offload_seconds += self._timer() - started
        return len(host)

    # ------------------------------------------------------------------ host -> device
    def match(self, keys: Sequence[BlockHash], token_blocks) -> list[KVBlock]:
        """The host's longest run of ``keys`` (stored tokens checked), acquired so nothing
        evicts it before ``onboard`` or ``cancel``. Changes only those blocks' references."""
        hits = self.pool.match_prefix(keys, token_blocks)
        self.pool.acquire(hits)
        return hits

    def drop(self, keys: Sequence[BlockHash]) -> None:
        """Forget the host's copies of ``keys`` that nobody holds (they were just registered on
        the device: a block-aligned prompt computes its last block, never a hit, so it can
        exist below already). Emits ``BlocksRemoved`` at this level for them."""
        copies = [b for b in map(self.pool.get_cached, keys) if b is not None and b.ref_count == 0]
        if copies:
            self.pool.remove_cached(copies)

    def cancel(self, hits: Sequence[KVBlock]) -> None:
        """Give back ``match``'s hits unused (admission failed)."""
        self.pool.release(reversed(hits))

    def onboard(self, hits: Sequence[KVBlock], device_block_ids: Sequence[int]) -> list[tuple]:
        """Copy the host ``hits`` into the device blocks ``device_block_ids`` (fresh, held by
        the caller) and forget them on the host (the block moves up). Returns, per block,
        ``(key, parent key, token ids, priority, duration)`` for the caller to register on
        the device."""
        if not hits:
            return []
        started = self._timer()
        if self.mover is not None:
            self.mover.onboard([b.block_id for b in hits], device_block_ids)
        moved = [(b.block_hash, b.parent_hash, b.token_ids, b.priority, b.duration_s) for b in hits]
        self.pool.release(reversed(hits))
        self.pool.remove_cached(reversed(hits))
        self.stats.onboarded_blocks += len(moved)
        self.stats.onboard_seconds += self._timer() - started
        return moved

    # ------------------------------------------------------------------ stores -> device
    def match_stores(
        self, keys: Sequence[BlockHash], token_blocks, parent: BlockHash | None, depth: int = 0
    ) -> list[LoadedBlock]:
        """The stores' continuation of a chain after ``parent`` (``keys[0]`` at chain position
        ``depth``): verified blocks, or ``[]``."""
        if self.below is None or not keys:
            return []
        return list(self.below.match(keys, token_blocks, parent, depth))

    def sync_stores(self) -> int:
        """Apply the changes the stores reported since the last call to their ledgers, in the
        order seen (this emits their events). Returns how many changes there were."""
        if self.below is None:
            return 0
        changes = self.below.take_changes()
        start = 0
        for i in range(1, len(changes) + 1):  # one apply per run of one level keeps the order
            if i == len(changes) or changes[i].level != changes[start].level:
                self.ledgers[changes[start].level].apply(changes[start:i])
                start = i
        return len(changes)

    def load(self, stored: Sequence[LoadedBlock], device_block_ids: Sequence[int]) -> list[tuple]:
        """Write the stores' blocks into device blocks (fresh, held by the caller). Returns,
        per block, ``(key, parent key, token ids, priority, duration)`` for the caller to
        register (stores keep no retention: default priority, no duration)."""
        if not stored:
            return []
        started = self._timer()
        if self.mover is not None:
            self.mover.write_device(device_block_ids, _stack([s.kv for s in stored]))
        self.stats.loaded_blocks += len(stored)
        self.stats.onboard_seconds += self._timer() - started
        return [(s.key, s.parent_key, s.token_ids, DEFAULT_PRIORITY, None) for s in stored]

    def write_through(self, blocks: Sequence[KVBlock]) -> None:
        """Hand newly registered device blocks whose priority passes the stores' write-through
        gate to the stores now (another executor sharing the remote store can hit them)."""
        if self.below is None or self.mover is None:
            return
        picked = [b for b in blocks if b.block_hash is not None and self.below.writes_through(b.priority)]
        if picked:
            kv = self.mover.read_device([b.block_id for b in picked])
            self.below.spill([(b.block_hash, b.parent_hash, b.token_ids, b.depth) for b in picked], kv)  # type: ignore[misc]  # picked blocks are hashed (filter above)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for ledger in self.ledgers.values():
            ledger.check_integrity()


def _stack(kvs: Sequence[Any]) -> Any:
    """``[layers, 2, kv_heads, n, block_size, head_dim]`` from n per-block tensors (torch is
    imported here only, lazily: the simulator never loads a block)."""
    import torch

    return torch.stack(list(kvs), dim=3)
