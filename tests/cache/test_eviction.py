"""Eviction policies as sort keys: selection by name, LRU vs priority order, and the
hint-free 2q and logfreq policies (ghost history counts a key's earlier residencies), with
exact block ids and ``check_integrity`` after every step."""

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.eviction import POLICIES, LogFrequencyPolicy, LRUPolicy, PriorityPolicy, TwoQueuePolicy, make_policy
from kvreuse.cache.hashing import hash_token_blocks

BS = 4


def run(pool, tokens, priority=35):
    hashes = hash_token_blocks(tokens, BS, model_id="m")
    chunks = [tokens[i : i + BS] for i in range(0, len(tokens), BS)]
    hits = pool.match_prefix(hashes, chunks)
    pool.acquire(hits)
    blocks = hits + pool.allocate(len(chunks) - len(hits))
    for i in range(len(hits), len(hashes)):
        pool.register(blocks[i], hashes[i], hashes[i - 1] if i else None, chunks[i], depth=i, priority=priority)
    pool.check_integrity()
    pool.release(reversed(blocks))
    pool.check_integrity()
    return [b.block_id for b in blocks], len(hits)


def test_make_policy_by_name():
    assert sorted(POLICIES) == ["2q", "logfreq", "lru", "priority"]
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)
    q = make_policy("2q", num_blocks=10)
    assert isinstance(q, TwoQueuePolicy) and q.history_size == 40 and q.protect_ticks == 160
    f = make_policy("logfreq", num_blocks=10)
    assert isinstance(f, LogFrequencyPolicy) and f.history_size == 4 * 4096 and f.protect_ticks == 32768
    assert make_policy("logfreq", num_blocks=10_000).history_size == 40_000
    with pytest.raises(ValueError, match="--eviction-policy"):
        make_policy("fifo")


@pytest.mark.parametrize("policy, victim", [("lru", 0), ("priority", 1)])
def test_lru_ignores_priority_priority_does_not(policy, victim):
    pool = BlockPool(2, BS, policy=make_policy(policy))
    run(pool, list(range(4)), priority=90)  # block 0: older, high priority
    run(pool, list(range(100, 104)), priority=10)  # block 1: newer, low priority
    ids, _ = run(pool, list(range(200, 204)))
    assert ids == [victim]
    assert pool.evictions_by_priority == {90 if victim == 0 else 10: 1}


def test_2q_protects_a_reused_block_over_newer_single_use_blocks():
    pool = BlockPool(3, BS, policy=make_policy("2q", num_blocks=3))
    run(pool, list(range(4)))  # A: block 0
    assert run(pool, list(range(4))) == ([0], 1)  # A hit: used twice -> protected
    run(pool, list(range(100, 104)))  # B: block 1
    run(pool, list(range(200, 204)))  # C: block 2
    ids, _ = run(pool, list(range(300, 304)))  # D evicts the oldest single-use block: B
    assert ids == [1]
    ids, _ = run(pool, list(range(400, 404)))  # E evicts C, not the older but protected A
    assert ids == [2]
    assert run(pool, list(range(4)))[1] == 1  # A is still there


def test_2q_ghost_history_protects_the_second_residency():
    pool = BlockPool(2, BS, policy=make_policy("2q", num_blocks=2))
    run(pool, list(range(4)))  # A: block 0
    run(pool, list(range(100, 104)))  # B: block 1
    assert run(pool, list(range(200, 204)))[0] == [0]  # C evicts A (ghost: A used once)
    assert run(pool, list(range(4))) == ([1], 0)  # A misses, recomputed into block 1 (B evicted)
    # A's key has now been used twice (ghost + this residency): C, not A, goes next.
    assert run(pool, list(range(300, 304)))[0] == [0]
    assert run(pool, list(range(4)))[1] == 1


def test_2q_protected_blocks_still_age_out():
    pool = BlockPool(2, BS, policy=TwoQueuePolicy(num_blocks=1))  # protection worth 16 ticks
    run(pool, list(range(4)))
    run(pool, list(range(4)))  # A protected at tick ~4
    for i in range(10):  # 20+ ticks of single-use traffic
        run(pool, [1000 + i] * 4)
    ids, _ = run(pool, list(range(500, 504)))
    assert pool.match_prefix(hash_token_blocks(list(range(4)), BS, model_id="m"), [list(range(4))]) == []
    assert len(ids) == 1


def test_logfreq_more_uses_outlast_fewer_uses_and_single_use_goes_first():
    pool = BlockPool(3, BS, policy=LogFrequencyPolicy(num_blocks=3, protect_ticks=11))
    for _ in range(4):
        run(pool, list(range(4)))  # A: block 0, 4 uses, last tick 8 -> key 8 + 2 * 11 = 30
    for _ in range(2):
        run(pool, list(range(100, 104)))  # B: block 1, 2 uses, last tick 12 -> key 12 + 11 = 23
    run(pool, list(range(200, 204)))  # C: block 2, once, key 14
    # Single-use requests D..H (keys 16, 18, 20, 22, 24) each take the previous one's block:
    # every one of them ranks below B's 23 when it is evicted.
    for i in range(5):
        assert run(pool, [300 + i] * 4) == ([2], 0)
    assert run(pool, [400] * 4) == ([1], 0)  # I: now B (23) is the smallest, not H (24)
    assert run(pool, list(range(4)))[1] == 1  # A, the oldest but used 4 times, is still there
    # Under LRU the same requests evict A (block 0) first.
    lru = BlockPool(3, BS, policy=make_policy("lru"))
    for _ in range(4):
        run(lru, list(range(4)))
    for _ in range(2):
        run(lru, list(range(100, 104)))
    run(lru, list(range(200, 204)))
    assert run(lru, [300] * 4) == ([0], 0)


@pytest.mark.parametrize("max_uses, victim", [(2, 0), (8, 1)])
def test_logfreq_bonus_is_capped_at_max_uses(max_uses, victim):
    pool = BlockPool(2, BS, policy=LogFrequencyPolicy(num_blocks=2, protect_ticks=10, max_uses=max_uses))
    for _ in range(4):
        run(pool, list(range(4)))  # A: block 0, 4 uses, tick 8: key 18 (capped) or 28
    for _ in range(2):
        run(pool, list(range(100, 104)))  # B: block 1, 2 uses, tick 12: key 22
    assert run(pool, [500] * 4) == ([victim], 0)


def test_logfreq_ghost_history_counts_earlier_residencies():
    pool = BlockPool(2, BS, policy=LogFrequencyPolicy(num_blocks=2, protect_ticks=100))
    run(pool, list(range(4)))  # A: block 0
    run(pool, list(range(100, 104)))  # B: block 1
    assert run(pool, list(range(200, 204)))[0] == [0]  # C evicts A (ghost: A used once)
    assert run(pool, list(range(4))) == ([1], 0)  # A misses, recomputed into block 1 (B evicted)
    # A's key has now been used twice (ghost + this residency): C, not A, goes next.
    assert run(pool, list(range(300, 304)))[0] == [0]
    assert run(pool, list(range(4)))[1] == 1


def test_logfreq_rejects_bad_settings():
    with pytest.raises(ValueError, match="num_blocks"):
        LogFrequencyPolicy(num_blocks=0)
    with pytest.raises(ValueError, match="protect_ticks"):
        LogFrequencyPolicy(num_blocks=4, max_uses=0)
