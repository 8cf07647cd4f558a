"""A router in front of an executor started with ``--api-key``: ``--executor-api-key`` for the
router's own calls, a clear refusal at start without it, and clients keep their own key.

The executor is the real app (tiny random Llama, KV events on) behind uvicorn in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from kvreuse.router.cli import EXECUTOR_API_KEY_ENV, build_parser, discover, route_main
from kvreuse.router.executors import Executor
from kvreuse.router.index import index_key
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import PromptHasher
from kvreuse.router.proxy import forward
from kvreuse.router.router import INSTANCE_HEADER, Router

from .cluster import free_port

KEY = "secret-key"


@pytest.fixture(scope="module")
def executor_url(tiny_llama):
    import uvicorn

    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.server.api_server import build_app

    config = EngineConfig(kv_cache_memory_gib=0.002, block_size=16, max_model_len=512)
    engine = AsyncEngine(LLMEngine(config, tiny_llama, events=EventBuffer(10_000)))
    engine.start()  # build_app only builds
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, api_key=KEY, served_model_name="tiny"),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


def test_start_without_or_with_a_wrong_key_says_so(executor_url, monkeypatch, capsys):
    monkeypatch.delenv(EXECUTOR_API_KEY_ENV, raising=False)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # route_main sets the root level; put it back after
    argv = ["--executor", executor_url, "--port", str(free_port()), "--startup-timeout", "5", "--log-level", "warning"]
    assert route_main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvreuse route: {executor_url} requires an API key (401): start the router with --executor-api-key KEY "
        "(or KVREUSE_EXECUTOR_API_KEY), the key the executor was started with (--api-key)"
    )
    assert route_main([*argv, "--executor-api-key", "not-the-key"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvreuse route: {executor_url} refused the router's API key (401): the key given with "
        "--executor-api-key (or KVREUSE_EXECUTOR_API_KEY) is wrong"
    )
    monkeypatch.setenv(EXECUTOR_API_KEY_ENV, KEY)
    assert build_parser().parse_args(argv).executor_api_key == KEY
    assert build_parser().parse_args([*argv, "--executor-api-key", "k2"]).executor_api_key == "k2"


def test_the_key_serves_the_routers_calls_and_never_the_clients(executor_url):
    infos = asyncio.run(discover([executor_url], 5.0, KEY))
    info = infos[executor_url]
    assert info.instance_id == httpx.get(f"{executor_url}/health").headers[INSTANCE_HEADER]
    prompt = list(range(5, 5 + 3 * 16 + 5))  # 53 token ids: 3 full blocks of 16
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()

    async def scenario():
        async with httpx.AsyncClient() as client:
            keyless = Executor(executor_url, info)
            no_key = Router([keyless], PromptHasher(None, info.settings), make_policy("kv"), client=client)
            await no_key.probe(keyless)
            assert not keyless.healthy
            assert "requires an API key (401)" in keyless.last_error

            executor = Executor(executor_url, info)
            router = Router(
                [executor],
                PromptHasher(None, info.settings),
                make_policy("kv"),
                client=client,
                health_interval_s=3600.0,
                executor_api_key=KEY,
            )
            await router.probe(executor)
            assert executor.healthy and executor.last_error is None
            router.start()
            try:
                # A client without a key is refused by the executor: the router does not lend its own.
                refused = await forward(
                    router, "/v1/completions", body, {"content-type": "application/json"}, chat=False
                )
                assert refused.status_code == 401
                served = await forward(
                    router,
                    "/v1/completions",
                    body,
                    {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
                    chat=False,
                )
                assert served.status_code == 200
                assert executor.in_flight == 0
                # The KV state and event stream (both under /v1) are read with the router's key.
                keys = router.hasher.request_keys(False, {"prompt": prompt}).keys
                assert keys == [index_key(h) for h in router.hasher.block_hashes(prompt)]
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while router.index.overlaps(keys, [executor_url])[executor_url] < 3 and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                assert router.index.overlaps(keys, [executor_url]) == {executor_url: 3}
            finally:
                await router.stop()

    asyncio.run(scenario())
