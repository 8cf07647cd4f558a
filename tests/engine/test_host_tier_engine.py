"""The host tier through the real engine on tiny random-weight models: a prefix evicted from
the device pool is offloaded, onboarded on its next use, counted as cached tokens, and
gives the same logits as no caching (fp32, within 1e-4); a key is held in one tier at a time,
and the KV events keep a consumer (the router's index) equal to what the tiers hold."""

from collections import Counter

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import take_snapshot
from kvreuse.router.index import KVIndex, index_key
from tests.engine_helpers import LogitsSpy, reference_logits

ONE = SamplingParams(max_tokens=1, temperature=0)


def tiny_llm(loaded, **kwargs):
    # ~0.25 MB of device KV for the tiny models: a few dozen 4-token blocks
    return LLM(loaded=loaded, kv_cache_memory_gib=kwargs.pop("device_gib", 0.00025), block_size=4, **kwargs)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_prefix_evicted_to_host_is_onboarded_exactly(arch, request):
    loaded = request.getfixturevalue(arch)
    llm = tiny_llm(loaded, host_cache_memory_gib=0.001)
    engine = llm.engine
    device_blocks = engine.pool.num_blocks
    assert engine.host is not None and engine.host.pool.num_blocks > device_blocks
    n = 4 * (device_blocks - 2) + 1  # fills the device pool but for one block
    a = [(i * 37) % 4000 + 10 for i in range(n)]
    b = [(i * 53) % 4000 + 7 for i in range(n)]
    spy = LogitsSpy(llm)
    assert llm.generate(a, ONE)[0].num_cached_tokens == 0
    engine.check_integrity()
    llm.generate(b, ONE)  # evicts a's blocks: they go down to the host
    engine.check_integrity()
    assert engine.host.stats.offloaded_blocks >= (n - 1) // 4 - 1
    again = llm.generate(a, ONE)[0]
    engine.check_integrity()
    assert again.num_cached_tokens == n - 1  # every full block, from the host
    assert engine.host.stats.onboarded_blocks >= (n - 1) // 4 - 1
    ref = reference_logits(loaded.model, a)
    assert (spy.rows[-1] - ref[-1]).abs().max().item() <= 1e-4


def test_gate_above_every_priority_offloads_nothing(tiny_llama):
    llm = tiny_llm(tiny_llama, host_cache_memory_gib=0.001, host_offload_min_priority=101)
    n = 4 * (llm.engine.pool.num_blocks - 2) + 1
    a, b = list(range(10, 10 + n)), list(range(2000, 2004 + n))  # b takes the whole pool
    llm.generate(a, ONE)
    llm.generate(b, ONE)
    assert llm.engine.host.stats.offloaded_blocks == 0 and llm.engine.host.stats.skipped_blocks > 0
    assert llm.generate(a, ONE)[0].num_cached_tokens == 0
    llm.engine.check_integrity()


def test_reset_prefix_cache_drops_the_host_tier_too(tiny_llama):
    llm = tiny_llm(tiny_llama, host_cache_memory_gib=0.001)
    n = 4 * (llm.engine.pool.num_blocks - 2) + 1
    a, b = list(range(10, 10 + n)), list(range(2000, 2000 + n))
    llm.generate(a, ONE)
    llm.generate(b, ONE)
    assert llm.engine.host.pool.num_cached_blocks > 0
    llm.engine.reset_prefix_cache()
    assert llm.engine.host.pool.num_cached_blocks == 0 and llm.engine.pool.num_cached_blocks == 0
    assert llm.generate(a, ONE)[0].num_cached_tokens == 0
    llm.engine.check_integrity()


def test_host_settings_are_validated_naming_the_flag(tiny_llama):
    with pytest.raises(ValueError, match="--host-cache-memory"):
        tiny_llm(tiny_llama, host_cache_memory_gib=-1)
    with pytest.raises(ValueError, match="--host-offload-min-priority"):
        tiny_llm(tiny_llama, host_cache_memory_gib=0.001, host_offload_min_priority=200)


