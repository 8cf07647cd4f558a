"""Disk and Redis tiers through the real engine (tiny random-weight Llama, fp32): a restarted
executor hits its own disk, a corrupted block file is refused and recomputed, two executors
share a real redis-server, a killed Redis costs a recompute and no request, salts share
nothing. Logits of onboarded prefixes equal no caching within 1e-4. Then the stores in the KV
events and the snapshot, disk hits on a waiting request, and a stress run over every tier."""

import random

import pytest
import redis

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import BlocksRemoved, BlocksStored
from kvreuse.server.metrics import _tier_metrics
from tests.engine_helpers import LogitsSpy, reference_logits
from tests.events.event_helpers import LevelMirror, snapshot_levels
from tests.tiers.conftest import redis_server  # noqa: F401  (a real redis-server per test)

ONE = SamplingParams(max_tokens=1, temperature=0)
GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPT = [(i * 37) % 4000 + 10 for i in range(61)]  # 15 full blocks of 4 + 1 token


def executor(loaded, **tiers):
    return LLM(loaded=loaded, kv_cache_memory_gib=0.001, block_size=4, host_cache_memory_gib=0.001, **tiers)


def written(llm):
    assert llm.engine.host.below.flush(30)
    return llm


def test_restarted_executor_hits_its_own_disk(tiny_llama, tmp_path):
    first = written(executor(tiny_llama, disk_cache_dir=str(tmp_path)))
    assert first.generate(PROMPT, ONE)[0].num_cached_tokens == 0
    written(first)
    restarted = executor(tiny_llama, disk_cache_dir=str(tmp_path))  # a new engine: empty device and host
    spy = LogitsSpy(restarted)
    out = restarted.generate(PROMPT, ONE)[0]
    restarted.engine.check_integrity()
    assert out.num_cached_tokens == 60
    assert restarted.engine.host.stats.loaded_blocks == 15
    assert (spy.rows[-1] - reference_logits(tiny_llama.model, PROMPT)[-1]).abs().max().item() <= 1e-4


def test_corrupted_block_file_is_refused_counted_and_recomputed(tiny_llama, tmp_path):
    first = written(executor(tiny_llama, disk_cache_dir=str(tmp_path)))
    first.generate(PROMPT, ONE)
    written(first)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(files) == 15
    restarted = executor(tiny_llama, disk_cache_dir=str(tmp_path))
    disk = restarted.engine.host.below.disk
    # corrupt the 6th block of the chain: its bytes flipped in the middle of the KV
    victim = disk._path(first_keys(restarted)[5])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    spy = LogitsSpy(restarted)
    out = restarted.generate(PROMPT, ONE)[0]
    restarted.engine.check_integrity()
    assert out.num_cached_tokens == 20  # the first 5 blocks; the 6th is refused, the rest recomputed
    assert disk.stats()["corrupt"] == 1
    # the refused file was deleted; the recomputed block is written through again, verified
    written(restarted)
    assert victim.read_bytes() != bytes(data)
    assert disk.get(first_keys(restarted)[5], shape=restarted.engine.host.below.block_shape) is not None
    assert (spy.rows[-1] - reference_logits(tiny_llama.model, PROMPT)[-1]).abs().max().item() <= 1e-4


def first_keys(llm):
    from kvreuse.cache.hashing import hash_token_blocks

    return hash_token_blocks(PROMPT, 4, model_id=llm.engine.model_id)


