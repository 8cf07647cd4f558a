"""One KV block's bookkeeping: its id, references, prefix-cache key and retention.

The block holds no tensors: ``block_id`` indexes the model runner's KV storage. The
``BlockPool`` owns every block and is the only writer of these fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.cache.hashing import BlockHash

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int  # index into the runner's KV storage; fixed for the pool's life
    ref_count: int = 0  # running requests holding this block
    block_hash: BlockHash | None = None  # set once full and registered in the prefix index
    parent_hash: BlockHash | None = None  # key of the previous block in its chain
    token_ids: tuple[int, ...] = ()  # tokens of a registered block, checked on every hit
    depth: int = 0  # position of the block in its chain (0 = first block)
    priority: int = DEFAULT_PRIORITY  # retention priority 0-100
    duration_s: float | None = None  # how long the priority holds once released (None = until evicted)
    expires_at: float | None = None  # clock time when priority falls back; set only while released
    last_access: int = 0  # logical tick of the last acquire/release (LRU order, exact in tests)
    access_count: int = 0  # hits + first use, for frequency-aware policies
    num_cached_children: int = 0  # registered blocks whose parent is this one
    version: int = 0  # bumps invalidate this block's heap entries

    def reset(self) -> None:
        """Back to a bare block (no key, default retention); ``version`` bumps so any heap
        entry of its old life is stale. The pool calls it when a block leaves the index."""
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()
        self.depth = 0
        self.priority = DEFAULT_PRIORITY
        self.duration_s = None
        self.expires_at = None
        self.access_count = 0
        self.num_cached_children = 0
        self.version += 1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints: blocks needed for ``a`` tokens of ``b`` per block."""
    return -(-a // b)


def block_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """KV slots of token indices ``start..end-1`` of a sequence whose blocks, in token order,
    are ``block_ids``: token ``i`` lives at ``block_ids[i // bs] * bs + i % bs``."""
    bs = block_size
    return [block_ids[i // bs] * bs + i % bs for i in range(start, end)]


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """What the pool knew of a block it just evicted: enough for a lower tier to keep it
    (its KV stays in slot ``block_id`` until the caller writes there)."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    depth: int
    priority: int
    duration_s: float | None

    @staticmethod
    def of(block: KVBlock) -> EvictedBlock:
        assert block.block_hash is not None  # only cached (hashed) blocks are evicted
        return EvictedBlock(
            block.block_id,
            block.block_hash,
            block.parent_hash,
            block.token_ids,
            block.depth,
            block.priority,
            block.duration_s,
        )
