"""Disk and Redis tiers through the real engine (tiny random-weight Llama, fp32): a restarted
executor hits its own disk, a corrupted block file is refused and recomputed, two executors
share a real redis-server, a killed Redis costs a recompute and no request, salts share
nothing. Logits of onboarded prefixes equal no caching within 1e-4."""

import pytest

from kvreuse import LLM, SamplingParams
from tests.engine_helpers import LogitsSpy, reference_logits
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
