"""Decoder for vLLM-format KV event batches (ours or vLLM's own), for routers and tests.

Two steps, as a parser should be: ``decode_batch`` parses the bytes into the wire's own
messages, exactly as sent; ``to_records`` turns those into ``kvreuse.events.records``, the
one vocabulary every consumer applies (the router's ``KVIndex`` among them).
``decode_records`` does both.

Accepts both encodings vLLM has used for an event inside ``[ts, [events], dp_rank]``
(schema: ``kvreuse.events.wire``):

- positional (msgspec ``array_like`` tagged struct, vLLM <= 0.11 and kvreuse's default):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``
- map (vLLM after PR #42892): ``{"type": "BlockStored", "block_hashes": ..., ...}``

Fields vLLM added later (``lora_name``, ``extra_keys``, ``group_idx``...) are ignored, and
fields an older sender omits are ``None``. An event with an unknown tag decodes to
``UnknownEvent`` so a consumer can skip it; a malformed batch raises ``ValueError``.
In the messages hashes stay as sent: ``int`` (low 64 bits) or ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kvreuse.block_hash import BlockHash
from kvreuse.events.records import DEVICE_LEVEL, AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, StoredBlock
from kvreuse.events.wire import REQUIRED_FIELDS, WIRE_FIELDS, WireHash, hash_from_wire


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The wire's ``BlockStored``: a chain of blocks, ``token_ids`` of all of them in one list."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # None: an older sender that did not say


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The wire's ``BlockRemoved``."""

    block_hashes: list[WireHash]
    medium: str | None = None  # None: an older sender that did not say


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event whose tag this decoder does not know, kept as decoded (``raw``)."""

    tag: str
    raw: Any


# The wire's AllBlocksCleared carries nothing, so it decodes straight to the record.
WireEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent

_MESSAGES: dict[str, type] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def decode_event(obj: Any) -> WireEvent:
    """One event from its positional or map form."""
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], str):
        tag, values = obj[0], dict(zip(WIRE_FIELDS.get(obj[0], ()), obj[1:]))
        present = len(obj) - 1
    elif isinstance(obj, dict) and isinstance(obj.get("type"), str):
        tag, values = obj["type"], obj
        present = None
    else:
        raise ValueError(f"not a KV event (expected a tagged array or a map with 'type'): {obj!r:.200}")
    if tag not in _MESSAGES:
        return UnknownEvent(tag, obj)
    fields, required = WIRE_FIELDS[tag], REQUIRED_FIELDS[tag]
    missing = [f for f in fields[:required] if f not in values] if present is None else fields[present:required]
    if missing:
        raise ValueError(f"{tag} event lacks {', '.join(missing)}")
    return _MESSAGES[tag](**{f: values.get(f) for f in fields})


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


def to_record(event: WireEvent) -> KVEvent | None:
    """The record a wire message stands for; ``None`` for an ``UnknownEvent`` (skip it).

    - ``BlockStored`` -> ``BlocksStored``: block i gets ``token_ids[i*block_size:(i+1)*block_size]``
      (empty where the sender sent fewer), priority ``None`` (the wire has none), level
      ``medium`` or ``DEVICE_LEVEL`` when the sender did not say.
    - ``BlockRemoved`` -> ``BlocksRemoved`` with level ``medium``; ``None`` (not said) means
      wherever the block is held.
    - Hashes become ``BlockHash`` by ``wire.hash_from_wire``.

    Raises ``ValueError`` for ``block_hashes`` that is not a list of ints or bytes, or a ``block_size``
    that is not a positive int.
    """
    if isinstance(event, BlockStored):
        size = event.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"BlockStored: block_size must be a positive int, got {size!r:.50}")
        tokens, level = event.token_ids or [], event.medium or DEVICE_LEVEL
        blocks = tuple(
            StoredBlock(h, tuple(tokens[i * size : (i + 1) * size]), None, level, event.lora_id)
            for i, h in enumerate(_hashes(event.block_hashes))
        )
        parent = None if event.parent_block_hash is None else hash_from_wire(event.parent_block_hash)
        return BlocksStored(parent, blocks, size)
    if isinstance(event, BlockRemoved):
        return BlocksRemoved(_hashes(event.block_hashes), event.medium)
    if isinstance(event, AllBlocksCleared):
        return event
    return None


def _hashes(block_hashes: Any) -> tuple[BlockHash, ...]:
    if not isinstance(block_hashes, (list, tuple)):
        raise ValueError(f"block_hashes must be a list, got {block_hashes!r:.50}")
    return tuple(hash_from_wire(h) for h in block_hashes)


def to_records(events: list[WireEvent]) -> list[KVEvent]:
    """The records of a batch's messages, in order, unknown ones left out."""
    return [r for r in map(to_record, events) if r is not None]


def decode_records(payload: bytes) -> list[KVEvent]:
    """``to_records(decode_batch(payload).events)``: what a consumer applies."""
    return to_records(decode_batch(payload).events)
