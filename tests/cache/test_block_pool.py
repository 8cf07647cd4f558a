"""Block pool scenarios with exact block ids and eviction order; integrity after every step."""

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.records import BlocksRemoved, BlocksStored, CacheCreated

BS = 4


class Recorder(list):
    pass


def fill(pool: BlockPool, tokens: list[int], salt: str | None = None):
    """Run one 'request': hit what is cached, allocate the rest, register full blocks."""
    hashes = hash_token_blocks(tokens, BS, model_id="m", cache_salt=salt)
    chunks = [tokens[i : i + BS] for i in range(0, len(tokens), BS)]
    hits = pool.match_prefix(hashes, chunks)
    pool.acquire(hits)
    pool.check_integrity()
    new = pool.allocate(len(chunks) - len(hits))
    pool.check_integrity()
    blocks = hits + new
    for i in range(len(hits), len(hashes)):
        parent = hashes[i - 1] if i else None
        blocks[i] = pool.register(blocks[i], hashes[i], parent, chunks[i], depth=i)
        pool.check_integrity()
    return blocks, len(hits)


def release(pool, blocks):
    pool.release(reversed(blocks))
    pool.check_integrity()


def test_prefix_hit_and_reuse_exact_ids():
    pool = BlockPool(8, BS)
    a, hits = fill(pool, list(range(10)))  # 2 full blocks + 1 partial
    assert [b.block_id for b in a] == [0, 1, 2] and hits == 0
    release(pool, a)
    assert (pool.num_cached_blocks, pool.num_free_blocks, pool.num_used_blocks) == (2, 8, 0)
    b, hits = fill(pool, list(range(8)) + [99, 98, 97, 96])
    assert hits == 2 and [x.block_id for x in b] == [0, 1, 3]
    assert pool.num_used_blocks == 3


def test_salt_isolates_and_token_check():
    pool = BlockPool(8, BS)
    a, _ = fill(pool, list(range(8)), salt="t1")
    release(pool, a)
    _, hits = fill(pool, list(range(8)), salt="t2")
    assert hits == 0
    # a forged hash with the wrong tokens is a miss
    hashes = hash_token_blocks(list(range(8)), BS, model_id="m", cache_salt="t1")
    assert pool.match_prefix(hashes, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert pool.match_prefix(hashes, [[0, 1, 2, 9]]) == []


def test_lru_evicts_leaves_oldest_first_and_never_in_use():
    events = Recorder()
    pool = BlockPool(4, BS, events=events)
    a, _ = fill(pool, list(range(8)))  # blocks 0,1
    a_hashes = [x.block_hash for x in a]
    release(pool, a)
    b, _ = fill(pool, list(range(100, 108)))  # blocks 2,3
    # pool full: 0,1 cached (free), 2,3 in use. Need 2 more: evict leaf 1 then its parent 0.
    c, _ = fill(pool, list(range(200, 208)))
    assert [x.block_id for x in c] == [1, 0]
    removed = [e for e in events if isinstance(e, BlocksRemoved)]
    assert [list(e.block_hashes) for e in removed] == [[a_hashes[1], a_hashes[0]]]
    assert pool.num_free_blocks == 0
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.check_integrity()
    assert isinstance(events[0], CacheCreated)
    assert sum(isinstance(e, BlocksStored) for e in events) == 6


def test_duplicate_register_keeps_first_and_frees_second():
    pool = BlockPool(4, BS)
    a, _ = fill(pool, list(range(4)))
    # a second request computed the same block concurrently into another block
    other = pool.allocate(1)[0]
    kept = pool.register(other, a[0].block_hash, None, list(range(4)), depth=0)
    assert kept is a[0] and other.block_hash is None
    pool.acquire([kept])
    pool.release([other])
    pool.check_integrity()
    assert pool.num_free_blocks == 3  # 2 never-used + the unregistered duplicate


def test_release_of_unheld_block_is_a_broken_invariant():
    pool = BlockPool(2, BS)
    with pytest.raises(RuntimeError):
        pool.release([pool.blocks[0]])


def test_reset_drops_cached_blocks_without_counting_evictions():
    pool = BlockPool(8, BS)
    blocks, _ = fill(pool, list(range(12)))
    held, _ = fill(pool, list(range(100, 108)))
    release(pool, blocks)
    assert pool.evict_all_cached() == 3  # the released chain; the held one stays
    pool.check_integrity()
    assert (pool.num_evictions, pool.evictions_by_priority) == (0, {})
    assert (pool.num_cached_blocks, pool.num_used_blocks, pool.num_free_blocks) == (0, 2, 6)
    release(pool, held)
    assert pool.num_cached_blocks == 2
