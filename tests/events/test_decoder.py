"""The wire decoder speaks the records' vocabulary: vLLM messages become ``BlocksStored`` /
``BlocksRemoved`` / ``AllBlocksCleared``, and the router index applies the SSE feed's events
and the ZMQ feed's records by one path, ending in the same state."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import BlockHash, hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.decoder import BlockRemoved, decode_records, to_record
from kvreuse.events.publisher import encode_batch, to_vllm_events
from kvreuse.events.records import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    StoredBlock,
    event_from_json,
    event_to_json,
)
from kvreuse.events.wire import hash_from_wire
from kvreuse.router.index import KVIndex, index_key
from tests.events.test_publisher import BS, run_requests


def h8(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(8, "big"))


def test_wire_messages_become_records_with_exact_fields():
    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [1, 2], 7, [10, 11, 12, 13, 20, 21, 22, 23], 4, None, "CPU"],
                ["BlockStored", [b"\xaa" * 32], None, [], 4],  # older sender: no lora_id, no medium; no tokens
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "group_idx": 0},
                ["BlockRemoved", [2]],  # no medium: wherever it is held
                ["AllBlocksCleared"],
                {"type": "SomethingNew"},  # unknown: left out
            ],
            0,
        ],
        use_bin_type=True,
    )
    assert decode_records(payload) == [
        BlocksStored(
            h8(7),
            (
                StoredBlock(h8(1), (10, 11, 12, 13), None, "CPU", None),
                StoredBlock(h8(2), (20, 21, 22, 23), None, "CPU", None),
            ),
            4,
        ),
        BlocksStored(None, (StoredBlock(BlockHash(b"\xaa" * 32), (), None, "GPU", None),), 4),
        BlocksRemoved((h8(1),), "CPU"),
        BlocksRemoved((h8(2),), None),
        AllBlocksCleared(),
    ]


def test_wire_hashes_keep_their_low_64_bits_as_the_index_key():
    assert hash_from_wire(5) == BlockHash(b"\x00" * 7 + b"\x05")
    assert hash_from_wire(-1) == BlockHash(b"\xff" * 8)  # a signed hash(): two's complement
    assert index_key(hash_from_wire(2**64 - 3)) == 2**64 - 3
    assert hash_from_wire(b"\x01\x02") == BlockHash(b"\x01\x02")


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb([1.0, [["BlockStored", [1], None, [], 0]]]),  # block_size 0
        msgpack.packb([1.0, [["BlockStored", [1], None, [], "4"]]]),
        msgpack.packb([1.0, [["BlockStored", ["x"], None, [], 4]]]),  # a hash that is a string
        msgpack.packb([1.0, [["BlockRemoved", 3]]]),  # block_hashes not a list
    ],
)
def test_malformed_messages_raise_value_error(payload):
    with pytest.raises(ValueError):
        decode_records(payload)


def test_bytes_hashes_decode_to_the_pools_own_records_but_for_priority():
    buffer = EventBuffer(64)
    pool = BlockPool(8, BS, events=buffer)
    tokens = list(range(2 * BS))
    keys = hash_token_blocks(tokens, BS, model_id="m")
    blocks = pool.allocate(2)
    for i, block in enumerate(blocks):
        pool.register(block, keys[i], keys[i - 1] if i else None, tokens[i * BS : (i + 1) * BS], depth=i)
    wire = to_vllm_events(buffer.get_events(), "bytes")
    for encoding in ("array", "map"):
        assert decode_records(encode_batch(1.0, wire, 0, encoding)) == [
            BlocksStored(
                None,
                (
                    StoredBlock(keys[0], (0, 1, 2, 3), None, "GPU", None),
                    StoredBlock(keys[1], (4, 5, 6, 7), None, "GPU", None),
                ),
                BS,
            )
        ]


def test_sse_and_zmq_feeds_reach_the_same_index_by_one_apply_path():
    """The same pool history, once as numbered JSON events (``apply``) and once as ZMQ
    batches of either encoding (``apply_record`` of ``decode_records``): equal mirrors,
    both exactly the pool's cached blocks."""
    buffer = EventBuffer(100_000)
    pool = BlockPool(12, BS, events=buffer)
    run_requests(pool, random.Random(11), 40)
    pool.evict_all_cached()
    run_requests(pool, random.Random(12), 20)
    events = buffer.get_events()
    index = KVIndex()
    for name in ("sse", "zmq-array", "zmq-map"):
        index.add_executor(name)
    assert all(index.apply("sse", event_from_json(event_to_json(e))) for e in events)
    for encoding in ("array", "map"):
        for i in range(0, len(events), 7):  # batches of 7 events, as a publisher might send
            payload = encode_batch(1.0, to_vllm_events(events[i : i + 7], "int"), 0, encoding)
            for record in decode_records(payload):
                index.apply_record(f"zmq-{encoding}", record)
    expected = {index_key(b.block_hash): frozenset({"GPU"}) for b in pool.cached_hashes()}
    assert len(expected) > 0 and pool.num_evictions > 0
    assert index.mirror("sse").levels == expected
    assert index.mirror("zmq-array").levels == expected
    assert index.mirror("zmq-map").levels == expected


def test_a_removal_that_names_no_level_drops_the_block_at_any_level():
    index = KVIndex()
    index.add_executor("a")
    index.store("a", [1, 2], level="CPU")
    index.apply_record("a", to_record(BlockRemoved([1], "GPU")))
    assert index.overlaps([1, 2], ["a"]) == {"a": 2}
    index.apply_record("a", to_record(BlockRemoved([1], None)))
    assert index.overlaps([1, 2], ["a"]) == {"a": 0} and index.level_of("a", 2) == "CPU"
