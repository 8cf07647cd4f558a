"""The router's index (events, gaps, snapshots), its policies, and key computation."""

from __future__ import annotations

import random

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import event_from_json, event_to_json, take_snapshot
from kvreuse.router.index import KVIndex, index_key
from kvreuse.router.policy import Candidate, KVPolicy, choose, make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher

BS = 4


def _fill(pool: BlockPool, tokens: list[int], model_id: str = "m") -> list[bytes]:
    """Register ``tokens``' full blocks in ``pool`` as an engine would, then release them."""
    keys = hash_token_blocks(tokens, BS, model_id=model_id)
    blocks = pool.allocate(len(keys))
    parent = None
    for i, (block, key) in enumerate(zip(blocks, keys)):
        pool.register(block, key, parent, tokens[i * BS : (i + 1) * BS], depth=i)
        parent = key
    pool.release(reversed(blocks))
    return keys


def _executor(index: KVIndex, name: str, num_blocks: int = 64):
    buffer = EventBuffer(1000)
    index.add_executor(name)
    return BlockPool(num_blocks, BS, events=buffer), buffer


def _sync(index: KVIndex, name: str, buffer: EventBuffer) -> bool:
    """Apply everything new through the JSON form, as the HTTP subscriber does."""
    events = buffer.get_events(index.mirror(name).last_event_id)
    return all(index.apply(name, event_from_json(event_to_json(e))) for e in events)


def test_overlap_follows_each_executors_events():
    index = KVIndex()
    pool_a, buf_a = _executor(index, "a")
    pool_b, buf_b = _executor(index, "b")
    shared = list(range(16))  # 4 blocks
    _fill(pool_a, shared + [100, 101, 102, 103])  # a: 5 blocks
    _fill(pool_b, shared[:8])  # b: first 2 blocks
    assert _sync(index, "a", buf_a) and _sync(index, "b", buf_b)
    keys = [index_key(k) for k in hash_token_blocks(shared + [100, 101, 102, 103, 7, 7, 7, 7], BS, model_id="m")]
    assert index.overlaps(keys, ["a", "b"]) == {"a": 5, "b": 2}
    # eviction on a (pool of 5 filled by new blocks) is seen as removal
    pool_a.evict_all_cached()
    assert _sync(index, "a", buf_a)
    assert index.overlaps(keys, ["a", "b"]) == {"a": 0, "b": 2}
    other_model = [index_key(k) for k in hash_token_blocks(shared, BS, model_id="other")]
    assert index.overlaps(other_model, ["a", "b"]) == {"a": 0, "b": 0}


def test_gap_is_refused_and_snapshot_resynchronises():
    index = KVIndex()
    pool, buffer = _executor(index, "a")
    _fill(pool, list(range(8)))
    _fill(pool, list(range(50, 58)))
    events = buffer.get_events(-1)
    assert index.apply("a", events[0])
    assert not index.apply("a", events[2])  # events[1] lost: refused, nothing changed
    assert index.mirror("a").last_event_id == events[0].event_id
    index.load("a", take_snapshot(pool, buffer.last_event_id))
    keys = [index_key(k) for k in hash_token_blocks(list(range(50, 58)), BS, model_id="m")]
    assert index.overlaps(keys, ["a"]) == {"a": 2}
    assert index.mirror("a").last_event_id == buffer.last_event_id
    assert index.num_keys == 4


def test_removal_at_another_level_keeps_the_block():
    index = KVIndex()
    index.add_executor("a")
    index.store("a", [1, 2], level="CPU")
    index.remove("a", [1], level="GPU")
    assert index.overlaps([1, 2], ["a"]) == {"a": 2}
    index.remove("a", [1])
    assert index.overlaps([1, 2], ["a"]) == {"a": 0}


def test_kv_policy_prefers_the_holder_until_it_is_much_busier():
    policy = KVPolicy(overlap_weight=2.0)
    rng = random.Random(0)
    holder = Candidate("a", overlap_blocks=10, prompt_blocks=10, load_blocks=15, in_flight=1)
    idle = Candidate("b", overlap_blocks=0, prompt_blocks=10, load_blocks=0, in_flight=0)
    decision = choose(policy, [holder, idle], rng)
    assert decision.choice == "a" and decision.scores == {"a": 15.0, "b": 20.0}
    busier = Candidate("a", 10, 10, 25, 2)
    assert choose(policy, [busier, idle], rng).choice == "b"


def test_ties_are_broken_at_random_and_round_robin_rotates():
    rng = random.Random(1)
    same = [Candidate(n, 0, 4, 0, 0) for n in "abc"]
    picks = {choose(make_policy("kv"), same, rng).choice for _ in range(50)}
    assert picks == {"a", "b", "c"}
    rr = make_policy("round_robin")
    assert [choose(rr, same, rng).choice for _ in range(6)] == list("abcabc")
    loaded = [Candidate("a", 4, 4, 9, 1), Candidate("b", 0, 4, 3, 1)]
    assert choose(make_policy("least_loaded"), loaded, rng).choice == "b"
    with pytest.raises(ValueError, match="--routing-policy"):
        make_policy("nope")


def test_memoised_keys_equal_the_shared_hash():
    hasher = PromptHasher(None, HashSettings("m", BS, "sha256"), memo_blocks=8)
    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(30)]
    for salt in (None, "tenant"):
        for tokens in (base[:13], base, base[:9] + [1, 2, 3, 4, 5, 6, 7]):
            expect = [index_key(k) for k in hash_token_blocks(tokens, BS, model_id="m", cache_salt=salt)]
            assert hasher.keys(tokens, salt) == expect
    assert len(hasher._memo) <= 8
    assert hasher.keys(base, None) != hasher.keys(base, "tenant")


def test_tier_weights_count_each_held_block_by_its_level():
    from kvreuse.router.index import KVIndex
    from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS, parse_tier_weights

    index = KVIndex()
    index.add_executor("a")
    index.add_executor("b")
    index.store("a", [1, 2, 3, 4])  # all on the device
    index.store("b", [1, 2], "GPU")
    index.store("b", [3, 4], "CPU")  # the tail went down to b's host tier
    assert index.overlaps([1, 2, 3, 4, 5], ["a", "b"]) == {"a": 4, "b": 4}
    weights = parse_tier_weights("host=0.5")
    assert weights == {**DEFAULT_TIER_WEIGHTS, "CPU": 0.5}
    assert index.overlaps([1, 2, 3, 4, 5], ["a", "b"], weights) == {"a": 4.0, "b": 3.0}
    # a move between tiers (removed at one level, stored at the other) is followed
    index.remove("b", [3, 4], "CPU")
    index.store("b", [3, 4], "GPU")
    assert index.overlaps([1, 2, 3, 4], ["b"], weights) == {"b": 4.0}
    for bad in ("host", "host=2", "tape=0.5", "host=nan"):
        with pytest.raises(ValueError, match="--tier-weights"):
            parse_tier_weights(bad)