# The tiers are documented exclusive ("a block occupies one of them"; take_snapshot: "a block
# is held in one tier at a time"), but a block-aligned prompt computes its last full block
# itself (never a hit) and registers it on the device while the host still holds the same
# key. The snapshot then lists the key twice, and once the device copy is evicted (offload
# skips it: already on the host) the router's KVIndex forgets a block the host still holds.
def test_block_aligned_prompt_leaves_key_on_device_and_host(tiny_llama):
    buffer = EventBuffer(100000)
    llm = LLM(loaded=tiny_llama, events=buffer, kv_cache_memory_gib=0.00025, block_size=4, host_cache_memory_gib=0.001)
    engine = llm.engine
    n = 4 * (engine.pool.num_blocks - 2) + 1
    a = [(i * 37) % 4000 + 10 for i in range(n)]
    b = [(i * 53) % 4000 + 7 for i in range(n)]
    c = [(i * 29) % 4000 + 5 for i in range(n)]
    llm.generate(a, ONE)
    llm.generate(b, ONE)  # a goes down to the host
    aligned = a[:24]  # 6 full blocks: blocks 0-4 onboarded, block 5 computed (it holds the last token)
    out = llm.generate(aligned, ONE)[0]
    assert out.num_cached_tokens == 20
    engine.check_integrity()
    snap = take_snapshot(list(engine.cache.pools()), 0)
    twice = [h for h, k in Counter(blk.block_hash for blk in snap.blocks).items() if k > 1]
    levels = {blk.cache_level for blk in snap.blocks if blk.block_hash in twice}
    print("keys held in two tiers:", len(twice), levels)
    llm.generate(c, ONE)  # evicts the device copies again
    index = KVIndex()
    index.add_executor("e")
    for event in buffer.get_events(after_id=-1, max_events=10**9):
        assert index.apply("e", event)
    snap = take_snapshot(list(engine.cache.pools()), 0)
    truth = {index_key(blk.block_hash) for blk in snap.blocks}
    missing = truth - set(index.mirror("e").levels)
    print("blocks the engine holds that the router index lacks:", len(missing))
    assert not twice, "a key is registered on the device and the host at once"
    assert not missing


# reset_prefix_cache with a host tier while a request runs: the host pool, emptied, emits
# AllBlocksCleared (no level), and a consumer (the router's KVIndex) drops the running
# request's device blocks that the engine still holds and reports in its snapshot.
def test_reset_with_running_request_keeps_consumer_equal_to_state(tiny_llama):
    buffer = EventBuffer(100000)
    llm = LLM(loaded=tiny_llama, events=buffer, kv_cache_memory_gib=0.00025, block_size=4, host_cache_memory_gib=0.001)
    engine = llm.engine
    n = 4 * (engine.pool.num_blocks - 2) + 1
    a = [(i * 37) % 4000 + 10 for i in range(n)]
    b = [(i * 53) % 4000 + 7 for i in range(n)]
    llm.generate(a, ONE)
    llm.generate(b, ONE)  # a's blocks go down to the host
    assert engine.host.pool.num_cached_blocks > 0
    # a request that is running (prompt computed and registered, still decoding)
    engine.add_request("r", [(i * 11) % 4000 + 3 for i in range(21)], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.pool.num_used_blocks > 0
    index = KVIndex()
    index.add_executor("e")
    for event in buffer.get_events(after_id=-1, max_events=10**9):
        index.apply("e", event)
    engine.reset_prefix_cache()
    new = buffer.get_events(after_id=index.mirror("e").last_event_id, max_events=10**9)
    for event in new:
        assert index.apply("e", event)
    truth: dict[int, frozenset[str]] = {}
    for b in take_snapshot(list(engine.cache.pools()), 0).blocks:
        truth[index_key(b.block_hash)] = truth.get(index_key(b.block_hash), frozenset()) | {b.cache_level}
    print("events after reset:", [type(e.data).__name__ for e in new])
    print("engine still holds", len(truth), "registered blocks; consumer sees", len(index.mirror("e").levels))
    assert index.mirror("e").levels == truth
    engine.check_integrity()
