"""ZMQ feed into the index, compatibility refusal, load gauges from /metrics."""

from __future__ import annotations

import asyncio

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import take_snapshot
from kvreuse.router.executors import ExecutorInfo, IncompatibleExecutors, check_compatible, parse_load_metrics
from kvreuse.router.feeds import ZmqFeed
from kvreuse.router.index import KVIndex, index_key

from .test_index import BS, _fill


def _info(url: str, model_id: str = "m@1", block_size: int = 16, algo: str = "sha256") -> ExecutorInfo:
    return ExecutorInfo.from_json(
        url, {"model": "m", "model_id": model_id, "block_size": block_size, "hash_algorithm": algo}
    )


def test_incompatible_executors_are_refused_with_every_value():
    assert check_compatible([_info("http://a"), _info("http://b")]).model_id == "m@1"
    with pytest.raises(IncompatibleExecutors, match=r"(?s)http://a.*m@1.*http://b.*m@2"):
        check_compatible([_info("http://a"), _info("http://b", model_id="m@2")])
    with pytest.raises(IncompatibleExecutors, match="block_size 32"):
        check_compatible([_info("http://a"), _info("http://b", block_size=32)])
    with pytest.raises(ValueError, match="model_id"):
        ExecutorInfo.from_json("http://c", {"model": "m"})
    shared = {"model": "m", "model_id": "m@1", "block_size": 16, "hash_algorithm": "sha256"}
    both = ExecutorInfo.from_json("http://d", shared | {"remote_store": "r" * 16, "object_store": "o" * 16})
    assert (both.remote_store, both.object_store) == ("r" * 16, "o" * 16)
    assert _info("http://e").object_store is None  # an executor without the object tier, or an older one


def test_load_gauges_are_read_from_metrics():
    text = (
        '# HELP x\nkvreuse:num_blocks_used{model_name="m"} 12.0\n'
        'kvreuse:num_requests_waiting{model_name="m"} 3.0\nkvreuse:num_blocks_free 5.0\n'
    )
    assert parse_load_metrics(text) == {"num_blocks_used": 12.0, "num_requests_waiting": 3.0}


def test_zmq_feed_mirrors_the_pool_and_resyncs_from_the_snapshot():
    from kvreuse.events.publisher import ZmqEventPublisher

    buffer = EventBuffer(1000)
    pool = BlockPool(64, BS, events=buffer)
    early = list(range(8))
    _fill(pool, early)  # before the subscriber: only the snapshot can tell
    publisher = ZmqEventPublisher(buffer, "tcp://127.0.0.1:*").start()
    index = KVIndex()
    index.add_executor("a")

    async def snapshot():
        return take_snapshot(pool, buffer.last_event_id)

    async def scenario():
        feed = ZmqFeed(index, "a", publisher.endpoint, snapshot, retry_s=0.05)
        task = asyncio.create_task(feed.run())
        late = list(range(100, 112))
        keys_early = [index_key(k) for k in hash_token_blocks(early, BS, model_id="m")]
        keys_late = [index_key(k) for k in hash_token_blocks(late, BS, model_id="m")]
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if index.overlaps(keys_early, ["a"])["a"] == 2:
                    break
            assert index.overlaps(keys_early, ["a"]) == {"a": 2}
            await asyncio.sleep(0.2)  # subscription settled
            _fill(pool, late)
            for _ in range(100):
                await asyncio.sleep(0.05)
                if index.overlaps(keys_late, ["a"])["a"] == 3:
                    break
            assert index.overlaps(keys_late, ["a"]) == {"a": 3}
            pool.evict_all_cached()
            for _ in range(100):
                await asyncio.sleep(0.05)
                if index.num_keys == 0:
                    break
            assert index.num_keys == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()
