"""Host tier below a device pool: offload on evict (priority gate), admission continues the
chain on the host, onboarding moves blocks up (exclusive tiers); exact block ids, integrity
of both pools after every operation."""

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.cache.host_tier import HOST_LEVEL, HostTier, OffloadPolicy
from kvreuse.cache.kv_cache_manager import KVCacheManager

BS = 4


class Mover:
    def __init__(self):
        self.calls = []

    def offload(self, device_ids, host_ids):
        self.calls.append(("offload", list(device_ids), list(host_ids)))

    def onboard(self, host_ids, device_ids):
        self.calls.append(("onboard", list(host_ids), list(device_ids)))


def setup(device=3, host=4, min_priority=35):
    mover = Mover()
    tier = HostTier(host, BS, mover=mover, offload_policy=OffloadPolicy(min_priority))
    pool = BlockPool(device, BS, record_evictions=True)
    return KVCacheManager(pool, lower=tier), pool, tier, mover


def check(pool, tier):
    pool.check_integrity()
    tier.check_integrity()


def run(kv, tokens, *, priority=None):
    keys = hash_token_blocks(tokens, BS, model_id="m")
    pieces = [tokens[i : i + BS] for i in range(0, len(tokens), BS)]
    adm = kv.admit_blocks(keys, pieces, num_blocks=len(pieces))
    blocks = list(adm.blocks)
    kv.register_blocks(
        blocks,
        keys,
        pieces,
        adm.num_hits,
        len(keys),
        retention=(lambda j: (priority, None)) if priority is not None else (lambda j: None),
    )
    kv.pool.release(reversed(blocks))
    return adm, blocks


def test_evicted_chain_goes_to_host_and_comes_back_as_hits():
    kv, pool, tier, mover = setup()
    a = list(range(12))  # 3 blocks: fills the device pool
    adm, blocks = run(kv, a)
    check(pool, tier)
    assert [b.block_id for b in blocks] == [0, 1, 2] and adm.num_hits == 0
    b = list(range(100, 112))  # another 3 blocks evict all of a, leaf first
    run(kv, b)
    check(pool, tier)
    assert mover.calls == [("offload", [0, 1, 2], [0, 1, 2])]  # parents first, into host 0..2
    assert tier.pool.num_cached_blocks == 3 and tier.stats.offloaded_blocks == 3
    # a again: nothing on the device, the whole chain on the host -> onboarded
    mover.calls.clear()
    adm, blocks = run(kv, a)
    check(pool, tier)
    assert adm.num_hits == 3 and adm.num_onboarded == 3
    # the device evicted b (into host 3 and the freed host 0.. after onboarding) then onboarded a
    assert mover.calls[0][0] == "offload" and mover.calls[-1] == ("onboard", [0, 1, 2], [b.block_id for b in blocks])
    assert all(pool.get_cached(k) is not None for k in hash_token_blocks(a, BS, model_id="m"))
    assert not any(tier.pool.get_cached(k) for k in hash_token_blocks(a, BS, model_id="m"))  # exclusive
    assert tier.pool.cache_level == HOST_LEVEL


def test_blocks_under_the_priority_gate_are_dropped():
    kv, pool, tier, mover = setup(min_priority=50)
    run(kv, list(range(12)), priority=20)
    run(kv, list(range(100, 112)), priority=80)
    check(pool, tier)
    assert mover.calls == [] and tier.stats.skipped_blocks == 3 and tier.pool.num_cached_blocks == 0
    run(kv, list(range(200, 212)))  # evicts the priority-80 chain: kept
    check(pool, tier)
    assert tier.pool.num_cached_blocks == 3 and [c[0] for c in mover.calls] == ["offload"]


def test_device_prefix_then_host_continuation():
    kv, pool, tier, mover = setup(device=4, host=4)
    a = list(range(16))
    run(kv, a)  # 4 blocks
    run(kv, list(range(100, 108)))  # 2 blocks: evicts a's last two (leaves) to the host
    check(pool, tier)
    assert tier.pool.num_cached_blocks == 2
    adm, _ = run(kv, a)
    check(pool, tier)
    assert (adm.num_hits, adm.num_onboarded) == (4, 2)


def test_failed_admission_gives_host_hits_back():
    kv, pool, tier, mover = setup(device=2, host=4)
    a = list(range(8))
    run(kv, a)
    run(kv, list(range(100, 108)))  # a -> host
    held = list(kv.admit_blocks([], [], num_blocks=2).blocks)  # the device is full and held
    keys = hash_token_blocks(a, BS, model_id="m")
    assert kv.admit_blocks(keys, [a[:4], a[4:]], num_blocks=2) is None
    check(pool, tier)
    assert tier.pool.num_used_blocks == 0 and tier.pool.num_cached_blocks == 4  # a, then b, went down
    pool.release(held)
    check(pool, tier)
