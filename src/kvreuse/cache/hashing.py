"""The one block-hash function, shared by the engine, the router and the simulator.

A block key chains its parent's key, so equal keys mean equal prefixes::

    key(block i) = H(key(block i-1) or ROOT, token ids of block i, extra keys of block i)

The extra keys of the *first* block hold the model identity and the request's
``cache_salt`` (tenant isolation); PML modules put their schema hash and module name
there, so a module's blocks never match a prefix with the same text at other positions.
Later blocks inherit all of that through the parent key.

SHA-256 is the default (collision-safe across tenants); ``xxh3_64`` is the fast option.
Both return ``bytes`` so every consumer (events, router index) sees one type.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

import msgpack

from kvreuse.block_hash import BlockHash  # the value type, defined below every layer; importable from here

HASH_ALGORITHMS = ("sha256", "xxh3_64")

_ROOT = b"\x00" * 32  # stands for "no parent" so the first block is hashed like any other


def _xxh3_64(data: bytes) -> bytes:
    import xxhash  # optional dependency path; imported lazily so sha256 users never need it

    return xxhash.xxh3_64_digest(data)


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
    algorithm: str = "sha256",
) -> BlockHash:
    """Key of one block.

    ``extra_keys`` must be msgpack-serialisable (str, int, bytes, tuples of those).
    Raises ``ValueError`` for an unknown ``algorithm``.
    """
    payload = b"".join(
        (
            parent if parent is not None else _ROOT,
            struct.pack(f"<{len(token_ids)}q", *token_ids),
            msgpack.packb(extra_keys, use_bin_type=True),
        )
    )
    if algorithm == "sha256":
        return BlockHash(hashlib.sha256(payload).digest())
    if algorithm == "xxh3_64":
        return BlockHash(_xxh3_64(payload))
    raise ValueError(f"unknown hash algorithm {algorithm!r}: --prefix-hash-algorithm accepts {HASH_ALGORITHMS}")


def root_extra_keys(model_id: str, cache_salt: str | None = None) -> tuple:
    """Extra keys of a request's first block: model identity and tenant salt."""
    return (model_id,) if cache_salt is None else (model_id, "salt", cache_salt)


def _chain(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    first_extra: tuple,
    algorithm: str,
    *,
    partial_tail: bool,
) -> Iterator[BlockHash]:
    """The chain walk itself: keys of consecutive blocks of ``token_ids`` after ``parent``,
    ``first_extra`` folded into the first of them only."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size} (--block-size)")
    stop = len(token_ids) if partial_tail else len(token_ids) - block_size + 1
    extra = first_extra
    for start in range(0, max(stop, 0), block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra, algorithm)
        extra = ()
        yield parent


def extend_chain(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    *,
    root_extra: tuple,
    algorithm: str = "sha256",
    upto_tokens: int | None = None,
    partial_tail: bool = False,
) -> list[BlockHash]:
    """Append to ``hashes`` (the keys of blocks ``0..len(hashes)-1`` of ``token_ids``, as this
    function made them) the keys of the following blocks: every full block within the first
    ``upto_tokens`` tokens (default: all), and with ``partial_tail`` the trailing partial
    block too (PML modules key their last, partial block). ``root_extra`` goes into block 0
    only. The incremental form of the chain: a sequence calls it as its tokens grow and
    hashes each block once. Mutates and returns ``hashes``."""
    bs = block_size
    end = len(token_ids) if upto_tokens is None else min(upto_tokens, len(token_ids))
    done = len(hashes)
    parent = hashes[-1] if hashes else None
    hashes.extend(
        _chain(parent, token_ids[done * bs : end], bs, () if done else root_extra, algorithm, partial_tail=partial_tail)
    )
    return hashes


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    model_id: str,
    cache_salt: str | None = None,
    algorithm: str = "sha256",
    first_extra_keys: tuple | None = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of every *full* block of ``token_ids`` (a trailing partial block gets none).

    ``first_extra_keys`` replaces the default ``root_extra_keys(model_id, cache_salt)``
    for the first block (PML modules use it); ``parent`` continues an existing chain,
    in which case the first block gets no extra keys (the parent already carries them).
    """
    if parent is None:
        extra = first_extra_keys if first_extra_keys is not None else root_extra_keys(model_id, cache_salt)
    else:
        extra = ()
    return list(_chain(parent, token_ids, block_size, extra, algorithm, partial_tail=False))