def test_two_executors_share_one_redis_and_survive_its_death(tiny_llama, redis_server):
    a = executor(tiny_llama, remote_cache=redis_server.url)
    b = executor(tiny_llama, remote_cache=redis_server.url)
    fresh = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, enable_prefix_caching=False)
    expected = fresh.generate(PROMPT, GREEDY)[0].token_ids
    assert a.generate(PROMPT, GREEDY)[0].token_ids == expected
    written(a)
    on_b = b.generate(PROMPT, GREEDY)[0]
    b.engine.check_integrity()
    assert on_b.num_cached_tokens == 60 and on_b.token_ids == expected  # computed on A, a hit on B
    assert b.engine.host.below.stats.remote_hits == 15
    # salts share nothing, across executors too
    assert a.generate(PROMPT, ONE, cache_salt="tenant-1")[0].num_cached_tokens == 0
    written(a)
    assert b.generate(PROMPT, ONE, cache_salt="tenant-2")[0].num_cached_tokens == 0
    assert b.generate(PROMPT, ONE, cache_salt="tenant-1")[0].num_cached_tokens == 60
    # Redis dies: every request still completes (recomputed), none fails
    redis_server.stop()
    other = [t + 1 for t in PROMPT]
    outs = [b.generate(other, GREEDY)[0] for _ in range(3)] + [a.generate(other, GREEDY)[0]]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[-1].token_ids == fresh.generate(other, GREEDY)[0].token_ids
    a.engine.check_integrity()
    b.engine.check_integrity()


# Disk and remote blocks in the KV events and the snapshot, through the real engine (tiny
# random Llama, small device and host pools, a disk cap of a few blocks, a real redis-server):
# the events rebuild every level exactly as the snapshot lists it; the disk ledger is the disk
# index exactly; Redis's own losses show up as removals when a read finds them.
PROMPTS = [[(i * (31 + 2 * p)) % 4000 + 10 + p for i in range(61)] for p in range(8)]  # 15 full blocks + 1 each


def events_executor(loaded, tmp_path, url):
    buffer = EventBuffer(1_000_000)
    llm = LLM(
        loaded=loaded,
        events=buffer,
        kv_cache_memory_gib=0.00005,
        block_size=4,  # 26 device blocks
        host_cache_memory_gib=0.00005,
        disk_cache_dir=str(tmp_path),
        disk_cache_size_gib=0.00005,
        remote_cache=url,
    )
    return llm, buffer


def settled(llm):
    """Every queued write done and applied; the engine's bookkeeping checked."""
    assert llm.engine.stores.flush(30)
    llm.engine.cache.sync_stores()
    llm.engine.check_integrity()


def keys_of(llm, prompt):
    return hash_token_blocks(prompt, 4, model_id=llm.engine.model_id)


def redis_keys(llm, url):
    prefix = llm.engine.stores.remote.prefix
    return {bytes.fromhex(k.decode()[len(prefix) :]) for k in redis.Redis.from_url(url).scan_iter(prefix + "*")}


def test_events_rebuild_every_level_and_the_ledgers_match_the_stores(tiny_llama, tmp_path, redis_server):
    llm, buffer = events_executor(tiny_llama, tmp_path, redis_server.url)
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
    assert not {b.block_hash for p in engine.cache.pools()[:3] for b in p.cached_hashes()} & set(first)
    out = llm.generate(PROMPTS[0], ONE)[0]  # long gone from device, host and disk: asks Redis
    assert out.num_cached_tokens == 0
    settled(llm)
    new = [e.data for e in buffer.get_events(after_id=last, max_events=10**9)]
    removed = [h for d in new if isinstance(d, BlocksRemoved) and d.cache_level == "REMOTE" for h in d.block_hashes]
    assert removed == first  # every key the read found missing, in request order
    rewritten = {
        b.block_hash for d in new if isinstance(d, BlocksStored) for b in d.blocks if b.cache_level == "REMOTE"
    }
    assert rewritten == set(first)  # announced again once recomputed and written through
    # Redis holds them and the host's spills since; all announced (the ledger kept the spilled ones)
    assert set(first) < redis_keys(llm, redis_server.url) < {b.block_hash for b in remote.cached_hashes()} == every_key
    mirror.apply_all(buffer.get_events(after_id=mirror.last_event_id, max_events=10**9))
    assert mirror.nonempty() == snapshot_levels(engine.kv_snapshot())


def test_reset_clears_the_device_and_host_and_announces_the_stores_again(tiny_llama, tmp_path, redis_server):
    llm, buffer = events_executor(tiny_llama, tmp_path, redis_server.url)
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


