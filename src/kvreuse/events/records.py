"""KV cache events: what the block pool tells the outside world it holds.

The pool builds these plain records and appends them to an ``EventSink``; it never does IO.
Ids and timestamps are assigned by the sink (the bounded event buffer), which wraps each
record in an ``Event``, so the pool stays free of clocks it does not need.

JSON form (HTTP API, SSE, snapshot): every block hash is a lowercase **hex string** of
the full hash (64 characters for sha256, 16 for xxh3_64), never an int, so no consumer
loses bits to a 53-bit JSON number. ``event_to_json`` / ``event_from_json`` round-trip.

A consumer's view of the cache: apply a snapshot, then every event with a larger id, and
it equals the pool's set of registered blocks (hash, parent, priority, level); the router's
``KVIndex`` is such a consumer. ``docs/events.md`` has the consistency model.

The same records are what ``kvreuse.events.decoder.to_records`` makes of vLLM's ZMQ wire
messages, which say less: no priority (``None``), and a removal may not name its level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvreuse.block_hash import BlockHash

DEVICE_LEVEL = "GPU"  # vLLM's name for the primary medium; kept for wire compatibility
# the tiers below it, by vLLM's media names too (the ZMQ events' ``medium`` field carries them)
HOST_LEVEL = "CPU"
DISK_LEVEL = "DISK"
REMOTE_LEVEL = "REMOTE"
OBJECT_LEVEL = "OBJECT"  # an S3 bucket (ours: vLLM names no such medium)
TIER_NAMES = {
    DEVICE_LEVEL: "device",
    HOST_LEVEL: "host",
    DISK_LEVEL: "disk",
    REMOTE_LEVEL: "remote",
    OBJECT_LEVEL: "object",
}  # level -> what users read


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    priority: int | None  # None: not known (vLLM's wire format carries no priority)
    cache_level: str = DEVICE_LEVEL
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class CacheCreated:
    num_blocks_per_level: dict[str, int]
    kv_cache_dtype: str | None = None  # the blocks' KV format (--kv-cache-dtype); None: not told


@dataclass(frozen=True, slots=True)
class BlocksStored:
    parent_hash: BlockHash | None  # key of the block the first stored block continues
    blocks: tuple[StoredBlock, ...]  # a chain: block i+1 continues block i
    block_size: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[BlockHash, ...]
    cache_level: str | None = DEVICE_LEVEL  # None: wherever each block is held (a sender that did not say)


@dataclass(frozen=True, slots=True)
class BlockUpdated:
    block_hash: BlockHash
    old_priority: int | None = None  # both None: the priority did not change
    new_priority: int | None = None
    old_cache_level: str | None = None  # both None: the block did not move
    new_cache_level: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = CacheCreated | BlocksStored | BlocksRemoved | BlockUpdated | AllBlocksCleared


class EventSink(Protocol):
    def append(self, event: KVEvent) -> None:
        """Record one event. Must never block or raise for a full buffer."""
        ...


@dataclass(frozen=True, slots=True)
class Event:
    """One numbered event: ids count from 0 per executor without holes; a consumer that
    sees a hole lost events to the bounded buffer and must resynchronise."""

    event_id: int
    timestamp: float  # time.time() when the buffer received it
    data: KVEvent


# ---------------------------------------------------------------------- JSON
def _hex(h: bytes | None) -> str | None:
    return None if h is None else h.hex()


def _unhex(s: str | None) -> BlockHash | None:
    return None if s is None else _key(s)


def _key(s: str) -> BlockHash:
    """A block hash from its hex (a field that is never null)."""
    return BlockHash(bytes.fromhex(s))


def _diff(old: Any, new: Any) -> dict | None:
    return None if old is None and new is None else {"old_value": old, "new_value": new}


def record_to_json(data: KVEvent) -> dict:
    """The ``data`` object of an event's JSON form (field names as in TensorRT-LLM)."""
    if isinstance(data, BlocksStored):
        return {
            "type": "stored",
            "parent_hash": _hex(data.parent_hash),
            "block_size": data.block_size,
            "blocks": [
                {
                    "block_hash": b.block_hash.hex(),
                    "token_ids": list(b.token_ids),
                    "priority": b.priority,
                    "cache_level": b.cache_level,
                    "lora_id": b.lora_id,
                }
                for b in data.blocks
            ],
        }
    if isinstance(data, BlocksRemoved):
        return {
            "type": "removed",
            "block_hashes": [h.hex() for h in data.block_hashes],
            "cache_level": data.cache_level,
        }
    if isinstance(data, BlockUpdated):
        return {
            "type": "updated",
            "block_hash": data.block_hash.hex(),
            "priority": _diff(data.old_priority, data.new_priority),
            "cache_level": _diff(data.old_cache_level, data.new_cache_level),
        }
    if isinstance(data, CacheCreated):
        created = {"type": "created", "num_blocks_per_cache_level": dict(data.num_blocks_per_level)}
        return created if data.kv_cache_dtype is None else {**created, "kv_cache_dtype": data.kv_cache_dtype}
    if isinstance(data, AllBlocksCleared):
        return {"type": "cleared"}
    raise TypeError(f"not a KV event record: {data!r}")


