"""ZMQ publishing in vLLM's format: encoding, decoder, replay, resync, and a separate
subscriber process (plain pyzmq + msgpack, no kvreuse) that ends with the snapshot's blocks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.decoder import BlockRemoved, BlockStored, UnknownEvent, decode_batch
from kvreuse.events.publisher import ZmqEventPublisher, encode_batch, to_vllm_events
from kvreuse.events.records import AllBlocksCleared
from kvreuse.events.wire import wire_hash
from tests.events.event_helpers import CATCH_UP

BS = 4

SUBSCRIBER = (
    r"""
import json, sys, msgpack, zmq
sub_ep, replay_ep = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b"kv"); sub.connect(sub_ep)
replay = ctx.socket(zmq.DEALER); replay.connect(replay_ep)
print("ready", flush=True)
blocks, expected = {}, 0

def apply(payload):
    ts, events, rank = msgpack.unpackb(payload)
    assert rank == 0
    for e in events:
        if e[0] == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium = e
            assert len(tokens) == block_size * len(hashes) and medium == "GPU"
            for h in hashes:
                blocks[h] = parent; parent = h
        elif e[0] == "BlockRemoved":
            for h in e[1]:
                blocks.pop(h, None)
        elif e[0] == "AllBlocksCleared":
            blocks.clear()
"""
    + CATCH_UP
    + r"""
target = int(sys.stdin.readline())  # the test sends the last sequence number when done
while expected <= target:
    if sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        seq = int.from_bytes(seq, "big")
        if seq == expected:
            apply(payload); expected += 1
        elif seq > expected:  # joined late or lost some: fetch them from the replay socket
            catch_up()
    else:
        catch_up()