# A waiting request whose prefix is on disk is re-matched against the stores on every
# scheduler step while the device pool has no room: each failed admission reads (and
# verifies) every stored block again on the engine thread, and counts them as disk hits.
def disk_executor(loaded, d):
    return LLM(
        loaded=loaded, kv_cache_memory_gib=0.00025, block_size=4, host_cache_memory_gib=0.001, disk_cache_dir=str(d)
    )


def test_disk_hits_count_only_loaded_blocks(tiny_llama, tmp_path):
    prompt = [(i * 37) % 4000 + 10 for i in range(21)]  # 5 full blocks + 1 token
    first = disk_executor(tiny_llama, tmp_path)
    first.generate(prompt, ONE)
    assert first.engine.host.below.flush(30)
    llm = disk_executor(tiny_llama, tmp_path)  # restarted: the prefix is on disk only
    engine = llm.engine
    n = engine.pool.num_blocks
    long_prompt = [(i * 53) % 4000 + 7 for i in range(4 * (n - 3))]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("p", prompt, ONE)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        steps += 1
    disk = engine.host.below.disk.stats()
    print(
        "steps",
        steps,
        "loaded_blocks",
        engine.host.stats.loaded_blocks,
        "disk hits",
        disk["hits"],
        "PersistentStats.disk_hits",
        engine.host.below.stats.disk_hits,
    )
    assert engine.host.stats.loaded_blocks == 5
    assert engine.host.below.stats.disk_hits == engine.host.stats.loaded_blocks
    assert disk["hits"] == engine.host.stats.loaded_blocks


# Concurrent requests with shared prefixes, aborts and preemption on a small device pool, a
# host tier smaller than one request, and a disk tier: integrity after every step, and every
# finished request's greedy output equals a no-caching engine's.
def run_all(llm, prompts, aborts, check):
    engine = llm.engine
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    step = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.output_token_ids) if hasattr(o, "output_token_ids") else o
        step += 1
        if step in aborts:
            engine.abort_request(aborts[step])
        if check:
            engine.check_integrity()
    return outs


@pytest.mark.parametrize("arch,host_blocks", [("tiny_llama", 3), ("tiny_llama", 40), ("tiny_gemma3", 3)])
def test_stress(arch, host_blocks, request, tmp_path):
    loaded = request.getfixturevalue(arch)
    rng = random.Random(1)
    base = [rng.randrange(5, 4000) for _ in range(120)]
    prompts = []
    for _ in range(14):
        cut = rng.choice([16, 32, 48, 64, 80, 96, 101])
        prompts.append(base[:cut] + [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 12))])
    prompts += prompts[:6]  # repeats: their prefixes come back from host / disk
    ref = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, enable_prefix_caching=False)
    probe = LLM(loaded=loaded, kv_cache_memory_gib=0.00025, block_size=4)
    bpb = probe.engine.kv_bytes_per_token * 4
    llm = LLM(
        loaded=loaded,
        kv_cache_memory_gib=34 * bpb / 2**30 + 1e-12,
        block_size=4,
        host_cache_memory_gib=host_blocks * bpb / 2**30 + 1e-12,
        disk_cache_dir=str(tmp_path),
        max_num_batched_tokens=32,
    )
    assert llm.engine.host.pool.num_blocks == host_blocks
    print('device blocks', llm.engine.pool.num_blocks)
    want = run_all(ref, prompts, {}, False)
    got = run_all(llm, prompts, {3: "r2", 7: "r9"}, True)
    wrong = [rid for rid in got if got[rid] != want[rid]]
    s = llm.engine.host.stats
    print(
        arch,
        host_blocks,
        "offloaded",
        s.offloaded_blocks,
        "onboarded",
        s.onboarded_blocks,
        "loaded",
        s.loaded_blocks,
        "preemptions",
        llm.engine.stats().num_preemptions,
        "wrong",
        wrong,
    )
    assert not wrong
