"""What the cache manager reads and writes of a request: the ``CachedSequence`` protocol.

``engine.sequence.Sequence`` has these members. The cache names no engine type, so it stays
below the engine (and the simulators use it without the engine or torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvreuse.cache.hashing import BlockHash
    from kvreuse.cache.kv_block import KVBlock
    from kvreuse.cache.retention import KvCacheRetentionConfig

__all__ = ["CachedSequence", "SequenceContext"]


class SequenceContext(Protocol):
    """A request's read-only context KV in front of its prompt (``engine.context.PromptContext``)."""

    @property
    def num_reused(self) -> int:
        """Context keys found cached rather than computed (counted as cached tokens)."""
        ...

    def reused_by_level(self, device_level: str) -> dict[str, int]:
        """``num_reused`` by the tier the keys were found in."""
        ...

    def release(self) -> None:
        """Drop the context's block references."""
        ...


class CachedSequence(Protocol):
    """One request as the cache manager sees it: its tokens and keys (read), its own blocks
    (through the block methods) and its cache counters (written)."""

    num_registered_blocks: int  # leading own blocks already in the prefix index
    num_computed_tokens: int  # tokens whose KV is in the pool
    num_cached_tokens: int  # prompt tokens served from the cache at admission
    cached_tokens_by_tier: dict[str, int]  # of those, per tier

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def retention(self) -> KvCacheRetentionConfig | None: ...

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Keys of its full blocks so far; the manager extends the list in place."""
        ...

    @property
    def prompt_positions(self) -> list[int] | None:
        """Explicit RoPE positions (such a prompt is never matched nor registered), or None."""
        ...

    @property
    def context(self) -> SequenceContext | None: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_context_tokens(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def blocks(self) -> Sequence[KVBlock]:
        """Own blocks, in token order."""
        ...

    def append_blocks(self, blocks: Iterable[KVBlock]) -> None: ...

    def replace_block(self, index: int, block: KVBlock) -> None: ...

    def drop_tail_blocks(self, keep: int) -> Sequence[KVBlock]:
        """Remove the blocks after the first ``keep`` and return them."""
        ...

    def clear_blocks(self) -> None: ...
