"""Server fixtures: the real engine over the tiny random Llama, an app, a live uvicorn server.

One engine serves the whole session (building one costs seconds on 2 cores); tests use
prompts of their own so cache contents never couple them, and those that need an idle pool
wait for it with ``wait_idle``.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.serve_process import free_port

from .helpers import BLOCK_SIZE, MAX_MODEL_LEN


@pytest.fixture(scope="session")
def async_engine(tiny_llama):
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    config = EngineConfig(kv_cache_memory_gib=0.02, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    engine = AsyncEngine(LLMEngine(config, tiny_llama))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def app(async_engine):
    from kvreuse.server.api_server import build_app
    from kvreuse.server.context import ServerLimits

    return build_app(async_engine, served_model_name="tiny", limits=ServerLimits(max_body_bytes=64 * 1024))


@pytest.fixture(scope="session")
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="session")
def live_url(app):
    """The app behind a real uvicorn server in a thread (real sockets: disconnects are real)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
