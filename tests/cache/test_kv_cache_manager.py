"""The one admission path (KVCacheManager.admit_blocks / register_blocks) and the one
incremental hash chain, on a simulated pool: exact block ids, retention and integrity after
every operation."""

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import extend_chain, hash_block, hash_token_blocks, root_extra_keys
from kvreuse.cache.kv_block import DEFAULT_PRIORITY, block_slots, cdiv
from kvreuse.cache.kv_cache_manager import Admission, KVCacheManager

BS = 4


def blocks_of(tokens):
    return [tokens[i : i + BS] for i in range(0, len(tokens), BS)]


def manager(n=8):
    pool = BlockPool(n, BS)
    return KVCacheManager(pool, model_id="m"), pool


def test_admit_hits_then_allocates_and_register_caches():
    kv, pool = manager()
    tokens = list(range(12))
    keys = hash_token_blocks(tokens, BS, model_id="m")
    first = kv.admit_blocks(keys, blocks_of(tokens), num_blocks=3)
    pool.check_integrity()
    assert isinstance(first, Admission) and first.num_hits == 0
    assert [b.block_id for b in first.blocks] == [0, 1, 2]
    held = list(first.blocks)
    kv.register_blocks(held, keys, blocks_of(tokens), 0, 3)
    pool.check_integrity()
    pool.release(reversed(held))
    pool.check_integrity()
    assert (pool.num_cached_blocks, pool.num_used_blocks) == (3, 0)
    # the same prefix, at most 2 hits (the last block's logits must be computed): 2 hits + 1 new
    again = kv.admit_blocks(keys, blocks_of(tokens), num_blocks=3, max_hits=2)
    pool.check_integrity()
    assert again.num_hits == 2 and [b.block_id for b in again.blocks] == [0, 1, 3]


def test_admit_returns_none_and_changes_nothing_when_full():
    kv, pool = manager(n=2)
    tokens = list(range(8))
    keys = hash_token_blocks(tokens, BS, model_id="m")
    held = list(kv.admit_blocks(keys, blocks_of(tokens), num_blocks=2).blocks)
    assert kv.admit_blocks([], [], num_blocks=1) is None
    pool.check_integrity()
    assert (pool.num_used_blocks, pool.num_free_blocks) == (2, 0)
    assert [b.ref_count for b in held] == [1, 1]


def test_duplicate_registration_adopts_the_registered_block_in_one_place():
    kv, pool = manager()
    tokens = list(range(8))
    keys, pieces = hash_token_blocks(tokens, BS, model_id="m"), blocks_of(tokens)
    a = list(kv.admit_blocks(keys, pieces, num_blocks=2, max_hits=0).blocks)
    b = list(kv.admit_blocks(keys, pieces, num_blocks=2, max_hits=0).blocks)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3]
    kv.register_blocks(a, keys, pieces, 0, 2)
    pool.check_integrity()
    kv.register_blocks(b, keys, pieces, 0, 2, retention=lambda j: (80, None))
    pool.check_integrity()
    # b now shares a's blocks; its own went back to the free queue
    assert [x.block_id for x in b] == [0, 1]
    assert [x.ref_count for x in a] == [2, 2] and pool.num_used_blocks == 2
    assert [x.priority for x in a] == [80, 80]  # the reuse's retention applies to the shared copy
    pool.release(reversed(a))
    pool.release(reversed(b))
    pool.check_integrity()
    assert pool.num_cached_blocks == 2


def test_hit_retention_priority_when_given_duration_always():
    kv, pool = manager()
    tokens = list(range(8))
    keys, pieces = hash_token_blocks(tokens, BS, model_id="m"), blocks_of(tokens)
    held = list(kv.admit_blocks(keys, pieces, num_blocks=2).blocks)
    kv.register_blocks(held, keys, pieces, 0, 2, retention=lambda j: (None, 5.0), default_priority=60)
    assert [(b.priority, b.duration_s) for b in held] == [(60, 5.0), (60, 5.0)]
    pool.release(reversed(held))
    again = kv.admit_blocks(keys, pieces, num_blocks=2, retention={0: (90, None)}.get)
    pool.check_integrity()
    assert [(b.priority, b.duration_s) for b in again.blocks] == [(90, None), (60, None)]
    assert DEFAULT_PRIORITY == 35


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_64"])
def test_incremental_chain_equals_the_one_shot_chain(algorithm):
    tokens = list(range(23))
    full = hash_token_blocks(tokens, BS, model_id="m", cache_salt="s", algorithm=algorithm)
    assert len(full) == 5
    hashes: list = []
    for upto in (0, 3, 4, 9, 17, 23, 23):
        extend_chain(hashes, tokens, BS, root_extra=root_extra_keys("m", "s"), algorithm=algorithm, upto_tokens=upto)
        assert hashes == full[: upto // BS]
    # a partial tail gets a key chained like any other block (PML modules)
    with_tail = extend_chain([], tokens, BS, root_extra=("pml",), algorithm=algorithm, partial_tail=True)
    assert len(with_tail) == 6
    assert with_tail[5] == hash_block(with_tail[4], tokens[20:], (), algorithm)
    # continuing from a parent is the same chain
    assert hash_token_blocks(tokens[8:], BS, model_id="m", algorithm=algorithm, parent=full[1]) == full[2:]


def test_cdiv_and_block_slots():
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert block_slots([7, 2], 2, 7, 4) == [30, 31, 8, 9, 10]
