"""Eviction policies: each is a small pure object that returns a sort key.

The block pool evicts the evictable block (free, cached, a leaf of the prefix tree)
with the *smallest* key. Keys are computed when a block becomes evictable and again
whenever its priority changes, so a key may read only fields that stay fixed while the
block sits unused: ``priority``, ``last_access`` (a logical tick), ``access_count``,
``depth``, ``expires_at``.

Adding a policy is a few lines: write ``sort_key`` and register it in ``POLICIES``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvreuse.block_pool import KVBlock


class EvictionPolicy(Protocol):
    name: str

    def sort_key(self, block: "KVBlock") -> tuple:
        """Smaller keys are evicted first. Must not modify ``block``."""
        ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def sort_key(self, block: "KVBlock") -> tuple:
        return (block.last_access,)


class PriorityPolicy:
    """TensorRT-LLM: lowest retention priority first, LRU within a priority."""

    name = "priority"

    def sort_key(self, block: "KVBlock") -> tuple:
        return (block.priority, block.last_access)


POLICIES: dict[str, type] = {p.name: p for p in (LRUPolicy, PriorityPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name; ``ValueError`` names ``--eviction-policy`` when unknown."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: --eviction-policy accepts {sorted(POLICIES)}") from None
