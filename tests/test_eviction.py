"""Eviction policies as sort keys: selection by name, LRU vs priority order, and the
hint-free 2q policy (ghost history protects a key's second residency), with exact block
ids and ``check_integrity`` after every step."""

import pytest

from kvreuse.block_pool import BlockPool
from kvreuse.eviction import POLICIES, LRUPolicy, PriorityPolicy, TwoQueuePolicy, make_policy
from kvreuse.hashing import hash_token_blocks

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
    assert sorted(POLICIES) == ["2q", "lru", "priority"]
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)
    q = make_policy("2q", num_blocks=10)
    assert isinstance(q, TwoQueuePolicy) and q.history_size == 40 and q.protect_ticks == 160
    with pytest.raises(ValueError, match="--eviction-policy"):
        make_policy("fifo")


@pytest.mark.parametrize("policy, victim", [("lru", 0), ("priority", 1)])
def test_lru_ignores_priority_priority_does_not(policy, victim):
    pool = BlockPool(2, BS, policy=make_policy(policy))
    run(pool, list(range(4)), priority=90)         # block 0: older, high priority
    run(pool, list(range(100, 104)), priority=10)  # block 1: newer, low priority
    ids, _ = run(pool, list(range(200, 204)))
    assert ids == [victim]
    assert pool.evictions_by_priority == {90 if victim == 0 else 10: 1}


def test_2q_protects_a_reused_block_over_newer_single_use_blocks():
    pool = BlockPool(3, BS, policy=make_policy("2q", num_blocks=3))
    run(pool, list(range(4)))                     # A: block 0
    assert run(pool, list(range(4))) == ([0], 1)   # A hit: used twice -> protected
    run(pool, list(range(100, 104)))              # B: block 1
    run(pool, list(range(200, 204)))              # C: block 2
    ids, _ = run(pool, list(range(300, 304)))     # D evicts the oldest single-use block: B
    assert ids == [1]
    ids, _ = run(pool, list(range(400, 404)))     # E evicts C, not the older but protected A
    assert ids == [2]
    assert run(pool, list(range(4)))[1] == 1      # A is still there


def test_2q_ghost_history_protects_the_second_residency():
    pool = BlockPool(2, BS, policy=make_policy("2q", num_blocks=2))
    run(pool, list(range(4)))                     # A: block 0
    run(pool, list(range(100, 104)))              # B: block 1
    assert run(pool, list(range(200, 204)))[0] == [0]   # C evicts A (ghost: A used once)
    assert run(pool, list(range(4))) == ([1], 0)        # A misses, recomputed into block 1 (B evicted)
    # A's key has now been used twice (ghost + this residency): C, not A, goes next.
    assert run(pool, list(range(300, 304)))[0] == [0]
    assert run(pool, list(range(4)))[1] == 1


def test_2q_protected_blocks_still_age_out():
    pool = BlockPool(2, BS, policy=TwoQueuePolicy(num_blocks=1))  # protection worth 16 ticks
    run(pool, list(range(4)))
    run(pool, list(range(4)))                     # A protected at tick ~4
    for i in range(10):                           # 20+ ticks of single-use traffic
        run(pool, [1000 + i] * 4)
    ids, _ = run(pool, list(range(500, 504)))
    assert pool.match_prefix(hash_token_blocks(list(range(4)), BS, model_id="m"), [list(range(4))]) == []
    assert len(ids) == 1
