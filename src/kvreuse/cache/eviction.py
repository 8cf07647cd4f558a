"""Eviction policies: each is a small object that returns a sort key.

The block pool evicts the evictable block (unheld, cached, a leaf of the prefix tree)
with the *smallest* key. Keys are computed when a block becomes evictable (released, its
last cached child evicted, its retention changed or expired) and stay fixed while it sits
unused, so a key may read only fields that do not change meanwhile: ``priority``,
``last_access`` (a logical tick of the pool: about two per block a request touches),
``access_count`` (uses in this residency), ``depth``, ``block_hash``.

A policy may keep a little state of its own; the pool tells it about evictions through
``on_evict`` (called before the block forgets its key). Adding a policy is a few lines:
subclass ``EvictionPolicy``, write ``sort_key``, add it to ``POLICIES``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.cache.hashing import BlockHash
    from kvreuse.cache.kv_block import KVBlock

DEFAULT_NUM_BLOCKS = 4096  # pool size assumed by policies that scale with it when not told


class EvictionPolicy:
    """Base: ``sort_key`` must be overridden; ``on_evict`` does nothing by default."""

    name: str = ""

    def sort_key(self, block: KVBlock) -> tuple:
        """Smaller keys are evicted first. Must not modify ``block``."""
        raise NotImplementedError

    def on_evict(self, block: KVBlock) -> None:
        """The pool is about to forget ``block`` (its key and counters are still set)."""

    @classmethod
    def for_pool(cls, num_blocks: int) -> EvictionPolicy:
        """A policy for a pool of ``num_blocks`` blocks; stateless policies ignore it."""
        return cls()


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def sort_key(self, block: KVBlock) -> tuple:
        return (block.last_access,)


class PriorityPolicy(EvictionPolicy):
    """TensorRT-LLM: lowest retention priority first, LRU within a priority."""

    name = "priority"

    def sort_key(self, block: KVBlock) -> tuple:
        return (block.priority, block.last_access)


class TwoQueuePolicy(EvictionPolicy):
    """Hint-free, after 2Q (Johnson & Shasha, VLDB 1994): a block whose key has been used
    at least twice, counting earlier residencies, is *protected*; it ranks as if used
    ``protect_ticks`` later than it was, so once-used blocks go first and a protected
    block still ages out eventually (no starvation).

    Why: most prompt blocks are never used again (on the Mooncake conversation trace
    three in four), and reuse distances exceed what LRU keeps, so LRU spends the cache on
    blocks that never hit. A block's first reuse usually comes after it was evicted;
    a bounded *ghost* history of evicted keys (their use counts) recognises it when it is
    recomputed, so the second residency is protected.

    State: the ghost (``4 x num_blocks`` keys, oldest dropped first) and the prior counts
    of resident keys (at most ``num_blocks``). ``protect_ticks = 16 x num_blocks``, about
    eight LRU lifetimes at two ticks per block.
    """

    name = "2q"

    def __init__(self, num_blocks: int = DEFAULT_NUM_BLOCKS) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.history_size = 4 * num_blocks
        self.protect_ticks = 16 * num_blocks
        # keyed by block_hash, typed BlockHash | None: policies see only cached (hashed) blocks
        self._ghost: OrderedDict[BlockHash | None, int] = OrderedDict()  # evicted key -> uses so far
        self._resident_prior: dict[BlockHash | None, int] = {}  # cached key -> uses before this residency

    @classmethod
    def for_pool(cls, num_blocks: int) -> TwoQueuePolicy:
        return cls(num_blocks)

    def sort_key(self, block: KVBlock) -> tuple:
        key = block.block_hash
        prior = self._resident_prior.get(key)
        if prior is None:  # first key of this residency: adopt its ghost count
            prior = self._resident_prior[key] = self._ghost.pop(key, 0)
        protected = prior + block.access_count >= 2
        return (block.last_access + (self.protect_ticks if protected else 0),)

    def on_evict(self, block: KVBlock) -> None:
        key = block.block_hash
        uses = self._resident_prior.pop(key, 0) + block.access_count
        self._ghost[key] = uses
        if len(self._ghost) > self.history_size:
            self._ghost.popitem(last=False)


class LogFrequencyPolicy(EvictionPolicy):
    """Hint-free, the recommended one: recency plus a *log-frequency* bonus in ticks,
    ``sort_key = last_access + protect_ticks * log2(min(uses, max_uses))``, where ``uses``
    counts earlier residencies through a ghost history of evicted keys (as ``2q``).

    A once-used block ranks by plain LRU; a block used twice ranks as if used
    ``protect_ticks`` later, four times ``2 x protect_ticks`` later, capped at
    ``max_uses``. Why log: on the Mooncake conversation trace the chance of one more use
    grows with each use (0.26, 0.42, 0.50, 0.58 after 1-4 uses) while the distance to it
    does not shrink, so each doubling of uses buys the same extra time.

    Why a bonus in ticks, not a multiple of the pool: how long a block must wait for its
    next use is a property of the traffic (reuse distance), not of the cache. ``2q``'s bonus
    of 16 x pool blocks over-protects big pools (stale twice-used blocks, below LRU from
    16,000 blocks); a fixed bonus does not. The default, 32,768 ticks (about 16,000 blocks
    of traffic at two ticks per block, ``8 x DEFAULT_NUM_BLOCKS``), was chosen on that
    trace; set ``protect_ticks`` near 1.5-3x the median reuse distance of other traffic.

    State: the ghost (``4 x max(num_blocks, DEFAULT_NUM_BLOCKS)`` keys with their use
    counts, oldest dropped first: a key is a few bytes, so small pools keep a useful
    history too) and the prior counts of resident keys (at most ``num_blocks``).
    """

    name = "logfreq"

    def __init__(
        self, num_blocks: int = DEFAULT_NUM_BLOCKS, *, protect_ticks: int = 8 * DEFAULT_NUM_BLOCKS, max_uses: int = 8
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if protect_ticks < 0 or max_uses < 1:
            raise ValueError(f"need protect_ticks >= 0 and max_uses >= 1, got {protect_ticks}, {max_uses}")
        self.history_size = 4 * max(num_blocks, DEFAULT_NUM_BLOCKS)
        self.protect_ticks = protect_ticks
        self.max_uses = max_uses
        # keyed by block_hash, typed BlockHash | None: policies see only cached (hashed) blocks
        self._ghost: OrderedDict[BlockHash | None, int] = OrderedDict()  # evicted key -> uses so far
        self._resident_prior: dict[BlockHash | None, int] = {}  # cached key -> uses before this residency

    @classmethod
    def for_pool(cls, num_blocks: int) -> LogFrequencyPolicy:
        return cls(num_blocks)

    def uses(self, block: KVBlock) -> int:
        """Uses of ``block``'s key, earlier residencies included (adopts its ghost count
        the first time the key is seen in this residency)."""
        key = block.block_hash
        prior = self._resident_prior.get(key)
        if prior is None:
            prior = self._resident_prior[key] = self._ghost.pop(key, 0)
        return prior + block.access_count

    def sort_key(self, block: KVBlock) -> tuple:
        uses = min(self.uses(block), self.max_uses)
        return (block.last_access + self.protect_ticks * math.log2(uses) if uses > 1 else block.last_access,)

    def on_evict(self, block: KVBlock) -> None:
        key = block.block_hash
        self._ghost[key] = self._resident_prior.pop(key, 0) + block.access_count
        if len(self._ghost) > self.history_size:
            self._ghost.popitem(last=False)


POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, PriorityPolicy, TwoQueuePolicy, LogFrequencyPolicy)
}


def make_policy(name: str, *, num_blocks: int | None = None) -> EvictionPolicy:
    """Build a policy by name; ``num_blocks`` (the pool size) sizes policies that keep
    history (``2q``, ``logfreq``). Raises ``ValueError`` naming ``--eviction-policy`` when unknown."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: --eviction-policy accepts {sorted(POLICIES)}") from None
    return cls.for_pool(DEFAULT_NUM_BLOCKS if num_blocks is None else num_blocks)
