"""Decoder for vLLM-format KV event batches (ours or vLLM's own), for routers and tests.

Accepts both encodings vLLM has used for an event inside ``[ts, [events], dp_rank]``:

- positional (msgspec ``array_like`` tagged struct, vLLM <= 0.11 and kvreuse's default):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``
- map (vLLM after PR #42892): ``{"type": "BlockStored", "block_hashes": ..., ...}``

Fields vLLM added later (``lora_name``, ``extra_keys``, ``group_idx``...) are ignored, and
fields an older sender omits are ``None``. An event with an unknown tag decodes to
``UnknownEvent`` so a consumer can skip it; a malformed batch raises ``ValueError``.
Hashes stay as sent: ``int`` (low 64 bits) or ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

WireHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[WireHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    tag: str
    raw: Any


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_FIELDS: dict[str, tuple[type, tuple[str, ...], int]] = {
    # tag: (class, field order on the wire, number of required fields)
    "BlockStored": (BlockStored, ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"), 4),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium"), 1),
    "AllBlocksCleared": (AllBlocksCleared, (), 0),
}


def decode_event(obj: Any) -> WireEvent:
    """One event from its positional or map form."""
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], str):
        tag, values = obj[0], dict(zip(_FIELDS.get(obj[0], (None, ()))[1], obj[1:]))
        present = len(obj) - 1
    elif isinstance(obj, dict) and isinstance(obj.get("type"), str):
        tag, values = obj["type"], obj
        present = None
    else:
        raise ValueError(f"not a KV event (expected a tagged array or a map with 'type'): {obj!r:.200}")
    if tag not in _FIELDS:
        return UnknownEvent(tag, obj)
    cls, fields, required = _FIELDS[tag]
    missing = [f for f in fields[:required] if f not in values] if present is None else fields[present:required]
    if missing:
        raise ValueError(f"{tag} event lacks {', '.join(missing)}")
    return cls(**{f: values.get(f) for f in fields})


def decode_batch(payload: bytes) -> EventBatch:
    """``msgpack([ts, [events], data_parallel_rank?])`` -> ``EventBatch``.
    Also accepts a map-encoded batch (``{"ts", "events", "data_parallel_rank"}``)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types; callers get one
        raise ValueError(f"undecodable KV event batch: {exc}") from exc
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], (list, tuple)):
        raise ValueError(f"not a KV event batch: {obj!r:.200}")
    rank = obj[2] if len(obj) > 2 else None
    if isinstance(obj[0], bool) or not isinstance(obj[0], (int, float)):
        raise ValueError(f"KV event batch: ts must be a number, got {obj[0]!r:.50}")
    return EventBatch(float(obj[0]), [decode_event(e) for e in obj[1]], rank)
