"""Executor restarts (a new instance id) and the choice of event transport.

The executor is played in process: its HTTP side by an ``httpx.MockTransport`` (``/health``
with the instance id header, ``/v1/kvreuse/info``, ``/v1/kv_cache_state``, ``/metrics``),
its events by a real ``ZmqEventPublisher`` on an ipc socket that a "restart" replaces with a
new process's (new pool, new publisher on the same endpoint, new instance id).
"""

from __future__ import annotations

import asyncio
import uuid

import httpx

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.publisher import ZmqEventPublisher
from kvreuse.events.records import take_snapshot
from kvreuse.router.executors import Executor, ExecutorInfo
from kvreuse.router.feeds import SSEFeed, ZmqFeed
from kvreuse.router.index import index_key
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import INSTANCE_HEADER, Router

from .test_index import BS, _fill

URL = "http://x"


def _info_json(instance_id: str | None, events: dict) -> dict:
    return {
        "model": "m",
        "model_id": "m",
        "block_size": BS,
        "hash_algorithm": "sha256",
        "events": {"http": True, **events},
        "instance_id": instance_id,
    }


class FakeExecutor:
    """One executor "process" at a time behind ``URL``; ``restart`` starts a new one."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.reachable = True
        self.publisher = None
        self.restart()

    def restart(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.buffer = EventBuffer(1000)
        self.pool = BlockPool(64, BS, events=self.buffer)
        self.publisher = ZmqEventPublisher(self.buffer, self.endpoint).start()
        self.instance_id = uuid.uuid4().hex

    def info(self) -> ExecutorInfo:
        return ExecutorInfo.from_json(URL, self.info_json())

    def info_json(self) -> dict:
        events = {"zmq_endpoint": self.publisher.endpoint, "zmq_bound": self.publisher.bound}
        return _info_json(self.instance_id, events)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.reachable:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"}, headers={INSTANCE_HEADER: self.instance_id})
        if path == "/v1/kvreuse/info":
            return httpx.Response(200, json=self.info_json())
        if path == "/v1/kv_cache_state":
            return httpx.Response(200, json=take_snapshot(self.pool, self.buffer.last_event_id).to_json())
        if path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(404)

    def close(self) -> None:
        self.publisher.close()


def _keys(tokens: list[int]) -> list[int]:
    return [index_key(h) for h in hash_token_blocks(tokens, BS, model_id="m")]


async def _until(condition, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` (events arrive on other threads); the caller asserts exact values after."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition() and loop.time() < deadline:
        await asyncio.sleep(0.02)


def test_a_restarted_executor_is_reindexed_from_its_new_snapshot(tmp_path):
    fake = FakeExecutor(f"ipc://{tmp_path}/events.sock")
    a, b, c = list(range(8)), list(range(100, 112)), list(range(200, 216))  # 2, 3 and 4 blocks
    _fill(fake.pool, a)  # before the router: only the snapshot can tell

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handle)) as client:
            executor = Executor(URL, fake.info())
            router = Router(
                [executor],
                PromptHasher(None, HashSettings("m", BS, "sha256")),
                make_policy("kv"),
                client=client,
                health_interval_s=3600.0,
            )
            index = router.index
            await router.probe(executor)  # as the app's lifespan does before start()
            router.start()
            try:
                first_feed = router.feeds[URL]
                assert isinstance(first_feed, ZmqFeed)
                await _until(lambda: index.overlaps(_keys(a), [URL])[URL] == 2)
                assert index.overlaps(_keys(a), [URL]) == {URL: 2}

                # Restart between two probes (never seen down): the new process has b only.
                # Its publisher's first batch is sequence 0, which the old feed (which has
                # seen no batch since its snapshot) would take as the next one.
                fake.restart()
                _fill(fake.pool, b)
                await router.probe(executor)
                assert executor.healthy and executor.info.instance_id == fake.instance_id
                await _until(lambda: index.overlaps(_keys(b), [URL])[URL] == 3)
                assert index.overlaps(_keys(a), [URL]) == {URL: 0}  # the old process's blocks are gone
                assert index.overlaps(_keys(b), [URL]) == {URL: 3}
                assert index.num_keys == 3
                assert router.feeds[URL] is not first_feed

                # A probe that sees the same instance changes nothing.
                second_feed = router.feeds[URL]
                await router.probe(executor)
                assert router.feeds[URL] is second_feed

                # Down, then back as yet another process holding c only.
                fake.reachable = False
                await router.probe(executor)
                assert not executor.healthy
                fake.restart()
                _fill(fake.pool, c)
                fake.reachable = True
                await router.probe(executor)
                assert executor.healthy and executor.info.instance_id == fake.instance_id
                await _until(lambda: index.overlaps(_keys(c), [URL])[URL] == 4)
                assert index.overlaps(_keys(b), [URL]) == {URL: 0}
                assert index.overlaps(_keys(c), [URL]) == {URL: 4}
                assert index.num_keys == 4
                assert router.feeds[URL] is not second_feed
            finally:
                await router.stop()

    try:
        asyncio.run(scenario())
    finally:
        fake.close()


def _feed_kind(events: dict, url: str = "http://10.0.0.2:8000") -> SSEFeed | ZmqFeed:
    """The feed a started router gives an executor whose info has ``events``."""

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)  # feeds just retry; only their kind matters here

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            executor = Executor(url, ExecutorInfo.from_json(url, _info_json("i", events)), healthy=True)
            router = Router(
                [executor],
                PromptHasher(None, HashSettings("m", BS, "sha256")),
                make_policy("kv"),
                client=client,
                health_interval_s=3600.0,
            )
            router.start()
            await router.stop()
            return router.feeds[url]

    return asyncio.run(scenario())


def test_zmq_is_followed_only_where_the_executor_bound_its_socket():
    bound = _feed_kind({"zmq_endpoint": "tcp://0.0.0.0:5557", "zmq_bound": True, "zmq_topic": "kv"})
    assert isinstance(bound, ZmqFeed)
    assert (bound.endpoint, bound.topic) == ("tcp://10.0.0.2:5557", "kv")
    # A connect-mode publisher (tcp://host:port, it connects out) sends to whoever bound that
    # address: a router connecting there too would hear nothing, so it follows SSE.
    assert isinstance(_feed_kind({"zmq_endpoint": "tcp://127.0.0.1:5557", "zmq_bound": False}), SSEFeed)
    assert isinstance(_feed_kind({"zmq_endpoint": "tcp://127.0.0.1:5557"}), SSEFeed)  # does not say: SSE
    assert isinstance(_feed_kind({"zmq_endpoint": None, "zmq_bound": False}), SSEFeed)
