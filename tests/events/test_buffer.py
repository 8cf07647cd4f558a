"""EventBuffer: ids, drops, blocking and asyncio waits, drain cursor, JSON, snapshot lock."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import BlockHash
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    BlockUpdated,
    CacheCreated,
    StoredBlock,
    event_from_json,
    event_to_json,
)
from tests.events.event_helpers import CacheMirror, locked_snapshot

H1, H2 = BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 8)


def test_ids_count_from_zero_with_timestamps_from_the_clock():
    t = iter([10.0, 11.0, 12.0])
    buf = EventBuffer(8, clock=lambda: next(t))
    for _ in range(3):
        buf.append(AllBlocksCleared())
    events = buf.get_events()
    assert [(e.event_id, e.timestamp) for e in events] == [(0, 10.0), (1, 11.0), (2, 12.0)]
    assert buf.last_event_id == 2
    assert buf.get_events(after_id=1) == events[2:]
    assert buf.get_events(after_id=2) == []


def test_size_zero_means_off():
    with pytest.raises(ValueError, match="--event-buffer-max-size"):
        EventBuffer(0)


def test_full_buffer_drops_oldest_counts_and_shows_the_gap():
    buf = EventBuffer(3)
    for _ in range(5):
        buf.append(AllBlocksCleared())
    assert buf.num_dropped == 2
    events = buf.get_events(after_id=0)  # consumer had seen id 0 only
    assert [e.event_id for e in events] == [2, 3, 4]  # 1 is missing: resync
    assert buf.stats() == {"max_size": 3, "num_events": 3, "first_event_id": 2, "last_event_id": 4, "num_dropped": 2}
    assert [e.event_id for e in buf.get_events(after_id=3, max_events=1)] == [4]


def test_get_events_times_out_then_wakes_on_append():
    buf = EventBuffer(4)
    start = time.monotonic()
    assert buf.get_events(after_id=-1, timeout=0.05) == []
    assert time.monotonic() - start >= 0.04
    threading.Timer(0.05, buf.append, [AllBlocksCleared()]).start()
    start = time.monotonic()
    events = buf.get_events(after_id=-1, timeout=5.0)
    assert [e.event_id for e in events] == [0] and time.monotonic() - start < 2.0


def test_drain_since_last_returns_each_event_once():
    buf = EventBuffer(10)
    buf.append(CacheCreated({"GPU": 4}))
    buf.append(AllBlocksCleared())
    assert [e.event_id for e in buf.drain_since_last()] == [0, 1]
    assert buf.drain_since_last(timeout=0.01) == []
    buf.append(AllBlocksCleared())
    assert [e.event_id for e in buf.drain_since_last()] == [2]


def test_wait_events_asyncio_wakes_from_another_thread_and_cleans_up():
    buf = EventBuffer(4)

    async def main():
        assert await buf.wait_events(after_id=-1, timeout=0.02) == []
        threading.Timer(0.05, buf.append, [AllBlocksCleared()]).start()
        events = await buf.wait_events(after_id=-1, timeout=5.0)
        assert [e.event_id for e in events] == [0]
        # many concurrent waiters, one append wakes all
        tasks = [asyncio.create_task(buf.wait_events(after_id=0, timeout=5.0)) for _ in range(20)]
        await asyncio.sleep(0.02)
        threading.Thread(target=buf.append, args=[AllBlocksCleared()]).start()
        results = await asyncio.gather(*tasks)
        assert all([e.event_id for e in r] == [1] for r in results)

    asyncio.run(main())
    assert not buf._async_waiters  # timed-out and woken waiters leave no trace


def test_json_round_trip_every_record():
    records = [
        CacheCreated({"GPU": 16, "CPU": 64}),
        BlocksStored(None, (StoredBlock(H1, (1, 2), 90), StoredBlock(H2, (3, 4), 35, "CPU", 7)), 2),
        BlocksStored(H1, (StoredBlock(H2, (5, 6), 35),), 2),
        BlocksRemoved((H1, H2), "GPU"),
        BlockUpdated(H1, old_priority=90, new_priority=35),
        BlockUpdated(H2, old_cache_level="GPU", new_cache_level="CPU"),
        AllBlocksCleared(),
    ]
    buf = EventBuffer(16)
    for r in records:
        buf.append(r)
    for event in buf.get_events():
        d = event_to_json(event)
        assert event_from_json(d) == event
    stored = event_to_json(buf.get_events(after_id=0)[0])["data"]
    assert stored["parent_hash"] is None and stored["blocks"][0]["block_hash"] == "01" * 32


def test_absent_or_slow_consumer_never_slows_the_producer():
    """100k events into a 1k buffer while one consumer keeps reading and another never
    reads: the producer never waits for either (append takes no consumer's pace), memory
    stays bounded and every drop is counted. (How fast appends are is for bench/, not here.)"""
    buf = EventBuffer(1000)
    stop = threading.Event()
    seen: list[int] = []

    def reader():
        after = -1
        while not stop.is_set():
            events = buf.get_events(after_id=after, timeout=0.01)
            if events:
                after = events[-1].event_id
                seen.append(after)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(100_000):
        buf.append(AllBlocksCleared())
    stop.set()
    thread.join()
    assert buf.stats()["num_events"] == 1000
    assert buf.num_dropped == 99_000
    assert seen == sorted(seen)  # the live reader only ever moved forward


def test_locked_snapshot_is_consistent_with_its_event_id_under_a_running_engine():
    """An engine thread mutates the pool under its step lock while a reader takes
    snapshots: snapshot + the events after its id always equals the final pool."""
    buf = EventBuffer(100_000)
    pool = BlockPool(16, 2, events=buf)
    lock = threading.Lock()
    snap = locked_snapshot(pool, buf, lock)
    done = threading.Event()

    def engine():
        rng = random.Random(0)
        held = []
        for _ in range(400):
            with lock:  # one engine step
                if held and (rng.random() < 0.5 or not pool.can_allocate(1)):
                    pool.release(held.pop(rng.randrange(len(held))))
                else:
                    (block,) = pool.allocate(1)
                    h = BlockHash(rng.randbytes(8))
                    pool.register(block, h, None, (1, 2), depth=0, priority=rng.randint(0, 100))
                    held.append([block])
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    snapshots = []
    while not done.is_set():
        snapshots.append(snap())
    thread.join()
    final = {b.block_hash: (b.parent_hash, b.priority) for b in pool.cached_hashes()}
    for s in snapshots[:: max(1, len(snapshots) // 20)] + [snap()]:
        mirror = CacheMirror()
        mirror.load(s)
        assert mirror.apply_all(buf.get_events(after_id=s.last_event_id, max_events=10**9))
        assert {h: (m.parent_hash, m.priority) for h, m in mirror.blocks.items()} == final
