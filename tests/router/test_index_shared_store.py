"""Executors sharing a remote store reach each other's REMOTE blocks: the index keeps every
level an executor holds a key at, and a key held at REMOTE by one executor of a store counts
(at the REMOTE weight) for every executor of that store, and for no other."""

from kvreuse.events.records import BlocksRemoved, BlocksStored, BlockUpdated, StoredBlock
from kvreuse.router.index import KVIndex
from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS

W = DEFAULT_TIER_WEIGHTS  # GPU 1.0, CPU 0.997, DISK 0.992, REMOTE 0.970
KEYS = [1, 2, 3, 4, 5]


def cluster():
    index = KVIndex()
    for name in "abcd":
        index.add_executor(name)
    index.set_store("a", "store-s")
    index.set_store("b", "store-s")
    index.set_store("d", "store-t")  # another Redis (or namespace): shares nothing with a, b
    index.store("a", [1, 2, 3], "GPU")
    index.store("a", [1, 2, 3, 4], "REMOTE")  # written through; 4 only in Redis now
    index.store("b", [1], "GPU")
    index.check_integrity()
    return index


def test_remote_blocks_count_for_every_executor_of_the_store_at_the_remote_weight():
    index = cluster()
    assert index.overlaps(KEYS, list("abcd")) == {"a": 4, "b": 4, "c": 0, "d": 0}
    assert index.overlaps(KEYS, list("abcd"), W) == {
        "a": float(sum([W["GPU"], W["GPU"], W["GPU"], W["REMOTE"]])),  # its own best level per block
        "b": float(sum([W["GPU"], W["REMOTE"], W["REMOTE"], W["REMOTE"]])),  # 1 on its device, 2-4 through the store
        "c": 0.0, "d": 0.0}
    assert index.reach(2) == index.mirror("a").bit | index.mirror("b").bit
    assert index.reachable_levels("b", 1) == {"GPU", "REMOTE"} and index.reachable_levels("c", 1) == frozenset()
    assert index.level_of("a", 1) == "GPU" and index.level_of("b", 2) is None  # its own levels only


def test_a_remote_removal_ends_the_reach_and_the_device_copy_stays():
    index = cluster()
    index.apply_record("a", BlocksRemoved((b"\x00" * 24 + (2).to_bytes(8, "big"),), "REMOTE"))
    index.check_integrity()
    assert index.mirror("a").levels[2] == {"GPU"}  # still on a's device
    assert index.overlaps(KEYS, ["a", "b"], W) == {"a": float(sum([W["GPU"]] * 3 + [W["REMOTE"]])), "b": W["GPU"]}
    index.remove("a", [1, 2, 3], "GPU")  # a's device evicts: what a holds in Redis is still a's too
    index.check_integrity()
    assert index.overlaps(KEYS, ["a", "b"], W) == {"a": W["REMOTE"], "b": W["GPU"]}


def test_store_membership_follows_set_store_and_clear_forgets_the_remote_holders():
    index = cluster()
    index.set_store("c", "store-s")  # c now shares the store
    index.set_store("b", None)  # b no longer does
    index.check_integrity()
    assert index.overlaps(KEYS, list("abc")) == {"a": 4, "b": 1, "c": 4}
    index.clear("a")  # a restarted: its announcements are gone, the store's blocks unknown
    index.check_integrity()
    assert index.remote_holders == {} and index.overlaps(KEYS, list("abc")) == {"a": 0, "b": 1, "c": 0}


def test_a_block_held_at_two_levels_survives_a_move_of_one_of_them():
    index = KVIndex()
    index.add_executor("a")
    h = b"\x00" * 24 + (7).to_bytes(8, "big")
    index.apply_record("a", BlocksStored(None, (StoredBlock(h, (1, 2), 35, "GPU"),), 2))
    index.apply_record("a", BlocksStored(None, (StoredBlock(h, (1, 2), 35, "DISK"),), 2))  # a disk copy
    index.apply_record("a", BlockUpdated(h, old_cache_level="GPU", new_cache_level="CPU"))
    assert index.mirror("a").levels[7] == {"CPU", "DISK"}
    index.apply_record("a", BlocksRemoved((h,), "CPU"))
    assert index.mirror("a").levels[7] == {"DISK"} and index.overlaps([7], ["a"], W) == {"a": W["DISK"]}
    index.apply_record("a", BlocksRemoved((h,), None))  # no level named: gone everywhere
    index.check_integrity()
    assert index.mirror("a").levels == {} and index.holders == {}


def test_the_shared_store_sends_a_request_to_an_idle_executor_of_the_store():
    import random

    from kvreuse.router.policy import Candidate, KVPolicy, choose

    index = cluster()
    load = {"a": 6.0, "b": 0.0, "c": 0.0}  # a is busy; b and c idle
    overlaps = index.overlaps(KEYS, list("abc"), W)
    cands = [Candidate(n, overlaps[n], len(KEYS), load[n], 0) for n in "abc"]
    decision = choose(KVPolicy(overlap_weight=8.0), cands, random.Random(0))
    assert decision.scores == {"a": 8.0 * (5 - overlaps["a"]) + 6.0, "b": 8.0 * (5 - overlaps["b"]), "c": 40.0}
    assert decision.choice == "b"  # 4 blocks it can read back from Redis, and no queue
    index.set_store("b", None)  # without the shared store, b holds 1 block: busy a wins
    overlaps = index.overlaps(KEYS, list("abc"), W)
    cands = [Candidate(n, overlaps[n], len(KEYS), load[n], 0) for n in "abc"]
    assert overlaps["b"] == W["GPU"] and choose(KVPolicy(overlap_weight=8.0), cands, random.Random(0)).choice == "a"