def record_from_json(d: dict) -> KVEvent:
    """Inverse of ``record_to_json``. Raises ``ValueError`` for an unknown ``type``."""
    kind = d.get("type")
    if kind == "stored":
        blocks = tuple(
            StoredBlock(_key(b["block_hash"]), tuple(b["token_ids"]), b["priority"], b["cache_level"], b.get("lora_id"))
            for b in d["blocks"]
        )
        return BlocksStored(_unhex(d["parent_hash"]), blocks, d["block_size"])
    if kind == "removed":
        return BlocksRemoved(tuple(_key(h) for h in d["block_hashes"]), d.get("cache_level", DEVICE_LEVEL))
    if kind == "updated":
        p, c = d.get("priority") or {}, d.get("cache_level") or {}
        return BlockUpdated(
            _key(d["block_hash"]),
            p.get("old_value"),
            p.get("new_value"),
            c.get("old_value"),
            c.get("new_value"),
        )
    if kind == "created":
        return CacheCreated(dict(d["num_blocks_per_cache_level"]), d.get("kv_cache_dtype"))
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def event_to_json(event: Event) -> dict:
    return {"event_id": event.event_id, "timestamp": event.timestamp, "data": record_to_json(event.data)}


def event_from_json(d: dict) -> Event:
    return Event(d["event_id"], d["timestamp"], record_from_json(d["data"]))


# ---------------------------------------------------------------------- snapshot
@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    priority: int
    cache_level: str
    depth: int  # position in its chain; snapshots list parents before children
    in_use: bool  # held by a running request (not evictable now)


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every registered block, exactly as of event ``last_event_id`` (-1: before any)."""

    last_event_id: int
    block_size: int
    blocks: tuple[SnapshotBlock, ...]

    def to_json(self) -> dict:
        return {
            "last_event_id": self.last_event_id,
            "block_size": self.block_size,
            "blocks": [
                {
                    "block_hash": b.block_hash.hex(),
                    "parent_hash": _hex(b.parent_hash),
                    "token_ids": list(b.token_ids),
                    "priority": b.priority,
                    "cache_level": b.cache_level,
                    "depth": b.depth,
                    "in_use": b.in_use,
                }
                for b in self.blocks
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> KVSnapshot:
        blocks = tuple(
            SnapshotBlock(
                _key(b["block_hash"]),
                _unhex(b["parent_hash"]),
                tuple(b["token_ids"]),
                b["priority"],
                b["cache_level"],
                b["depth"],
                b["in_use"],
            )
            for b in d["blocks"]
        )
        return cls(d["last_event_id"], d["block_size"], blocks)


def take_snapshot(pool: Any, last_event_id: int) -> KVSnapshot:
    """Snapshot of a ``BlockPool``'s registered blocks (or of several pools': the device pool
    and the tiers below it, each block labelled with its pool's level; a block is held in
    one tier at a time), labelled with ``last_event_id``.

    The caller guarantees that the pool does not change and no event is appended while
    this runs (it holds the engine's step lock, or runs on the engine thread), and passes
    the id of the last event the pool emitted; see ``EventBuffer.snapshot``.
    """
    pools = list(pool) if isinstance(pool, (list, tuple)) else [pool]
    blocks = sorted(((b, p.cache_level) for p in pools for b in p.cached_hashes()), key=lambda bl: bl[0].depth)
    return KVSnapshot(
        last_event_id,
        pools[0].block_size,
        tuple(
            SnapshotBlock(b.block_hash, b.parent_hash, b.token_ids, b.priority, level, b.depth, b.ref_count > 0)
            for b, level in blocks
        ),
    )
