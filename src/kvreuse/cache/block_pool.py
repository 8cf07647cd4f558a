"""The paged KV block pool: block ids, reference counts, the prefix-cache index, eviction.

The pool holds no tensors (the runner's KV storage is indexed by ``block_id``), so the same pool runs the engine
and the trace simulator. It does no IO: events go to an optional ``EventSink``.

Every block is in exactly one state::

    free      ref_count == 0, no key          (in ``_free``; handed out first)
    cached    ref_count == 0, key registered  (reusable on a hit; evictable when a leaf)
    in use    ref_count  > 0                  (never evicted; may or may not have a key)

Eviction order: among cached blocks that no other cached block depends on (leaves of the
prefix tree), the one with the smallest ``policy.sort_key``. Keys live in a lazy heap
(``pool_heaps.py``): an entry is valid only while its ``version`` matches the block's, so a
hit or a priority change just bumps the version (O(1)) and eviction pops stale entries.
Every operation is O(log n) in the number of blocks (amortised over stale heap entries).

Retention (TensorRT-LLM semantics, SPEC section 3; ``retention.py``): a block's optional
``duration_s`` starts counting when it is *released* (a block in use never expires); once it
runs out, ``expire`` puts it back at ``DEFAULT_PRIORITY``, its recency kept.

Callers check before they commit (``num_free_blocks`` / ``can_allocate`` then
``allocate``), so nothing is rolled back; ``allocate`` beyond capacity is a broken
invariant and raises ``RuntimeError``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import MappingProxyType

from kvreuse.cache.eviction import EvictionPolicy, LRUPolicy
from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.integrity import PoolView, check_pool
from kvreuse.cache.kv_block import DEFAULT_PRIORITY, EvictedBlock, KVBlock  # re-exported: callers import them from here
from kvreuse.cache.pool_heaps import EvictionHeap, ExpiryHeap
from kvreuse.cache.prefix_index import PrefixIndex
from kvreuse.events.records import (
    DEVICE_LEVEL,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    BlockUpdated,
    CacheCreated,
    EventSink,
    StoredBlock,
)

Clock = Callable[[], float]  # seconds; injectable so expiry is tested without sleeping


class BlockPool:
    """Allocation, reference counting and prefix-cache index over ``num_blocks`` blocks.

    Not thread-safe: the engine loop is its only caller.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        policy: EvictionPolicy | None = None,
        clock: Clock = time.monotonic,
        events: EventSink | None = None,
        cache_level: str = DEVICE_LEVEL,
        record_evictions: bool = False,
        kv_cache_dtype: str | None = None,  # the KV format its blocks hold, told in the created event
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the pool needs at least one block, got {num_blocks} (raise --kv-cache-memory)")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size} (--block-size)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        # Policies written to the bare sort-key protocol may lack the eviction hook.
        self._on_evict: Callable[[KVBlock], None] | None = getattr(self.policy, "on_evict", None)
        self.clock = clock
        self.cache_level = cache_level
        self._events = events
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self._free: deque[KVBlock] = deque(self.blocks)
        self._index = PrefixIndex()  # registered blocks by key, child and priority counts
        # evicted blocks not yet taken (record_evictions): a lower tier copies them out
        self._evicted: list[EvictedBlock] | None = [] if record_evictions else None
        self._num_cached_free = 0  # registered blocks with ref_count == 0
        self._heap = EvictionHeap()  # cached leaves by policy.sort_key
        self._expiry = ExpiryHeap()  # released blocks' running durations
        self._tick = 0
        self.num_evictions = 0
        self.evictions_by_priority: dict[int, int] = {}  # priority at eviction -> blocks evicted
        self._emit(CacheCreated({cache_level: num_blocks}, kv_cache_dtype))

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an ``allocate`` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + self._num_cached_free

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks not held by any request."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - self._num_cached_free

    def blocks_by_priority(self) -> dict[int, int]:
        """Registered blocks (in use or cached) per retention priority, zero counts left out.
        A copy: the caller may keep it."""
        return {p: n for p, n in sorted(self._index.held_by_priority.items()) if n}

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        """The registered block with this key, or ``None``. Does not modify the pool."""
        return self._index.get(block_hash)

    def match_prefix(self, block_hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]) -> list[KVBlock]:
        """The longest run of leading blocks already registered whose stored tokens equal
        ``token_blocks`` (a hash collision is a miss, never a wrong answer).

        Does not modify the pool: acquire the result before anything can evict it.
        """
        hits: list[KVBlock] = []
        for block_hash, tokens in zip(block_hashes, token_blocks):
            block = self._index.get(block_hash)
            if block is None or block.token_ids != tuple(tokens):
                break
            hits.append(block)
        return hits

    def cached_hashes(self) -> list[KVBlock]:
        """Every registered block (in use or not), for snapshots."""
        return list(self._index.blocks.values())

    # ------------------------------------------------------------------ mutations
    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a cache hit). A cached block stops being
        evictable, and its duration stops running, until released.

        Raises ``RuntimeError`` for a free, unregistered block (allocate it instead)."""
        for block in blocks:
            if block.ref_count == 0:
                if block.block_hash is None:
                    raise RuntimeError(f"block {block.block_id} is free and uncached: allocate it instead")
                self._num_cached_free -= 1
                block.version += 1  # drops its heap entry
                block.expires_at = None  # drops its expiry entry: a claimed block never expires
            block.ref_count += 1
            block.access_count += 1
            block.last_access = self._next_tick()

    def allocate(self, n: int) -> list[KVBlock]:
        """``n`` blocks with ``ref_count == 1`` and no key, evicting cached leaves as needed.

        Raises ``RuntimeError`` when ``n`` exceeds ``num_free_blocks`` (check first).
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"allocate({n}) with only {self.num_free_blocks} free blocks: call can_allocate first")
        self.expire()
        out: list[KVBlock] = []
        removed: list[BlockHash] = []
        try:
            for _ in range(n):
                if self._free:
                    block = self._free.popleft()
                else:
                    block = self._pop_victim()
                    removed.append(block.block_hash)  # type: ignore[arg-type]  # a victim is a cached, hashed block
                    if self._evicted is not None:
                        self._evicted.append(EvictedBlock.of(block))
                    self._unregister(block)
                block.ref_count = 1
                block.access_count = 1
                block.last_access = self._next_tick()
                out.append(block)
        except RuntimeError:
            for block in out:  # all or nothing: hand back what was taken (now bare blocks)
                block.ref_count = 0
                block.reset()
                self._free.append(block)
            raise
        finally:
            if removed:  # evicted either way: consumers must hear of it
                self._emit(BlocksRemoved(tuple(removed), self.cache_level))
        return out

    def register(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        *,
        depth: int,
        priority: int = DEFAULT_PRIORITY,
        duration_s: float | None = None,
    ) -> KVBlock:
        """Enter a full, computed, in-use block into the prefix index with its retention
        (``duration_s`` starts counting at release).

        If another block already holds ``block_hash`` (two requests computed the same
        block at once), the pool keeps the existing one and returns it unchanged; ``block``
        stays unregistered and goes back to the free list on release. The caller acquires
        the returned block and applies ``set_retention`` as for any hit. Returns the block
        that holds the key. Raises ``RuntimeError`` if ``block`` is unheld or registered.
        """
        if block.ref_count <= 0:
            raise RuntimeError(f"register of block {block.block_id} that no request holds")
        existing = self._index.get(block_hash)
        if existing is not None:
            return existing
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is already registered")
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.depth = depth
        block.priority = priority
        block.duration_s = duration_s
        block.expires_at = None
        self._index.add(block)
        self._emit(
            BlocksStored(
                parent_hash,
                (StoredBlock(block_hash, block.token_ids, priority, self.cache_level),),
                self.block_size,
            )
        )
        return block

    def take_evicted(self) -> list[EvictedBlock]:
        """The blocks evicted since the last call, in eviction order (with
        ``record_evictions``; else always empty). Their KV is still in their slots until the
        caller writes there: a lower tier copies it out first. Clears the list."""
        if not self._evicted:
            return []
        out, self._evicted = self._evicted, []
        return out

    def remove_cached(self, blocks: Iterable[KVBlock]) -> None:
        """Forget cached blocks nobody holds (a lower tier handing its copy up to the device:
        the block moves, it is not evicted, so it is not counted as an eviction). Emits
        ``BlocksRemoved`` at this pool's level. Raises ``RuntimeError`` for a held or
        uncached block."""
        removed: list[BlockHash] = []
        for block in blocks:
            if block.ref_count or block.block_hash is None:
                raise RuntimeError(f"remove_cached of block {block.block_id}, which is held or not cached")
            removed.append(self._forget(block))
        if removed:
            self._emit(BlocksRemoved(tuple(removed), self.cache_level))

    def set_retention(self, block: KVBlock, priority: int | None, duration_s: float | None) -> None:
        """Apply a reusing request's retention to a registered block: its priority when
        given, and its duration always (``None`` clears it). On a block nobody holds the
        new duration starts now. Emits ``BlockUpdated`` when the priority changes.

        Raises ``RuntimeError`` for an unregistered block."""
        if block.block_hash is None:
            raise RuntimeError(f"set_retention on block {block.block_id}, which is not registered")
        if priority is not None and priority != block.priority:
            self._set_priority(block, priority)
        block.duration_s = duration_s
        if block.ref_count == 0:
            self._start_expiry(block)
            self._make_evictable(block)

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. Callers release a chain tail first, so
        equal-tick ties still evict the deepest block first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"release of block {block.block_id} with ref_count {block.ref_count}")
            block.ref_count -= 1
            block.last_access = self._next_tick()
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                block.reset()
                self._free.append(block)
            else:
                self._num_cached_free += 1
                self._start_expiry(block)
                self._make_evictable(block)

    def next_expiry(self) -> float | None:
        """Clock time of the earliest pending expiry (it may have been cancelled since), or None."""
        return self._expiry.next_expiry()

    def expire(self, now: float | None = None) -> int:
        """Drop every released block whose duration has run out back to the default
        priority (``allocate`` calls this before it evicts). Returns how many changed."""
        now = self.clock() if now is None else now
        changed = 0
        for expires_at, block_id in self._expiry.pop_due(now):
            block = self.blocks[block_id]
            if block.expires_at != expires_at or block.block_hash is None or block.ref_count:
                continue
            block.expires_at = None
            if block.priority != DEFAULT_PRIORITY:
                self._set_priority(block, DEFAULT_PRIORITY)
                changed += 1
            if block.ref_count == 0:
                self._make_evictable(block)
        return changed

    def evict_all_cached(self) -> int:
        """Forget every cached block not in use (``reset_prefix_cache``). Returns how many.
        Not counted as evictions: nothing needed the room. A device pool left empty emits
        ``AllBlocksCleared``; that event names no level, so a tier below (another
        ``cache_level``) reports ``BlocksRemoved`` at its level instead."""
        removed = [self._forget(self._pop_victim()) for _ in range(self._num_cached_free)]
        if not self._index.blocks and self.cache_level == DEVICE_LEVEL:
            self._emit(AllBlocksCleared())
        elif removed:
            self._emit(BlocksRemoved(tuple(removed), self.cache_level))
        return len(removed)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the bookkeeping is inconsistent: free + cached + in use
        == total, ref counts >= 0, index, children and per-priority counts agree, and no
        block in use has a running duration. O(n): for tests and idle checks."""
        check_pool(self.view())

    def view(self) -> PoolView:
        """The bookkeeping, read-only (``integrity.PoolView``); valid until the pool changes."""
        return PoolView(
            num_blocks=self.num_blocks,
            blocks=tuple(self.blocks),
            free=tuple(self._free),
            cached=MappingProxyType(self._index.blocks),
            children=MappingProxyType(self._index.children),
            held_by_priority=MappingProxyType(self._index.held_by_priority),
            num_cached_free=self._num_cached_free,
        )

    # ------------------------------------------------------------------ internals
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _emit(self, event) -> None:
        if self._events is not None:
            self._events.append(event)

    def _set_priority(self, block: KVBlock, priority: int) -> None:
        old = block.priority
        block.priority = priority
        if block.block_hash is not None:
            self._index.reprioritize(old, priority)
            self._emit(BlockUpdated(block.block_hash, old_priority=old, new_priority=priority))

    def _start_expiry(self, block: KVBlock) -> None:
        """A released block's duration starts now; at the default priority there is
        nothing to fall back from (TensorRT-LLM does the same)."""
        if block.duration_s is None or block.priority == DEFAULT_PRIORITY:
            block.expires_at = None
        else:
            block.expires_at = self.clock() + block.duration_s

    def _make_evictable(self, block: KVBlock) -> None:
        """(Re)enter a released cached block into the eviction heap if it is a leaf, and
        its expiry into the expiry heap."""
        block.version += 1
        if block.expires_at is not None:
            self._expiry.push(block)
        if block.num_cached_children == 0:
            self._heap.push(self.policy.sort_key(block), block)

    def _pop_victim(self) -> KVBlock:
        return self._heap.pop_victim(self.blocks)

    def _unregister(self, block: KVBlock, *, evicted: bool = True) -> None:
        """Remove an unheld cached block from the index (it becomes a bare block).
        ``evicted``: made room under memory pressure (counted); a reset is not."""
        if self._on_evict is not None:
            self._on_evict(block)
        leaf_parent = self._index.remove(block)
        self._num_cached_free -= 1
        if evicted:
            self.num_evictions += 1
            self.evictions_by_priority[block.priority] = self.evictions_by_priority.get(block.priority, 0) + 1
        if leaf_parent is not None and leaf_parent.ref_count == 0:
            self._make_evictable(leaf_parent)
        block.reset()

    def _forget(self, block: KVBlock) -> BlockHash:
        """An unheld cached block back to the free list, not counted as an eviction; its key."""
        key = block.block_hash
        self._unregister(block, evicted=False)
        self._free.append(block)
        return key  # type: ignore[return-value]  # a cached block is hashed
