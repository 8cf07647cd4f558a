"""The object tier through the real engine (tiny random-weight Llama, fp32, blocks of 16) on a
real S3 server (SeaweedFS's gateway, started here): an executor restarted with an empty disk
tier finds a 2,048-token prompt in the bucket; an object corrupted on purpose is refused and
its block recomputed; the server killed in the middle of a run of requests fails none; the
OBJECT level in the KV events and the tier stats. Greedy outputs equal a run without caching."""

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import OBJECT_LEVEL, BlocksStored
from tests.tiers.seaweed_server import running_seaweed

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0)
PROMPT = [(i * 37) % 4000 + 10 for i in range(2048)]  # 128 full blocks


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


_buckets = iter(range(1000))


def executor(loaded, s3, disk, prefix, **kw):
    """KV for ~2.5k tokens on the device, as much on the host, a disk tier in ``disk``, the bucket."""
    return LLM(
        loaded=loaded,
        kv_cache_memory_gib=0.0013,
        block_size=BLOCK,
        host_cache_memory_gib=0.0013,
        disk_cache_dir=str(disk),
        object_cache=f"s3://{s3.bucket}/{prefix}",
        **kw,
    )


def settled(llm):
    """Every queued write done and applied; the engine's bookkeeping checked."""
    assert llm.engine.stores.flush(60)
    llm.engine.cache.sync_stores()
    llm.engine.check_integrity()
    return llm


@pytest.fixture(scope="module")
def expected(tiny_llama):
    fresh = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.0013, block_size=BLOCK, enable_prefix_caching=False)
    return fresh.generate(PROMPT, GREEDY)[0].token_ids


def test_a_restarted_executor_with_an_empty_disk_reads_the_prompt_from_the_bucket(tiny_llama, s3, tmp_path, expected):
    prefix = f"restart{next(_buckets)}"
    first = executor(tiny_llama, s3, tmp_path / "disk-1", prefix)
    out = first.generate(PROMPT, GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == expected
    settled(first)
    assert first.engine.stores.objects.stats()["puts"] == 128  # every full block, written through
    restarted = executor(tiny_llama, s3, tmp_path / "disk-2", prefix)  # empty device, host and disk
    again = restarted.generate(PROMPT, GREEDY)[0]
    settled(restarted)
    assert again.num_cached_tokens == 2048 - BLOCK  # the last block is always computed
    assert again.cached_tokens_by_tier == {OBJECT_LEVEL: 2048 - BLOCK}
    assert again.token_ids == expected
    assert restarted.engine.stores.stats.object_hits == 127 and restarted.engine.host.stats.loaded_blocks == 127
    tiers = restarted.engine.stats().tiers
    assert tiers[OBJECT_LEVEL]["hits"] == 127 and tiers[OBJECT_LEVEL]["corrupt"] == 0


def test_a_corrupted_object_is_refused_and_its_block_recomputed(tiny_llama, s3, tmp_path, expected):
    prefix = f"corrupt{next(_buckets)}"
    first = settled(executor(tiny_llama, s3, tmp_path / "disk-1", prefix))
    first.generate(PROMPT, GREEDY)
    settled(first)
    restarted = executor(tiny_llama, s3, tmp_path / "disk-2", prefix)
    store = restarted.engine.stores.objects
    keys = hash_token_blocks(PROMPT, BLOCK, model_id=restarted.engine.model_id)
    client, victim = s3.client(), store.object_key(keys[5])
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=victim)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # the 6th block of the chain: one byte flipped in its KV
    client.put_object(Bucket=s3.bucket, Key=victim, Body=bytes(data))
    out = restarted.generate(PROMPT, GREEDY)[0]
    settled(restarted)
    assert out.num_cached_tokens == 5 * BLOCK  # blocks 0-4; the 6th refused, the rest recomputed
    assert out.cached_tokens_by_tier == {OBJECT_LEVEL: 5 * BLOCK}
    assert out.token_ids == expected
    assert store.stats()["corrupt"] == 1
    # the refused object was deleted, and the recomputed block written through again, verified
    found = store.fetch_many([keys[5]], shape=restarted.engine.stores.block_shape)
    assert found is not None and found[0] is not None and found[0].key == keys[5]


def test_the_server_killed_mid_run_fails_no_request(tiny_llama, s3, tmp_path, expected):
    prefix = f"killed{next(_buckets)}"
    llm = executor(tiny_llama, s3, tmp_path / "disk", prefix)
    prompts = [[t + p for t in PROMPT[:500]] for p in range(8)]
    fresh = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.0013, block_size=BLOCK, enable_prefix_caching=False)
    outs = [llm.generate(p, GREEDY)[0] for p in prompts[:4]]
    s3.stop()  # SIGKILL while writes of those prompts may still be queued
    outs += [llm.generate(p, GREEDY)[0] for p in prompts[4:]]
    settled(llm)
    assert [o.finish_reason for o in outs] == ["length"] * 8
    assert [o.token_ids for o in outs] == [fresh.generate(p, GREEDY)[0].token_ids for p in prompts]
    stats = llm.engine.stores.objects.stats()
    assert stats["put_failures"] + stats["errors"] + stats["timeouts"] + stats["skipped"] > 0
    s3.start()  # the same data: later tests (and executors) find the bucket again


def test_object_blocks_in_the_events_and_the_snapshot(tiny_llama, s3, tmp_path):
    buffer = EventBuffer(100_000)
    prefix = f"events{next(_buckets)}"
    llm = executor(tiny_llama, s3, tmp_path / "disk", prefix, events=buffer)
    prompt = PROMPT[:400]  # 25 full blocks
    llm.generate(prompt, GREEDY)
    settled(llm)
    stored = [
        b.block_hash
        for e in buffer.get_events(None, max_events=100_000)
        if isinstance(e.data, BlocksStored)
        for b in e.data.blocks
        if b.cache_level == OBJECT_LEVEL
    ]
    keys = hash_token_blocks(prompt, BLOCK, model_id=llm.engine.model_id)
    assert sorted(stored) == sorted(keys)
    assert len(llm.engine.host.ledgers[OBJECT_LEVEL]) == 25
    assert llm.engine.stats().tiers[OBJECT_LEVEL]["blocks_held"] == 25
