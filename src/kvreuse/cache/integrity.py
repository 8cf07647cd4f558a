"""``BlockPool.check_integrity``: the pool's bookkeeping checked against a recount, O(n).

For tests and idle checks (mini-sglang runs the same whenever its scheduler is idle). Reads
only the pool's read-only ``PoolView`` (``BlockPool.view()``), never the pool itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.cache.hashing import BlockHash
    from kvreuse.cache.kv_block import KVBlock

__all__ = ["PoolView", "check_pool"]


@dataclass(frozen=True)
class PoolView:
    """A block pool's bookkeeping, read-only: what ``check_pool`` recounts."""

    num_blocks: int
    blocks: Sequence[KVBlock]  # every block, by id
    free: Sequence[KVBlock]  # the free list
    cached: Mapping[BlockHash, KVBlock]  # the prefix index: registered blocks by key
    children: Mapping[BlockHash, int]  # registered blocks per parent key
    held_by_priority: Mapping[int, int]  # registered blocks per priority (zero counts may stay)
    num_cached_free: int  # registered blocks nobody holds


def check_pool(pool: PoolView) -> None:
    """Raise ``RuntimeError`` if ``pool``'s bookkeeping is inconsistent: free + cached + in use
    == total, ref counts >= 0, index, children and per-priority counts agree, and no block in
    use has a running duration. Reads only."""

    free_ids = {b.block_id for b in pool.free}
    if len(free_ids) != len(pool.free):
        raise RuntimeError("a block appears twice in the free list")
    n_cached_free = n_used = 0
    children: dict[BlockHash | None, int] = {}  # by parent; None (a root's) is never counted
    for block in pool.blocks:
        if block.ref_count < 0:
            raise RuntimeError(f"block {block.block_id} has ref_count {block.ref_count}")
        if block.block_id in free_ids:
            if block.ref_count or block.block_hash is not None:
                raise RuntimeError(f"free block {block.block_id} is held or keyed")
        elif block.ref_count > 0:
            n_used += 1
        elif block.block_hash is not None:
            n_cached_free += 1
        else:
            raise RuntimeError(f"block {block.block_id} is lost: unheld, unkeyed and not free")
        if block.block_hash is not None:
            if pool.cached.get(block.block_hash) is not block:
                raise RuntimeError(f"block {block.block_id} is keyed but not in the index")
            if block.parent_hash in pool.cached:
                children[block.parent_hash] = children.get(block.parent_hash, 0) + 1
    for block in pool.cached.values():
        if block.num_cached_children != children.get(block.block_hash, 0):
            raise RuntimeError(
                f"block {block.block_id} counts {block.num_cached_children} children, index has "
                f"{children.get(block.block_hash, 0)}"
            )
    all_children: dict = {}
    for block in pool.cached.values():
        if block.parent_hash is not None:
            all_children[block.parent_hash] = all_children.get(block.parent_hash, 0) + 1
    if all_children != dict(pool.children):
        raise RuntimeError("children counted by parent key disagree with the index")
    held: dict[int, int] = {}
    for block in pool.cached.values():
        held[block.priority] = held.get(block.priority, 0) + 1
        if block.ref_count and block.expires_at is not None:
            raise RuntimeError(f"block {block.block_id} is in use but its duration is running")
    if held != {p: n for p, n in pool.held_by_priority.items() if n}:
        raise RuntimeError(f"blocks by priority {dict(pool.held_by_priority)} != actual {held}")
    if n_cached_free != pool.num_cached_free:
        raise RuntimeError(f"cached-free count {pool.num_cached_free} != actual {n_cached_free}")
    if len(pool.free) + n_cached_free + n_used != pool.num_blocks:
        raise RuntimeError("free + cached + in use != total")
