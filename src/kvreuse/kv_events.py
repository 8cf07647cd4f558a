"""KV cache events: what the block pool tells the outside world it holds.

The pool builds these plain records and appends them to an ``EventSink``; it never does IO.
Ids and timestamps are assigned by the sink (the bounded event buffer), so the pool stays
free of clocks it does not need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvreuse.hashing import BlockHash

DEVICE_LEVEL = "GPU"  # vLLM's name for the primary medium; kept for wire compatibility


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    priority: int
    cache_level: str = DEVICE_LEVEL
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class CacheCreated:
    num_blocks_per_level: dict[str, int]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    parent_hash: BlockHash | None  # key of the block the first stored block continues
    blocks: tuple[StoredBlock, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[BlockHash, ...]
    cache_level: str = DEVICE_LEVEL


@dataclass(frozen=True, slots=True)
class BlockUpdated:
    block_hash: BlockHash
    old_priority: int | None = None
    new_priority: int | None = None
    old_cache_level: str | None = None
    new_cache_level: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = CacheCreated | BlocksStored | BlocksRemoved | BlockUpdated | AllBlocksCleared


class EventSink(Protocol):
    def append(self, event: KVEvent) -> None:
        """Record one event. Must never block or raise for a full buffer."""
        ...
