"""An executor whose Redis Cluster seed was down when it started reports a stand-in remote
store identity; once the cluster answers, its store derives the cluster's identity as at
start-up, ``/v1/kvreuse/info`` and ``/health`` report it, and the router's next probe counts
the other executors' REMOTE blocks as reachable from it (issue 35: it used to keep the
stand-in for its whole life).

Real pieces in one process: a real 3-master cluster (Debian's redis-server on loopback
ports), two executor apps over real engines (tiny random Llama) with the cluster as their
remote tier, A seeded with a node that is down when A starts, B with another; the router
reaches them through ASGI."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvreuse.events.records import REMOTE_LEVEL
from kvreuse.router.executors import Executor, ExecutorInfo
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import PromptHasher
from kvreuse.router.router import REMOTE_STORE_HEADER, Router
from kvreuse.router.tokenizer import load_tokenizer
from tests.tiers.redis_cluster import running_cluster

A, B = "http://a", "http://b"
PROMPT = [(i * 61) % 1700 + 120 for i in range(40)]


@pytest.fixture
def redis_cluster(tmp_path):
    yield from running_cluster(tmp_path / "cluster")


def _engine(loaded, url: str):
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    config = EngineConfig(
        kv_cache_memory_gib=0.004, block_size=16, max_model_len=512, host_cache_memory_gib=0.004, remote_cache=url
    )
    engine = AsyncEngine(LLMEngine(config, loaded))
    engine.start()
    return engine


def test_a_seed_down_at_start_is_announced_with_the_clusters_identity_once_up(tiny_llama, redis_cluster):
    from kvreuse.server.api_server import build_app

    seed = redis_cluster.ports[0]
    engines = {B: _engine(tiny_llama, redis_cluster.url(redis_cluster.ports[1]))}
    redis_cluster.kill(seed)
    engines[A] = _engine(tiny_llama, redis_cluster.url(seed))  # its seed is down: a stand-in identity
    apps = {url: build_app(engine, served_model_name="tiny") for url, engine in engines.items()}

    async def executors(scope, receive, send):  # A and B by host, as two machines would be
        host = dict(scope["headers"])[b"host"].decode()
        await apps[f"http://{host}"](scope, receive, send)

    async def scenario():
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=executors))
        infos = {url: ExecutorInfo.from_json(url, (await client.get(f"{url}/v1/kvreuse/info")).json()) for url in apps}
        router = Router(
            [Executor(url, info, healthy=True) for url, info in infos.items()],
            PromptHasher(load_tokenizer(infos[B]), infos[B].settings),
            make_policy("kv"),
            client=client,
            seed=0,
        )
        stores = lambda: {url: router.index.mirror(url).stores.get(REMOTE_LEVEL) for url in apps}  # noqa: E731
        for e in router.executors.values():
            router.index.set_store(e.name, e.info.remote_store)  # as Router.start does
        await asyncio.gather(*(router.probe(e) for e in router.executors.values()))
        before = stores()
        redis_cluster.restart(seed)  # the cluster answers A now
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        served = await client.post(f"{A}/v1/completions", json=body)  # its lookup reaches the cluster
        assert served.status_code == 200, served.text
        health = await client.get(f"{A}/health")
        await router.probe(router.executors[A])
        info = (await client.get(f"{A}/v1/kvreuse/info")).json()
        await client.aclose()
        return infos, before, health.headers.get(REMOTE_STORE_HEADER), info["remote_store"], stores()

    try:
        infos, before, announced, reported, after = asyncio.run(scenario())
    finally:
        for engine in engines.values():
            engine.shutdown()
    shared = infos[B].remote_store
    assert shared is not None and infos[A].remote_store not in (None, shared)  # the stand-in at start
    assert before == {A: infos[A].remote_store, B: shared}  # the router cannot count B's blocks for A
    assert announced == reported == shared  # the cluster's identity, as B reports it
    assert after == {A: shared, B: shared}  # one store: B's REMOTE blocks are reachable from A
