"""vLLM's KV-event wire schema: the one table the publisher encodes by and the decoder
decodes by, and the hash conversions between our block hashes and the wire's.

An event on the wire is a tagged message, positional (``[tag, field, ...]``, vLLM <= 0.11
and kvreuse's default) or a map (``{"type": tag, field: value, ...}``, vLLM after PR
#42892), with the fields in ``WIRE_FIELDS[tag]`` order. The first ``REQUIRED_FIELDS[tag]``
fields are always sent; a sender may omit the rest (older vLLM) or append more (newer vLLM).
The messages are vLLM's names for our records (``kvreuse.events.records``)::

    BlockStored      <-> BlocksStored   (no priority on the wire)
    BlockRemoved     <-> BlocksRemoved
    AllBlocksCleared <-> AllBlocksCleared

The publisher builds them as plain dicts; the decoder parses them into
``kvreuse.events.decoder`` messages and turns those into records.
"""

from __future__ import annotations

from kvreuse.block_hash import BlockHash

WireHash = int | bytes  # an unsigned 64-bit int (vLLM's default) or the full hash bytes

_U64 = (1 << 64) - 1

WIRE_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
REQUIRED_FIELDS: dict[str, int] = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def wire_hash(block_hash: bytes, hash_format: str) -> WireHash:
    """Our block hash as vLLM puts it on the wire (``maybe_convert_block_hash``): with
    ``hash_format="int"`` its low 64 bits as an unsigned int, otherwise the bytes."""
    return int.from_bytes(block_hash, "big") & _U64 if hash_format == "int" else bytes(block_hash)


def hash_from_wire(h: object) -> BlockHash:
    """A wire hash as a ``BlockHash``: bytes as sent; an int as its low 64 bits, 8 bytes
    big-endian (a signed int, as Python's ``hash()`` gives, is read in two's complement).
    Either way its last 8 bytes are the low 64 bits, so ``router.index.index_key`` of the
    result is the unsigned int the publisher sent. Raises ``ValueError`` for anything else."""
    if isinstance(h, bytes):
        return BlockHash(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return BlockHash((h & _U64).to_bytes(8, "big"))
    raise ValueError(f"not a block hash (expected an int or bytes): {h!r:.50}")


def stored_message(
    block_hashes: list[WireHash],
    parent_block_hash: WireHash | None,
    token_ids: list[int],
    block_size: int,
    lora_id: int | None,
    medium: str,
) -> dict:
    """A ``BlockStored`` message as the publisher sends it (a dict tagged by ``type``)."""
    return {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent_block_hash,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
    }
