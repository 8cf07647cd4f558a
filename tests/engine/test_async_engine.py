"""AsyncEngine: errors reach only the affected callers; early exits abort; the loop survives.
Over a disk tier, ``stats()`` reads the stores live and ``shutdown()`` finishes their writes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvreuse.cache.hashing import BlockHash
from kvreuse.engine.async_engine import AsyncEngine
from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
from kvreuse.sampling_params import SamplingParams
from tests.server.helpers import BLOCK_SIZE, MAX_MODEL_LEN


@pytest.fixture
def own_engine(tiny_llama):
    """A private engine (these tests break steps on purpose)."""
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    engine = AsyncEngine(
        LLMEngine(
            EngineConfig(kv_cache_memory_gib=0.005, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN), tiny_llama
        )
    )
    engine.start()
    yield engine
    engine.shutdown()


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


async def _collect(engine, request_id, prompt=tuple(range(100, 140)), params=GREEDY):
    return [out async for out in engine.generate(list(prompt), params, request_id=request_id)]


def test_generate_streams_until_finished(own_engine):
    outs = asyncio.run(_collect(own_engine, "a"))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert len(outs[-1].output_token_ids) == 4 and not any(o.finished for o in outs[:-1])


def test_add_request_value_error_reaches_the_caller(own_engine):
    with pytest.raises(ValueError, match="max_tokens|max_model_len|context"):
        asyncio.run(_collect(own_engine, "long", prompt=range(100, 100 + MAX_MODEL_LEN)))
    assert len(asyncio.run(_collect(own_engine, "next"))[-1].output_token_ids) == 4


def test_duplicate_request_id_is_refused(own_engine):
    async def both():
        slow = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        first = own_engine.generate(list(range(100, 140)), slow, request_id="dup")
        await anext(first)
        with pytest.raises(ValueError, match="already in flight"):
            await _collect(own_engine, "dup")
        await first.aclose()

    asyncio.run(both())


def test_cancelled_duplicate_does_not_abort_the_request_in_flight(own_engine):
    """The caller of a refused duplicate id goes away before its error arrives: its abort
    names the id, but must not reach the request the first caller is running."""

    async def run():
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        first = own_engine.generate(list(range(100, 140)), params, request_id="twin")
        outs = [await anext(first)]
        duplicate = asyncio.ensure_future(_collect(own_engine, "twin"))
        await asyncio.sleep(0)  # its add is sent
        duplicate.cancel()
        with pytest.raises(asyncio.CancelledError):
            await duplicate
        outs += [o async for o in first]
        return outs

    outs = asyncio.run(asyncio.wait_for(run(), 30))  # before the fix: hung, then timed out
    assert outs[-1].finished and len(outs[-1].output_token_ids) == 30


def test_consumer_that_stops_early_aborts_and_frees_blocks(own_engine):
    async def stop_after_one():
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        gen = own_engine.generate(list(range(100, 180)), params, request_id="quit")
        await anext(gen)
        await gen.aclose()  # what a disconnect does to the route's generator

    asyncio.run(stop_after_one())
    for _ in range(200):
        stats = asyncio.run(own_engine.call(lambda e: e.stats()))
        if stats.num_used_blocks == 0 and stats.num_running == 0:
            break
    assert stats.num_used_blocks == 0 and stats.num_running == 0
    asyncio.run(own_engine.check_integrity())


def test_a_broken_step_fails_in_flight_requests_and_the_loop_keeps_serving(own_engine, monkeypatch):
    real_step = own_engine.engine.step
    broken = {"left": 1}

    def step_that_breaks_once():
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("simulated device failure")
        return real_step()

    from kvreuse.engine.async_engine import EngineError

    monkeypatch.setattr(own_engine.engine, "step", step_that_breaks_once)
    with pytest.raises(EngineError, match="simulated device failure"):
        asyncio.run(_collect(own_engine, "victim"))
    assert own_engine.is_running
    assert asyncio.run(_collect(own_engine, "survivor"))[-1].finished
    stats = asyncio.run(own_engine.call(lambda e: e.stats()))
    assert stats.num_used_blocks == 0
    asyncio.run(own_engine.check_integrity())


def test_shutdown_fails_waiting_callers(tiny_llama):
    from kvreuse.engine.async_engine import AsyncEngine, EngineDeadError
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory_gib=0.005, max_model_len=MAX_MODEL_LEN), tiny_llama))
    engine.start()
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, "late"))


def test_idle_engine_applies_expired_durations_without_new_requests(own_engine):
    """A released block's duration runs out while nothing runs: it falls back to priority
    35 then (stats, metrics and events follow), not at the next allocation."""
    from kvreuse.cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    own_engine.engine.pool.clock = clock
    keep = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 32, 90, duration_ms=1000)])

    async def run():
        outs = [o async for o in own_engine.generate(list(range(200, 240)), GREEDY, request_id="kept", retention=keep)]
        assert outs[-1].finished
        held = await own_engine.call(lambda e: e.pool.blocks_by_priority())
        clock.now += 60.0
        for _ in range(100):  # any wake-up runs an idle pass, which expires (no request needed)
            after = await own_engine.call(lambda e: e.pool.blocks_by_priority())
            if 90 not in after:
                break
            await asyncio.sleep(0.05)
        return held, after

    held, after = asyncio.run(run())
    assert held.get(90) == 32 // BLOCK_SIZE
    assert 90 not in after and sum(after.values()) == sum(held.values())
    assert own_engine.stats().blocks_by_priority == after


def test_retention_duration_beyond_the_limit_is_refused_naming_the_field():
    from kvreuse.cache.retention import MAX_DURATION_MS, KvCacheRetentionConfig

    with pytest.raises(ValueError, match=r"kv_cache_retention_config.decode_duration_ms: must be a positive integer"):
        KvCacheRetentionConfig.from_dict({"decode_duration_ms": 10**309})
    assert (
        KvCacheRetentionConfig.from_dict({"decode_duration_ms": MAX_DURATION_MS}).decode_duration_ms == MAX_DURATION_MS
    )


# AsyncEngine over a disk tier: ``stats()`` (what /metrics reads) shows the stores'
# counters as they are now, not as they were after the last step (the writer thread and the
# breaker move on while the engine sleeps); ``shutdown()`` finishes the queued writes, so a
# restarted executor finds what this one computed.
PROMPT = [(i * 37) % 4000 + 10 for i in range(61)]  # 15 full blocks of 4 + 1 token


def engine_with_disk(loaded, tmp_path) -> AsyncEngine:
    config = EngineConfig(
        kv_cache_memory_gib=0.001,
        block_size=4,
        max_model_len=256,
        host_cache_memory_gib=0.001,
        disk_cache_dir=str(tmp_path),
    )
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


def test_a_request_the_step_fails_alone_gets_engine_error_and_the_others_finish(tiny_llama):
    """``--debug-step-fault``: the marked request's caller gets ``EngineError`` mid-stream;
    the callers beside it get the tokens an undisturbed run gives them."""
    from kvreuse.engine.async_engine import EngineError

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = {f"ok-{i}": list(range(200 + 40 * i, 230 + 40 * i)) for i in range(3)}

    async def run(engine, with_bad):
        tasks = {rid: asyncio.ensure_future(_collect(engine, rid, prompt, params)) for rid, prompt in prompts.items()}
        if with_bad:
            tasks["bad-1"] = asyncio.ensure_future(_collect(engine, "bad-1", range(400, 440), params))
        await asyncio.wait(tasks.values())
        return {rid: task.exception() or [o.output_token_ids for o in task.result()][-1] for rid, task in tasks.items()}

    engines = [
        AsyncEngine(
            LLMEngine(
                EngineConfig(
                    kv_cache_memory_gib=0.005,
                    block_size=BLOCK_SIZE,
                    max_model_len=MAX_MODEL_LEN,
                    debug_step_faults=faults,
                ),
                tiny_llama,
            )
        )
        for faults in ((), ("forward:bad-@3",))
    ]
    try:
        for engine in engines:
            engine.start()
        undisturbed, disturbed = asyncio.run(run(engines[0], False)), asyncio.run(run(engines[1], True))
        failure = disturbed.pop("bad-1")
        assert isinstance(failure, EngineError) and failure.code == "request_failed"
        assert str(failure) == "internal engine error: InjectedFault: injected forward fault (request bad-1)"
        assert disturbed == undisturbed and all(len(tokens) == 16 for tokens in disturbed.values())
        stats = asyncio.run(engines[1].call(lambda e: e.stats()))
        assert (stats.num_used_blocks, stats.num_running) == (0, 0)
        asyncio.run(engines[1].check_integrity())
    finally:
        for engine in engines:
            engine.shutdown()
