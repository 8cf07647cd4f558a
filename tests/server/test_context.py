"""The server's seams: ``build_app`` only builds (the owner starts the engine), the app's
state is one frozen ``ServerContext``, ``/v1/kvreuse/info`` reads the publisher it was given,
and what the router shares with the server lives in ``kvreuse.api``, never in ``server/``."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvreuse.events.buffer import EventBuffer
from kvreuse.events.publisher import ZmqEventPublisher
from kvreuse.server.api_server import build_app, build_context
from kvreuse.server.context import ServerContext

from .helpers import BLOCK_SIZE, MAX_MODEL_LEN

SRC = Path(__file__).resolve().parents[2] / "src" / "kvreuse"


@pytest.fixture(scope="module")
def own_engine(tiny_llama):
    """An engine of this module, KV events on; nobody starts it but the first test."""
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    config = EngineConfig(kv_cache_memory_gib=0.002, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(config, tiny_llama, events=EventBuffer(100)))
    yield engine
    engine.shutdown()


def test_build_app_starts_nothing_and_the_owner_starts_the_engine(own_engine):
    app = build_app(own_engine, served_model_name="tiny")
    assert own_engine.is_running is False
    with TestClient(app) as c:
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "error", "detail": "engine thread is not running"})
        own_engine.start()
        assert own_engine.is_running is True
        r = c.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_the_context_holds_exactly_what_the_routes_read(own_engine):
    ctx = build_context(own_engine, served_model_name=["tiny", "alias"])
    assert [f.name for f in dataclasses.fields(ServerContext)] == [
        "engine",
        "metrics",
        "served_model_names",
        "limits",
        "instance_id",
        "events",
        "publisher",
        "cache_policy",
    ]
    assert ctx.served_model_names == ("tiny", "alias")
    assert ctx.events is not None and ctx.events.buffer is own_engine.engine.events
    assert ctx.publisher is None
    assert len(ctx.instance_id) == 32 and ctx.instance_id != build_context(own_engine).instance_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.instance_id = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="--served-model-name must be one or more non-empty names"):
        build_context(own_engine, served_model_name=[])


def test_events_are_off_without_a_buffer(async_engine):
    app = build_app(async_engine, served_model_name="tiny")  # the session engine has no EventBuffer
    assert app.state.ctx.events is None
    with TestClient(app) as c:
        r = c.get("/v1/kv_cache_events")
        assert r.status_code == 404
        assert r.json()["error"]["message"] == (
            "KV cache events are off: start the server with --event-buffer-max-size N (N > 0)"
        )
        assert c.get("/v1/kvreuse/info").json()["events"] == {
            "http": False,
            "zmq_endpoint": None,
            "zmq_bound": False,
            "zmq_replay_endpoint": None,
            "zmq_topic": "",
            "zmq_hash_format": "int",
            "zmq_last_event_id": None,
        }


def test_info_reports_the_publisher_it_was_built_with(own_engine):
    publisher = ZmqEventPublisher(
        own_engine.engine.events,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
        hash_format="bytes",
    )
    try:
        with TestClient(build_app(own_engine, served_model_name="tiny", publisher=publisher)) as c:
            assert c.get("/v1/kvreuse/info").json()["events"] == {
                "http": True,
                "zmq_endpoint": publisher.endpoint,
                "zmq_bound": True,
                "zmq_replay_endpoint": publisher.replay_endpoint,
                "zmq_topic": "kv",
                "zmq_hash_format": "bytes",
                "zmq_last_event_id": -1,  # not started: nothing sent
            }
            publisher.close()
            assert c.get("/v1/kvreuse/info").json()["events"]["zmq_bound"] is False
    finally:
        publisher.close()
    assert publisher.subscribable is False


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    "package, forbidden", [("router", ("kvreuse.server",)), ("api", ("kvreuse.server", "kvreuse.router"))]
)
def test_router_and_api_import_nothing_from_the_server(package, forbidden):
    offenders = {
        f"{path.name}: {module}"
        for path in sorted((SRC / package).rglob("*.py"))
        for module in _imported_modules(path)
        if module.startswith(forbidden)
    }
    assert offenders == set()
