"""The tiers are documented exclusive ("a block occupies one of them"; take_snapshot: "a block
is held in one tier at a time"), but a block-aligned prompt computes its last full block
itself (never a hit) and registers it on the device while the host still holds the same
key. The snapshot then lists the key twice, and once the device copy is evicted (offload
skips it: already on the host) the router's KVIndex forgets a block the host still holds."""

from collections import Counter

from kvreuse import LLM, SamplingParams
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import take_snapshot
from kvreuse.router.index import KVIndex, index_key

ONE = SamplingParams(max_tokens=1, temperature=0)


def test_block_aligned_prompt_leaves_key_on_device_and_host(tiny_llama):
    buffer = EventBuffer(100000)
    llm = LLM(loaded=tiny_llama, events=buffer, kv_cache_memory_gib=0.00025, block_size=4,
              host_cache_memory_gib=0.001)
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
    snap = take_snapshot(list(engine.cache_pools()), 0)
    twice = [h for h, k in Counter(blk.block_hash for blk in snap.blocks).items() if k > 1]
    levels = {blk.cache_level for blk in snap.blocks if blk.block_hash in twice}
    print("keys held in two tiers:", len(twice), levels)
    llm.generate(c, ONE)  # evicts the device copies again
    index = KVIndex()
    index.add_executor("e")
    for event in buffer.get_events(after_id=-1, max_events=10**9):
        assert index.apply("e", event)
    snap = take_snapshot(list(engine.cache_pools()), 0)
    truth = {index_key(blk.block_hash) for blk in snap.blocks}
    missing = truth - set(index.mirror("e").levels)
    print("blocks the engine holds that the router index lacks:", len(missing))
    assert not twice, "a key is registered on the device and the host at once"
    assert not missing
