"""Schema-driven fuzzing of ``kvreuse route``'s own ``/openapi.json`` (issue 31): the
completions, chat, Messages, count_tokens and explain bodies, positive and negative cases
(``tests.schema_fuzz``), through a router app built as ``kvreuse route`` builds it, in front
of a real executor (the tiny random Llama behind uvicorn, in this process: no start-up of two
processes). No answer is a 5xx, every 4xx is in the endpoint's own error shape (the router's
own 400s and the executor's, passed on), and afterwards a normal request still succeeds and
the executor's pool goes back to idle with its integrity intact."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.schema_fuzz import ANTHROPIC_PATHS, EXPLAIN_PATH, MAX_EXAMPLES, MODES, OPENAI_PATHS, fuzz
from tests.serve_process import free_port
from tests.server.fresh_app import fresh_server
from tests.server.helpers import wait_idle


@pytest.fixture(scope="module")
def routed(tiny_llama):
    """``(router URL, the executor's engine)``: ``kvreuse route --executor URL`` over one executor."""
    import uvicorn

    from kvreuse.router.app import build_router_app
    from kvreuse.router.cli import discover
    from kvreuse.router.executors import Executor
    from kvreuse.router.policy import make_policy
    from kvreuse.router.prompt_keys import PromptHasher
    from kvreuse.router.router import Router
    from kvreuse.router.tokenizer import load_tokenizer

    with fresh_server(tiny_llama, kv_cache_memory_gib=0.01, max_num_seqs=16) as (url, engine):
        info = asyncio.run(discover([url], 30.0))[url]
        router = Router(
            [Executor(url, info)],
            PromptHasher(load_tokenizer(info), info.settings),
            make_policy("kv"),
            client=httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)),
            health_interval_s=0.3,
            seed=0,
        )
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(build_router_app(router), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started:
                assert time.monotonic() < deadline, "the router did not start"
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}", engine
        finally:
            server.should_exit = True
            thread.join(10)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", (*OPENAI_PATHS, *ANTHROPIC_PATHS, EXPLAIN_PATH))
def test_fuzzed_bodies_get_no_5xx_and_the_apis_own_error_shape(routed, path, mode):
    cases, problems = fuzz(routed[0], path, mode)
    assert cases == MAX_EXAMPLES
    assert problems == []


def test_after_the_fuzzing_a_normal_request_succeeds_and_the_pool_is_idle(routed):
    url, engine = routed
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "after the fuzz", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["executors"] == [{"healthy": True}]  # the fuzzing never marked it down
    stats = wait_idle(engine)
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
    asyncio.run(engine.check_integrity())
