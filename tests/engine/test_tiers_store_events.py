"""Disk and remote blocks in the KV events and the snapshot, through the real engine (tiny
random Llama, small device and host pools, a disk cap of a few blocks, a real redis-server):
the events rebuild every level exactly as the snapshot lists it; the disk ledger is the disk
index exactly; Redis's own losses show up as removals when a read finds them."""

import redis

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import BlocksRemoved, BlocksStored
from kvreuse.server.metrics import _tier_metrics
from tests.events.event_helpers import LevelMirror, snapshot_levels
from tests.tiers.conftest import redis_server  # noqa: F401  (a real redis-server per test)

ONE = SamplingParams(max_tokens=1, temperature=0)
PROMPTS = [[(i * (31 + 2 * p)) % 4000 + 10 + p for i in range(61)] for p in range(8)]  # 15 full blocks + 1 each


def executor(loaded, tmp_path, url):
    buffer = EventBuffer(1_000_000)
    llm = LLM(loaded=loaded, events=buffer, kv_cache_memory_gib=0.00005, block_size=4,  # 26 device blocks
              host_cache_memory_gib=0.00005, disk_cache_dir=str(tmp_path), disk_cache_size_gib=0.00005,
              remote_cache=url)
    return llm, buffer


def settled(llm):
    """Every queued write done and applied; the engine's bookkeeping checked."""
    assert llm.engine.stores.flush(30)
    llm.engine.sync_stores()
    llm.engine.check_integrity()


def keys_of(llm, prompt):
    return hash_token_blocks(prompt, 4, model_id=llm.engine.model_id)


def redis_keys(llm, url):
    prefix = llm.engine.stores.remote.prefix
    return {bytes.fromhex(k.decode()[len(prefix):]) for k in redis.Redis.from_url(url).scan_iter(prefix + "*")}


def test_events_rebuild_every_level_and_the_ledgers_match_the_stores(tiny_llama, tmp_path, redis_server):
    llm, buffer = executor(tiny_llama, tmp_path, redis_server.url)
    engine = llm.engine
    for prompt in PROMPTS:
        llm.generate(prompt, ONE)
    settled(llm)
    mirror = LevelMirror()
    mirror.apply_all(buffer.get_events(after_id=-1, max_events=10**9))
    snap = engine.kv_snapshot()
    assert snap.last_event_id == mirror.last_event_id
    assert mirror.nonempty() == snapshot_levels(snap)
    assert set(mirror.levels) == {"GPU", "CPU", "DISK", "REMOTE"}
    disk, remote = engine.host.ledgers["DISK"], engine.host.ledgers["REMOTE"]
    assert {b.block_hash for b in disk.cached_hashes()} == set(engine.stores.disk.keys())
    assert engine.stores.disk.stats()["evictions"] == disk.num_removed > 0  # the cap, reported
    every_key = {k for p in PROMPTS for k in keys_of(llm, p)}
    assert {b.block_hash for b in remote.cached_hashes()} == redis_keys(llm, redis_server.url) == every_key
    # /metrics counts per tier exactly what the events said
    events = [e.data for e in buffer.get_events(after_id=-1, max_events=10**9)]
    said = {(stat, level): 0 for stat in ("blocks_stored", "blocks_removed") for level in ("CPU", "DISK", "REMOTE")}
    for d in events:
        if isinstance(d, BlocksStored) and d.blocks[0].cache_level != "GPU":
            said["blocks_stored", d.blocks[0].cache_level] += len(d.blocks)
        elif isinstance(d, BlocksRemoved) and d.cache_level != "GPU":
            said["blocks_removed", d.cache_level] += len(d.block_hashes)
    names = {"CPU": "host", "DISK": "disk", "REMOTE": "remote"}
    families = {f.name: f for f in _tier_metrics(engine.stats(), [], [])}
    for (stat, level), n in said.items():
        family = families[f"kvreuse:kv_tier_{stat}"]
        assert family.type == "counter"
        assert [s.value for s in family.samples if s.labels["tier"] == names[level]] == [n]
    held = {s.labels["tier"]: s.value for s in families["kvreuse:kv_tier_blocks_held"].samples}
    assert held == {names[lv]: len(mirror.levels[lv]) for lv in names}
    assert families["kvreuse:kv_tier_writes_pending"].samples[0].value == 0

    # Redis loses everything unseen; the ledger keeps announcing it until a read finds a key missing
    redis.Redis.from_url(redis_server.url).flushall()
    last = buffer.last_event_id
    first = keys_of(llm, PROMPTS[0])
    assert not {b.block_hash for p in engine.cache_pools()[:3] for b in p.cached_hashes()} & set(first)
    out = llm.generate(PROMPTS[0], ONE)[0]  # long gone from device, host and disk: asks Redis
    assert out.num_cached_tokens == 0
    settled(llm)
    new = [e.data for e in buffer.get_events(after_id=last, max_events=10**9)]
    removed = [h for d in new if isinstance(d, BlocksRemoved) and d.cache_level == "REMOTE" for h in d.block_hashes]
    assert removed == first  # every key the read found missing, in request order
    rewritten = {b.block_hash for d in new if isinstance(d, BlocksStored) for b in d.blocks if b.cache_level == "REMOTE"}
    assert rewritten == set(first)  # announced again once recomputed and written through
    # Redis holds them and the host's spills since; all announced (the ledger kept the spilled ones)
    assert set(first) < redis_keys(llm, redis_server.url) < {b.block_hash for b in remote.cached_hashes()} == every_key
    mirror.apply_all(buffer.get_events(after_id=mirror.last_event_id, max_events=10**9))
    assert mirror.nonempty() == snapshot_levels(engine.kv_snapshot())


def test_reset_clears_the_device_and_host_and_announces_the_stores_again(tiny_llama, tmp_path, redis_server):
    llm, buffer = executor(tiny_llama, tmp_path, redis_server.url)
    for prompt in PROMPTS[:3]:
        llm.generate(prompt, ONE)
    settled(llm)
    before = snapshot_levels(llm.engine.kv_snapshot())
    llm.engine.reset_prefix_cache()
    llm.engine.check_integrity()
    mirror = LevelMirror()
    mirror.apply_all(buffer.get_events(after_id=-1, max_events=10**9))  # AllBlocksCleared, then the stores
    assert mirror.nonempty() == snapshot_levels(llm.engine.kv_snapshot())
    assert mirror.nonempty() == {"DISK": before["DISK"], "REMOTE": before["REMOTE"]}
