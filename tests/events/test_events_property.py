"""Property: a consumer that applies only the events (or a snapshot plus the events after
it) ends with exactly the pool's cached blocks, parents and priorities.

The pool is driven directly, as tests/test_block_pool.py does: requests over a tiny token
alphabet (so prefixes are shared), releases, retention changes on reuse, a fake clock with
expiries, reset of the prefix cache, and evictions forced by a small pool.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.eviction import PriorityPolicy
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import CacheCreated, KVSnapshot, event_from_json, event_to_json
from tests.events.event_helpers import CacheMirror

BS = 2
NUM_BLOCKS = 6


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool_state(pool: BlockPool) -> dict:
    return {b.block_hash: (b.parent_hash, b.priority, pool.cache_level) for b in pool.cached_hashes()}


def mirror_state(mirror: CacheMirror) -> dict:
    return {h: (m.parent_hash, m.priority, m.cache_level) for h, m in mirror.blocks.items()}


def run_request(pool: BlockPool, tokens: list[int], priority: int | None, duration: float | None):
    """One request: hit, apply retention to reused blocks, allocate, register. Returns the
    held blocks (None when the pool is too full: the scheduler would queue it)."""
    hashes = hash_token_blocks(tokens, BS, model_id="m")
    chunks = [tokens[i : i + BS] for i in range(0, len(hashes) * BS, BS)]
    hits = pool.match_prefix(hashes, chunks)
    # acquiring a cached, unheld hit takes it out of the free count too
    if not pool.can_allocate(len(hashes) - len(hits) + sum(b.ref_count == 0 for b in hits)):
        return None
    pool.acquire(hits)
    for block in hits:
        pool.set_retention(block, priority, duration)
    blocks = hits + pool.allocate(len(hashes) - len(hits))
    for i in range(len(hits), len(hashes)):
        kept = pool.register(
            blocks[i],
            hashes[i],
            hashes[i - 1] if i else None,
            chunks[i],
            depth=i,
            priority=35 if priority is None else priority,
            duration_s=duration,
        )
        if kept is not blocks[i]:  # computed twice at once: keep the registered copy
            pool.acquire([kept])
            pool.release([blocks[i]])
            blocks[i] = kept
    pool.check_integrity()
    return blocks


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("request"),
            st.lists(st.integers(0, 2), min_size=BS, max_size=4 * BS),
            st.one_of(st.none(), st.integers(0, 100)),
            st.one_of(st.none(), st.floats(0.5, 5.0)),
        ),
        st.tuples(st.just("release"), st.integers(0, 10)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
        st.tuples(st.just("reset")),
        st.tuples(st.just("poll")),
    ),
    max_size=40,
)


def drive(pool: BlockPool, clock: FakeClock, program, on_poll=lambda: None) -> None:
    running: list[list] = []
    for op in program:
        if op[0] == "request":
            blocks = run_request(pool, op[1], op[2], op[3])
            if blocks is not None:
                running.append(blocks)
        elif op[0] == "release" and running:
            pool.release(reversed(running.pop(op[1] % len(running))))
        elif op[0] == "tick":
            clock.now += op[1]
            pool.expire()
        elif op[0] == "reset":
            pool.evict_all_cached()
        elif op[0] == "poll":
            on_poll()
        pool.check_integrity()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops)
def test_events_alone_reconstruct_the_pool(program):
    clock = FakeClock()
    buffer = EventBuffer(100_000, clock=clock)
    pool = BlockPool(NUM_BLOCKS, BS, policy=PriorityPolicy(), clock=clock, events=buffer)
    drive(pool, clock, program)

    events = buffer.get_events(after_id=-1, max_events=10**9)
    assert [e.event_id for e in events] == list(range(len(events)))
    assert isinstance(events[0].data, CacheCreated)
    mirror = CacheMirror()
    # through the JSON form, as an HTTP consumer sees it
    assert mirror.apply_all(event_from_json(event_to_json(e)) for e in events)
    assert mirror_state(mirror) == pool_state(pool)
    assert buffer.num_dropped == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops, size=st.integers(1, 6))
def test_overflow_then_snapshot_resync_reconstructs_the_pool(program, size):
    clock = FakeClock()
    buffer = EventBuffer(size, clock=clock)
    pool = BlockPool(NUM_BLOCKS, BS, policy=PriorityPolicy(), clock=clock, events=buffer)
    mirror = CacheMirror()
    resyncs = []

    def poll() -> None:
        events = buffer.get_events(after_id=mirror.last_event_id)
        if not mirror.apply_all(events):  # a hole: dropped events
            # same thread as the pool, so the snapshot is consistent with its event id;
            # it goes through JSON as /v1/kv_cache_state serves it
            mirror.load(KVSnapshot.from_json(buffer.snapshot(pool).to_json()))
            resyncs.append(mirror.last_event_id)
            assert mirror.apply_all(buffer.get_events(after_id=mirror.last_event_id))

    drive(pool, clock, program, on_poll=poll)
    poll()
    assert mirror_state(mirror) == pool_state(pool)
    assert mirror.last_event_id == buffer.last_event_id
    assert len(buffer.get_events(after_id=-1)) <= size  # bounded memory