print(json.dumps({str(h): p for h, p in blocks.items()}), flush=True)
"""
)


def run_requests(pool: BlockPool, rng: random.Random, n: int) -> None:
    """Requests over shared prefixes, released at random: stores, hits and evictions."""
    held = []
    for _ in range(n):
        tokens = [rng.randint(0, 3) for _ in range(BS * rng.randint(1, 4))]
        hashes = hash_token_blocks(tokens, BS, model_id="m")
        chunks = [tokens[i : i + BS] for i in range(0, len(tokens), BS)]
        hits = pool.match_prefix(hashes, chunks)
        pool.acquire(hits)
        while held and not pool.can_allocate(len(hashes) - len(hits)):
            pool.release(reversed(held.pop(0)))
        blocks = hits + pool.allocate(len(hashes) - len(hits))
        for i in range(len(hits), len(hashes)):
            assert pool.register(blocks[i], hashes[i], hashes[i - 1] if i else None, chunks[i], depth=i) is blocks[i]
        held.append(blocks)
        if rng.random() < 0.6:
            pool.release(reversed(held.pop(rng.randrange(len(held)))))
    for blocks in held:
        pool.release(reversed(blocks))


def wire_state(pool: BlockPool) -> dict:
    return {
        str(wire_hash(b.block_hash, "int")): None if b.parent_hash is None else wire_hash(b.parent_hash, "int")
        for b in pool.cached_hashes()
    }


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_encoding_matches_vllm_positional_form_and_decodes_both_forms():
    buf = EventBuffer(64)
    pool = BlockPool(4, BS, events=buf)
    run_requests(pool, random.Random(1), 6)
    wire = to_vllm_events(buf.get_events(), "int")
    raw = msgpack.unpackb(encode_batch(1.5, wire, 0, "array"))
    assert raw[0] == 1.5 and raw[2] == 0
    first = raw[1][0]
    assert first[0] == "BlockStored" and len(first) == 7 and first[4] == BS and first[6] == "GPU"
    assert all(0 <= h < 2**64 for h in first[1])
    for encoding in ("array", "map"):
        batch = decode_batch(encode_batch(1.5, wire, 0, encoding))
        assert batch.data_parallel_rank == 0
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in wire]
        stored = batch.events[0]
        assert isinstance(stored, BlockStored) and stored.block_hashes == wire[0]["block_hashes"]
    # what newer vLLM sends: maps with extra fields; older: positional with extra fields
    newer = msgpack.packb(
        [
            2.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": None,
                    "token_ids": [1] * 16,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                },
                ["BlockRemoved", [7], "GPU", 0],
                ["AllBlocksCleared"],
                {"type": "SomethingNew", "x": 1},
            ],
            3,
        ]
    )
    events = decode_batch(newer).events
    assert events[0] == BlockStored([7], None, [1] * 16, 16, None, "GPU")
    assert events[1] == BlockRemoved([7], "GPU") and events[2] == AllBlocksCleared()
    assert isinstance(events[3], UnknownEvent)
    assert decode_batch(msgpack.packb([1.0, [["BlockStored", [1], None, [], 16]]])).events[0].medium is None
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb([1.0, [["BlockStored", [1]]]]))
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")


def test_consecutive_chain_stores_and_removals_are_merged():
    buf = EventBuffer(64)
    pool = BlockPool(8, BS, events=buf)
    run_requests(pool, random.Random(0), 1)
    tokens = list(range(3 * BS))
    hashes = hash_token_blocks(tokens, BS, model_id="m")
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, hashes[i], hashes[i - 1] if i else None, tokens[i * BS : (i + 1) * BS], depth=i)
    wire = to_vllm_events(buf.get_events(after_id=buf.last_event_id - 3), "int")
    assert len(wire) == 1 and len(wire[0]["block_hashes"]) == 3 and wire[0]["parent_block_hash"] is None
    assert wire[0]["token_ids"] == tokens


def test_separate_process_subscriber_ends_with_the_snapshot_block_set():
    buf = EventBuffer(100_000)
    pool = BlockPool(12, BS, events=buf)
    pub = ZmqEventPublisher(
        buf,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv-events",
        snapshot_fn=lambda: buf.snapshot(pool),
        context=zmq.Context(),
    ).start()
    proc = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, pub.endpoint, pub.replay_endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        run_requests(pool, random.Random(7), 60)
        pool.evict_all_cached()
        run_requests(pool, random.Random(8), 30)
        wait_for(lambda: pub.last_event_id == buf.last_event_id)
        out, _ = proc.communicate(f"{pub.last_seq}\n", timeout=60)
    finally:
        proc.kill()
        pub.close()
    assert json.loads(out) == wire_state(pool)
    assert pool.num_evictions > 0 and pub.num_events_lost == 0


def replay_all(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert sock.poll(5000)
        _, seq, payload = sock.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        out.append((seq, payload))
    sock.close(linger=0)
    ctx.term()
    return out


def test_publisher_that_lost_events_resyncs_from_a_snapshot():
    buf = EventBuffer(4)  # far smaller than what happens before the publisher starts
    pool = BlockPool(12, BS, events=buf)
    run_requests(pool, random.Random(3), 40)
    pub = ZmqEventPublisher(
        buf,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        snapshot_fn=lambda: buf.snapshot(pool),
        context=zmq.Context(),
    ).start()
    try:
        wait_for(lambda: pub.last_event_id == buf.last_event_id)
        batches = replay_all(pub.replay_endpoint)
    finally:
        pub.close()
    assert pub.num_events_lost > 0 and pub.num_resyncs == 1 and buf.num_dropped > 0
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    state: dict = {}
    for _, payload in batches:
        for e in decode_batch(payload).events:
            if isinstance(e, AllBlocksCleared):
                state.clear()
            elif isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    state[str(h)] = parent
                    parent = h
    assert state == wire_state(pool)


def test_publisher_without_snapshot_leaves_a_sequence_hole():
    buf = EventBuffer(2)
    pool = BlockPool(8, BS, events=buf)
    run_requests(pool, random.Random(4), 10)
    pub = ZmqEventPublisher(
        buf, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=zmq.Context()
    ).start()
    try:
        wait_for(lambda: pub.last_event_id == buf.last_event_id)
        batches = replay_all(pub.replay_endpoint)
    finally:
        pub.close()
    assert pub.num_events_lost > 0 and batches and batches[0][0] == 1  # seq 0 never sent: a gap


def test_stalled_subscriber_never_blocks_the_engine_or_the_publisher():
    """A subscriber that connects and never reads, a 10-message high-water mark and a
    small buffer: the engine's requests all complete, memory stays bounded, the publisher
    thread stays live and catches up (PUB drops for the stalled peer instead of blocking)."""
    import threading

    from tests.events.event_helpers import locked_snapshot

    buf = EventBuffer(256)
    pool = BlockPool(64, BS, events=buf)
    lock = threading.Lock()
    ctx = zmq.Context()
    pub = ZmqEventPublisher(
        buf,
        "tcp://127.0.0.1:*",
        hwm=10,
        snapshot_fn=locked_snapshot(pool, buf, lock),
        batch_interval_s=0.0,
        context=ctx,
    )  # no coalescing: as many batches as possible
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(pub.endpoint)
    pub.start()
    rng = random.Random(9)
    try:
        start = time.monotonic()
        for _ in range(300):
            with lock:  # one engine step
                run_requests(pool, rng, 3)
            time.sleep(0.004)  # the model's share of a step: the publisher gets to send, even on a loaded machine
        elapsed = time.monotonic() - start
        wait_for(lambda: pub.last_event_id == buf.last_event_id, timeout=30)
    finally:
        pub.close()
        stalled.close(linger=0)
    assert elapsed < 60, elapsed
    assert buf.stats()["num_events"] <= 256
    assert pub.num_batches > 10  # far more than the stalled peer could take


def test_failing_snapshot_falls_back_to_a_sequence_hole_and_the_thread_lives():
    buf = EventBuffer(2)
    pool = BlockPool(8, BS, events=buf)
    run_requests(pool, random.Random(5), 10)

    def broken():
        raise TimeoutError("engine busy")

    pub = ZmqEventPublisher(
        buf, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", snapshot_fn=broken, context=zmq.Context()
    ).start()
    try:
        wait_for(lambda: pub.last_event_id == buf.last_event_id)
        run_requests(pool, random.Random(6), 1)  # still publishing afterwards
        wait_for(lambda: pub.last_event_id == buf.last_event_id)
        batches = replay_all(pub.replay_endpoint)
    finally:
        pub.close()
    assert pub.num_resyncs == 0 and batches[0][0] == 1 and pub._thread.is_alive() is False


def test_decode_batch_refuses_a_batch_without_a_time_as_value_error():
    import msgpack

    for payload in (msgpack.packb({"events": []}), msgpack.packb(["soon", []])):
        with pytest.raises(ValueError, match="ts must be a number"):
            decode_batch(payload)
