"""AsyncEngine over a disk tier: ``stats()`` (what /metrics reads) shows the stores'
counters as they are now, not as they were after the last step (the writer thread and the
breaker move on while the engine sleeps); ``shutdown()`` finishes the queued writes, so a
restarted executor finds what this one computed."""

import asyncio
import time

from kvreuse.cache.hashing import BlockHash
from kvreuse.engine.async_engine import AsyncEngine
from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
from kvreuse.engine.sampling_params import SamplingParams

PROMPT = [(i * 37) % 4000 + 10 for i in range(61)]  # 15 full blocks of 4 + 1 token


def engine_with_disk(loaded, tmp_path) -> AsyncEngine:
    config = EngineConfig(kv_cache_memory_gib=0.001, block_size=4, max_model_len=256, host_cache_memory_gib=0.001,
                          disk_cache_dir=str(tmp_path))
    return AsyncEngine(LLMEngine(config, loaded))


async def run(engine: AsyncEngine, prompt=PROMPT):
    outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0), request_id="r")]
    return outs[-1]


def wait_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 30
    while engine.stats().num_running or engine.stats().num_used_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_stats_read_the_stores_live_while_the_engine_sleeps(tiny_llama, tmp_path):
    engine = engine_with_disk(tiny_llama, tmp_path)
    engine.start()
    try:
        assert asyncio.run(run(engine)).num_cached_tokens == 0
        wait_idle(engine)
        stores = engine.engine.host.below
        assert stores.flush(30)
        assert engine.stats().tiers["DISK"]["puts"] == 15  # written after the step's snapshot, shown
        misses = engine.stats().tiers["DISK"]["misses"]
        assert stores.disk.get(BlockHash(b"\x01" * 32)) is None  # the store moves, the engine sleeps
        assert engine.stats().tiers["DISK"]["misses"] == misses + 1
        assert engine.stats().tiers["CPU"]["num_blocks"] == engine.engine.host.pool.num_blocks  # the snapshot's part
    finally:
        engine.shutdown()
    engine.engine.check_integrity()


def test_shutdown_finishes_the_queued_writes(tiny_llama, tmp_path):
    engine = engine_with_disk(tiny_llama, tmp_path)
    disk = engine.engine.host.below.disk
    put = disk.put

    def slow_put(key, payload, **kw):  # a slow disk: the writes are still queued when the request ends
        time.sleep(0.02)
        return put(key, payload, **kw)

    disk.put = slow_put
    engine.start()
    asyncio.run(run(engine))
    engine.shutdown()
    assert disk.stats()["puts"] == 15
    assert len(list(tmp_path.rglob("*.kvb"))) == 15
