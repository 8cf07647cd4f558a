"""The block pool's prefix-cache index: registered blocks by key, and the counts that keep
eviction to the leaves of the prefix tree.

A block is a leaf while ``num_cached_children == 0``. Children are also counted by parent key
whether the parent is registered or not (``children``): a lower tier receives a chain's leaf
first (device eviction order), so a block may arrive after its children and must then take
their count. Pure bookkeeping: no events, no heaps (``BlockPool`` does those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.cache.hashing import BlockHash
    from kvreuse.cache.kv_block import KVBlock

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Registered blocks (in use or cached) by key, child counts, blocks per priority."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, KVBlock] = {}
        self.children: dict[BlockHash, int] = {}  # registered blocks per parent key, parent registered or not
        self.held_by_priority: dict[int, int] = {}  # priority -> registered blocks (in use or not)

    def get(self, block_hash: BlockHash | None) -> KVBlock | None:
        """The registered block with this key, or None (also for None)."""
        return None if block_hash is None else self.blocks.get(block_hash)

    def add(self, block: KVBlock) -> None:
        """Enter ``block`` (its key, parent key and priority set, not yet registered): it takes
        the count of children already registered under its key, and a registered parent stops
        being a leaf (its ``version`` bumps, dropping its eviction-heap entry)."""
        key, parent_hash = block.block_hash, block.parent_hash
        self.blocks[key] = block  # type: ignore[index]  # entered blocks are hashed
        self.held_by_priority[block.priority] = self.held_by_priority.get(block.priority, 0) + 1
        block.num_cached_children = self.children.get(key, 0)  # type: ignore[arg-type]  # entered blocks are hashed
        if parent_hash is not None:
            self.children[parent_hash] = self.children.get(parent_hash, 0) + 1
        parent = self.get(parent_hash)
        if parent is not None:
            parent.num_cached_children += 1
            parent.version += 1  # no longer a leaf

    def remove(self, block: KVBlock) -> KVBlock | None:
        """Take a registered ``block`` out of the index (its fields are left to the caller).
        Returns its registered parent when that parent is left a leaf, else None."""
        del self.blocks[block.block_hash]  # type: ignore[arg-type]  # registered blocks are hashed
        self.held_by_priority[block.priority] -= 1
        if block.parent_hash is not None:
            left = self.children[block.parent_hash] - 1
            if left:
                self.children[block.parent_hash] = left
            else:
                del self.children[block.parent_hash]
        parent = self.get(block.parent_hash)
        if parent is not None:
            parent.num_cached_children -= 1
            if parent.num_cached_children == 0:
                return parent
        return None

    def reprioritize(self, old: int, new: int) -> None:
        """A registered block moved from priority ``old`` to ``new``."""
        self.held_by_priority[old] -= 1
        self.held_by_priority[new] = self.held_by_priority.get(new, 0) + 1
