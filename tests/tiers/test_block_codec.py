"""The block codec: a round trip is exact, and every kind of bad data is refused by type."""

import struct

import msgpack
import pytest
import torch
import xxhash

from kvreuse.tiers.block_codec import BlockRecord, CorruptBlock, ForeignBlock, decode_block, encode_block
from kvreuse.tiers.namespace import TierNamespace

from .conftest import BLOCK_SIZE, NS, OTHER_MODEL, SHAPE, make_record


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact(dtype):
    record = make_record(1, dtype)
    data = encode_block(record, NS)
    # 4 + 1 + 4 prefix, header, 256 values, 16 checksum bytes
    header_len = struct.unpack_from("<I", data, 5)[0]
    assert len(data) == 9 + header_len + 256 * dtype.itemsize + 16
    out = decode_block(data, NS, key=record.key, shape=SHAPE, dtype=dtype)
    assert out.key == record.key and out.parent_key == record.parent_key
    assert out.token_ids == (4, 5, 6, 7)
    assert out.kv.dtype == dtype and tuple(out.kv.shape) == SHAPE
    assert torch.equal(out.kv, record.kv)
    out.kv.add_(1)  # the decoded tensor is writable and owns its memory
    assert decode_block(data, NS).kv[0, 0, 0, 0, 0].item() == 1000.0


def test_first_block_has_no_parent():
    out = decode_block(encode_block(make_record(0), NS), NS)
    assert out.parent_key is None and out.token_ids == (0, 1, 2, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_largest_finite_values_are_accepted(dtype):
    info = torch.finfo(dtype)
    kv = torch.tensor([info.max, -info.max, info.tiny, 0.0], dtype=dtype).repeat(64).reshape(SHAPE)
    record = make_record(0)
    out = decode_block(encode_block(BlockRecord(record.key, None, (), kv), NS), NS)
    assert torch.equal(out.kv, kv) and out.token_ids == ()


def test_accepts_memoryview_and_bytearray(record):
    data = encode_block(record, NS)
    assert torch.equal(decode_block(memoryview(data), NS).kv, record.kv)
    assert torch.equal(decode_block(bytearray(data), NS).kv, record.kv)


@pytest.mark.parametrize("cut", [0, 5, 20, -17, -1])
def test_truncated_is_refused(record, cut):
    data = encode_block(record, NS)
    with pytest.raises(CorruptBlock):
        decode_block(data[:cut], NS)


def test_padded_is_refused(record):
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(encode_block(record, NS) + b"\x00", NS)


def test_flipped_payload_bit_is_refused(record):
    data = bytearray(encode_block(record, NS))
    data[-100] ^= 0x01
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bytes(data), NS)


def test_bad_magic_is_refused(record):
    data = b"XXXX" + encode_block(record, NS)[4:]
    with pytest.raises(CorruptBlock, match="magic"):
        decode_block(data, NS)


@pytest.mark.parametrize(
    "other",
    [
        OTHER_MODEL,
        TierNamespace("ab" * 32, "xxh3_64", BLOCK_SIZE),
    ],
)
def test_foreign_namespace_is_refused(record, other):
    data = encode_block(record, NS)
    with pytest.raises(ForeignBlock, match="another namespace"):
        decode_block(data, other)


def test_other_block_size_is_foreign(record):
    ns8 = TierNamespace("ab" * 32, "sha256", 8)
    with pytest.raises(ValueError, match="kv_heads, 8, head_dim"):
        encode_block(record, ns8)  # a 4-token block cannot be written under block size 8
    kv8 = torch.zeros(2, 2, 2, 8, 8)
    data = encode_block(BlockRecord(record.key, None, tuple(range(8)), kv8), ns8)
    with pytest.raises(ForeignBlock, match="block_size 8, expected 4"):
        decode_block(data, NS)


def test_wrong_key_shape_dtype_are_refused(record):
    data = encode_block(record, NS)
    with pytest.raises(CorruptBlock, match="expected"):
        decode_block(data, NS, key=make_record(0).key)
    with pytest.raises(CorruptBlock, match="shape"):
        decode_block(data, NS, shape=(2, 2, 1, BLOCK_SIZE, 16))
    with pytest.raises(CorruptBlock, match="dtype"):
        decode_block(data, NS, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(record, bad, dtype):
    kv = record.kv.to(dtype)
    kv[1, 1, 1, 3, 7] = bad
    data = encode_block(BlockRecord(record.key, record.parent_key, record.token_ids, kv), NS)
    with pytest.raises(CorruptBlock, match="non-finite"):
        decode_block(data, NS)


def _reframe(header: dict, payload: bytes) -> bytes:
    """A block with a valid checksum around an arbitrary header: checks beyond the checksum."""
    raw = msgpack.packb(header, use_bin_type=True)
    body = struct.pack("<4sBI", b"KVRB", 1, len(raw)) + raw + payload
    return body + xxhash.xxh3_128_digest(body)


def _header(**changes) -> dict:
    header = {
        "fingerprint": "ab" * 32,
        "hash_algorithm": "sha256",
        "block_size": BLOCK_SIZE,
        "key": b"k" * 32,
        "parent_key": None,
        "token_ids": [1, 2, 3, 4],
        "dtype": "float32",
        "shape": list(SHAPE),
    }
    return header | changes


def test_checksummed_but_inconsistent_blocks_are_refused():
    payload = bytes(256 * 4)
    assert decode_block(_reframe(_header(), payload), NS).token_ids == (1, 2, 3, 4)
    with pytest.raises(CorruptBlock, match="payload of 1020 bytes"):
        decode_block(_reframe(_header(), payload[:-4]), NS)
    with pytest.raises(CorruptBlock, match="unsupported dtype"):
        decode_block(_reframe(_header(dtype="int8"), payload), NS)
    with pytest.raises(CorruptBlock, match="shape"):
        decode_block(_reframe(_header(shape=[2, 2, 2, 8, 4]), payload), NS)
    with pytest.raises(CorruptBlock, match="token ids"):
        decode_block(_reframe(_header(token_ids=[1, 2, 3, 4, 5]), payload), NS)
    with pytest.raises(CorruptBlock, match="'key' missing"):
        decode_block(_reframe(_header(key="text"), payload), NS)
    with pytest.raises(ForeignBlock, match="version 2"):
        data = bytearray(_reframe(_header(), payload))
        data[4] = 2
        decode_block(bytes(data), NS)


def test_encode_refuses_impossible_records(record):
    with pytest.raises(ValueError, match="layers, 2"):
        encode_block(BlockRecord(record.key, None, (), record.kv[0]), NS)
    with pytest.raises(ValueError, match="do not fit"):
        encode_block(BlockRecord(record.key, None, tuple(range(5)), record.kv), NS)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        encode_block(BlockRecord(record.key, None, (), record.kv.to(torch.int32)), NS)


def test_namespace_validation_and_tag():
    assert NS.tag == TierNamespace("ab" * 32, "sha256", BLOCK_SIZE).tag
    assert len(NS.tag) == 16 and NS.tag != OTHER_MODEL.tag
    for bad in (("", "sha256", 4), ("AB", "sha256", 4), ("ab", "md5", 4), ("ab", "sha256", 0)):
        with pytest.raises(ValueError):
            TierNamespace(*bad)
