"""A server of its own over the tiny random Llama, for tests that assert exact counters
(the session app's counters depend on which tests ran before)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .helpers import BLOCK_SIZE, MAX_MODEL_LEN


@contextmanager
def fresh_client(loaded, *, api_key: str | None = None, limits=None, **config) -> Iterator:
    """A ``TestClient`` over a new, started engine (``EngineConfig`` fields in ``config``);
    yields ``(client, async_engine)`` and shuts the engine down afterwards."""
    from fastapi.testclient import TestClient

    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.server.api_server import build_app

    settings = {"kv_cache_memory_gib": 0.002, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, **config}
    engine = AsyncEngine(LLMEngine(EngineConfig(**settings), loaded))
    try:
        engine.start()
        extra = {} if limits is None else {"limits": limits}
        with TestClient(build_app(engine, served_model_name="tiny", api_key=api_key, **extra)) as client:
            yield client, engine
    finally:
        engine.shutdown()


@contextmanager
def fresh_server(loaded, **config) -> Iterator:
    """A live uvicorn server (real sockets, in a thread) over a new, started engine;
    yields ``(base_url, async_engine)``, stops both afterwards."""
    import threading
    import time

    import uvicorn

    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.server.api_server import build_app
    from tests.serve_process import free_port

    settings = {"kv_cache_memory_gib": 0.002, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, **config}
    engine = AsyncEngine(LLMEngine(EngineConfig(**settings), loaded))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, served_model_name="tiny"),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        engine.start()
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
