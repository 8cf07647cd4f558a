"""One block's KV and metadata as bytes, with a checksum: the unit the disk and remote tiers store.

Layout (all integers little-endian)::

    magic  b"KVRB"                       4 bytes
    version                              1 byte   (namespace.FORMAT_VERSION)
    header length H                      4 bytes
    header (msgpack map)                 H bytes  namespace fields, key, parent, token ids, dtype, shape
    payload                              the tensor's raw bytes, C order, prod(shape) * itemsize
    checksum xxh3_128(everything above)  16 bytes

Contract of ``decode_block``: it returns a ``BlockRecord`` only when every check passes, and
raises otherwise, never returning partial or unverified data:

- ``CorruptBlock`` (a ``ValueError``): truncated or padded data, bad magic or version, checksum
  mismatch, a header that does not parse, a payload whose length disagrees with shape x dtype,
  a shape or dtype other than the reader asked for, a key other than the one looked up, or
  non-finite values (NaN / inf) in the KV;
- ``ForeignBlock`` (a ``CorruptBlock``): a well-formed block written under another model
  fingerprint, hash algorithm or block size. Callers that only need "refuse" catch
  ``CorruptBlock``; stores count the two apart.

The checksum guards against corruption (torn writes, bit rot, truncation), not against a
malicious writer with access to the store: anyone who can write the store can write a valid block.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from kvreuse.cache.hashing import BlockHash
from kvreuse.tiers.namespace import FORMAT_VERSION, TierNamespace

MAGIC = b"KVRB"
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length
_CHECKSUM_BYTES = 16
_MAX_HEADER_BYTES = 1 << 20  # a block's token ids and names fit many times over

# Names are stored, never pickled dtypes: only these types are KV. uint8: 8-bit rows, each
# head_dim int8 or float8 values then their bf16 scale (engine/kv_quant.py, --kv-cache-dtype
# int8 / fp8; the format itself is in the fingerprint, so rows are never read as another's).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
}
INT8_SCALE_BYTES = 2  # the bf16 scale closing each uint8 row
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CorruptBlock(ValueError):
    """Stored block bytes that do not verify; the data must not be used."""


class ForeignBlock(CorruptBlock):
    """A well-formed block of another namespace (model fingerprint, hash algorithm, block size)."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One block as the tiers move it. ``kv`` is on the CPU, contiguous."""

    key: BlockHash  # this block's chained key (hashing.hash_block)
    parent_key: BlockHash | None  # the previous block's key; None for a chain's first block
    token_ids: tuple[int, ...]  # the block's tokens (block_size of them, fewer for a PML tail)
    kv: torch.Tensor  # [layers, 2, kv_heads, block_size, head_dim]


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a block says it is, read from its header alone: not verified (no checksum)."""

    key: BlockHash
    parent_key: BlockHash | None
    token_ids: tuple[int, ...]


HEADER_PREFIX_BYTES = _PREFIX.size  # magic, version and header length: read these first


def header_bytes(prefix: bytes | bytearray | memoryview) -> int:
    """How many leading bytes of a block hold its header (prefix included), from its first
    ``HEADER_PREFIX_BYTES``. Raises ``CorruptBlock`` for a bad magic or header length,
    ``ForeignBlock`` for another format version."""
    if len(prefix) < _PREFIX.size:
        raise CorruptBlock(f"truncated block: {len(prefix)} bytes")
    magic, version, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptBlock(f"not a kvreuse block (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ForeignBlock(f"block format version {version}, this build reads {FORMAT_VERSION}")
    if header_len > _MAX_HEADER_BYTES:
        raise CorruptBlock(f"header length {header_len} exceeds {_MAX_HEADER_BYTES}")
    return _PREFIX.size + header_len


def decode_header(data: bytes | bytearray | memoryview, namespace: TierNamespace) -> BlockHeader:
    """The key, parent and tokens in a block's first ``header_bytes`` bytes (or the whole
    block), for listing a store without reading its KV. Checks the framing, the header's
    fields and the namespace, not the checksum: ``decode_block`` still verifies on use.
    Raises ``CorruptBlock`` / ``ForeignBlock`` as ``decode_block`` would for those parts."""
    view = memoryview(data).cast("B")
    end = header_bytes(view[: _PREFIX.size])
    if end > len(view):
        raise CorruptBlock(f"header of {end} bytes, only {len(view)} read")
    header = _parse_header(view[_PREFIX.size : end])
    _check_namespace(header, namespace)
    parent = header["parent_key"]
    return BlockHeader(
        BlockHash(header["key"]), None if parent is None else BlockHash(parent), tuple(header["token_ids"])
    )


def encode_block(record: BlockRecord, namespace: TierNamespace) -> bytes:
    """Bytes of ``record`` under ``namespace``. Raises ``ValueError`` for a record that could
    never decode: wrong rank, block dimension != namespace.block_size, more tokens than
    the block holds, an unsupported dtype. Copies a device tensor to the CPU."""
    kv = record.kv
    if kv.dim() != 5:
        raise ValueError(f"kv must be [layers, 2, kv_heads, block_size, head_dim], got shape {tuple(kv.shape)}")
    if kv.shape[1] != 2 or kv.shape[3] != namespace.block_size:
        raise ValueError(f"kv shape {tuple(kv.shape)} is not [layers, 2, kv_heads, {namespace.block_size}, head_dim]")
    if len(record.token_ids) > namespace.block_size:
        raise ValueError(f"{len(record.token_ids)} token ids do not fit a block of {namespace.block_size}")
    if kv.dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}; supported: {sorted(DTYPES)}")
    header = msgpack.packb(
        {
            "fingerprint": namespace.model_fingerprint,
            "hash_algorithm": namespace.hash_algorithm,
            "block_size": namespace.block_size,
            "key": bytes(record.key),
            "parent_key": None if record.parent_key is None else bytes(record.parent_key),
            "token_ids": list(record.token_ids),
            "dtype": _DTYPE_NAMES[kv.dtype],
            "shape": list(kv.shape),
        },
        use_bin_type=True,
    )
    payload = kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()  # [nbytes]
    body = b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header, payload))
    return body + xxhash.xxh3_128_digest(body)


def decode_block(
    data: bytes | bytearray | memoryview,
    namespace: TierNamespace,
    *,
    key: BlockHash | None = None,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> BlockRecord:
    """The verified record in ``data``; see the module docstring for what is refused.

    ``key``, ``shape`` and ``dtype``, when given, are what the reader expects (the key it
    looked up, its pool's per-block layout); a mismatch is a ``CorruptBlock``."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + _CHECKSUM_BYTES:
        raise CorruptBlock(f"truncated block: {len(view)} bytes")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock(f"not a kvreuse block (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ForeignBlock(f"block format version {version}, this build reads {FORMAT_VERSION}")
    body, checksum = view[:-_CHECKSUM_BYTES], view[-_CHECKSUM_BYTES:]
    if xxhash.xxh3_128_digest(body) != bytes(checksum):
        raise CorruptBlock("checksum mismatch (truncated or corrupted block)")
    if header_len > _MAX_HEADER_BYTES or _PREFIX.size + header_len > len(body):
        raise CorruptBlock(f"header length {header_len} exceeds the block")
    header = _parse_header(body[_PREFIX.size : _PREFIX.size + header_len])
    _check_namespace(header, namespace)
    record_key = BlockHash(header["key"])
    if key is not None and record_key != key:
        raise CorruptBlock(f"block holds key {record_key.hex()}, expected {bytes(key).hex()}")
    record_dtype = DTYPES.get(header["dtype"])
    if record_dtype is None:
        raise CorruptBlock(f"unsupported dtype {header['dtype']!r}")
    if dtype is not None and record_dtype != dtype:
        raise CorruptBlock(f"block dtype {record_dtype}, expected {dtype}")
    record_shape = tuple(header["shape"])
    if len(record_shape) != 5 or record_shape[3] != namespace.block_size or any(d <= 0 for d in record_shape):
        raise CorruptBlock(f"block shape {record_shape} is not [layers, 2, kv_heads, {namespace.block_size}, head_dim]")
    if shape is not None and record_shape != tuple(shape):
        raise CorruptBlock(f"block shape {record_shape}, expected {tuple(shape)}")
    payload = body[_PREFIX.size + header_len :]
    expected_bytes = math.prod(record_shape) * record_dtype.itemsize
    if len(payload) != expected_bytes:
        raise CorruptBlock(f"payload of {len(payload)} bytes, shape x dtype needs {expected_bytes}")
    buffer = bytearray(payload)  # the one copy: the record owns writable memory
    if not _all_finite(buffer, record_dtype, record_shape[-1]):
        raise CorruptBlock("block KV holds non-finite values")
    kv = torch.frombuffer(buffer, dtype=record_dtype).reshape(record_shape)
    token_ids = tuple(header["token_ids"])
    if len(token_ids) > namespace.block_size:
        raise CorruptBlock(f"{len(token_ids)} token ids in a block of {namespace.block_size}")
    parent = header["parent_key"]
    return BlockRecord(record_key, None if parent is None else BlockHash(parent), token_ids, kv)


# Per float dtype: the unsigned integer of its width and its exponent bits. All exponent bits
# set means inf or NaN, in every IEEE-like format (bf16 included, which numpy cannot name).
_EXPONENT_MASKS: dict[torch.dtype, tuple[type[np.unsignedinteger[Any]], int]] = {
    torch.float16: (np.uint16, 0x7C00),
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float32: (np.uint32, 0x7F800000),
    torch.float64: (np.uint64, 0x7FF0000000000000),
}


def _all_finite(buffer: bytearray, dtype: torch.dtype, row: int) -> bool:
    """No inf / NaN among the values in ``buffer`` (rows of ``row`` elements); for 8-bit rows
    (uint8) among their bf16 scales (int8 values are never non-finite; fp8 writes saturate). Bit tests in numpy,
    single-threaded: an IO thread decoding blocks does not contend for torch's intra-op pool
    with the engine."""
    if dtype == torch.uint8:
        if row <= INT8_SCALE_BYTES:
            return False  # no room for values beside the scale: not int8 rows
        rows = np.frombuffer(buffer, dtype=np.uint8).reshape(-1, row)  # [rows, head_dim + 2]
        scales = np.ascontiguousarray(rows[:, -INT8_SCALE_BYTES:]).view(np.uint16)  # [rows, 1] bf16 bits
        return not bool(np.any(np.bitwise_and(scales, np.uint16(0x7F80)) == np.uint16(0x7F80)))
    uint, mask = _EXPONENT_MASKS[dtype]
    bits = np.frombuffer(buffer, dtype=uint)  # [values], a view
    return not bool(np.any(np.bitwise_and(bits, uint(mask)) == uint(mask)))


_HEADER_TYPES: dict[str, type | tuple[type, ...]] = {
    "fingerprint": str,
    "hash_algorithm": str,
    "block_size": int,
    "key": bytes,
    "parent_key": (bytes, type(None)),
    "token_ids": list,
    "dtype": str,
    "shape": list,
}


def _parse_header(raw: memoryview) -> dict:
    try:
        header = msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptBlock("header is not a map")
    for field, types in _HEADER_TYPES.items():
        if not isinstance(header.get(field), types):
            raise CorruptBlock(f"header field {field!r} missing or mistyped")
    if not all(isinstance(t, int) for t in header["token_ids"]) or not all(isinstance(d, int) for d in header["shape"]):
        raise CorruptBlock("header token_ids / shape must be integers")
    return header


def _check_namespace(header: dict, namespace: TierNamespace) -> None:
    for field, expected in (
        ("fingerprint", namespace.model_fingerprint),
        ("hash_algorithm", namespace.hash_algorithm),
        ("block_size", namespace.block_size),
    ):
        if header[field] != expected:
            raise ForeignBlock(f"block of another namespace: {field} {header[field]!r}, expected {expected!r}")
