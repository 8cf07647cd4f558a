"""What a router learns about an executor process: its instance id (``/health`` header and
``/v1/kvreuse/info``) and whether its ZMQ PUB socket is bound (``events.zmq_bound``)."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from kvreuse.events.buffer import EventBuffer
from kvreuse.events.publisher import ZmqEventPublisher
from kvreuse.server.api_server import build_app
from kvreuse.server.info_routes import INSTANCE_HEADER

from .conftest import free_port


def test_every_app_has_its_own_instance_id_on_health_and_info(async_engine):
    ids = []
    for _ in range(2):  # two apps: two executor processes, as far as a router can tell
        with TestClient(build_app(async_engine, served_model_name="tiny")) as c:
            health = c.get("/health")
            info = c.get("/v1/kvreuse/info").json()
            assert health.status_code == 200
            assert health.json() == {"status": "ok"}
            assert re.fullmatch(r"[0-9a-f]{32}", health.headers[INSTANCE_HEADER])
            assert info["instance_id"] == health.headers[INSTANCE_HEADER]
            assert c.get("/health").headers[INSTANCE_HEADER] == info["instance_id"]  # stable for the app
            ids.append(info["instance_id"])
    assert ids[0] != ids[1]


def test_info_says_whether_the_zmq_socket_is_bound(async_engine):
    buffer = EventBuffer(16)
    bound = ZmqEventPublisher(buffer, "tcp://127.0.0.1:*")
    connecting = ZmqEventPublisher(buffer, f"tcp://127.0.0.1:{free_port()}")  # connects: nobody can subscribe

    def bound_endpoints() -> set[str]:  # where a subscriber can connect now, as each publisher says
        return {p.endpoint for p in (bound, connecting) if p.subscribable}

    try:
        assert (bound.bound, connecting.bound) == (True, False)
        assert bound_endpoints() >= {bound.endpoint}
        assert connecting.endpoint not in bound_endpoints()
        with TestClient(build_app(async_engine, served_model_name="tiny")) as c:
            assert c.get("/v1/kvreuse/info").json()["events"]["zmq_bound"] is False  # no ZMQ at all
        for publisher, expected in ((bound, True), (connecting, False)):
            # as `kvreuse serve` advertises it
            with TestClient(build_app(async_engine, served_model_name="tiny", publisher=publisher)) as c:
                events = c.get("/v1/kvreuse/info").json()["events"]
                assert (events["zmq_endpoint"], events["zmq_bound"]) == (publisher.endpoint, expected)
        with TestClient(build_app(async_engine, served_model_name="tiny", publisher=bound)) as c:
            bound.close()
            assert c.get("/v1/kvreuse/info").json()["events"]["zmq_bound"] is False  # closed: nothing to join
    finally:
        bound.close()
        connecting.close()
    assert bound.endpoint not in bound_endpoints()


def test_info_says_the_kv_format_and_its_model_id(tiny_llama):
    """``--kv-cache-dtype int8``: the info names the format and a model_id of its own (what a
    router hashes with), so a router never counts an int8 executor's blocks as another's."""
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    infos = {}
    for kv_cache_dtype in ("auto", "int8"):
        engine = AsyncEngine(
            LLMEngine(EngineConfig(kv_cache_memory_gib=0.002, kv_cache_dtype=kv_cache_dtype), tiny_llama)
        )
        engine.start()
        try:
            with TestClient(build_app(engine, served_model_name="tiny")) as c:
                infos[kv_cache_dtype] = c.get("/v1/kvreuse/info").json()
        finally:
            engine.shutdown()
    assert infos["auto"]["kv_cache_dtype"] == "float32" and infos["int8"]["kv_cache_dtype"] == "int8"
    assert infos["auto"]["model_id"] == tiny_llama.model_id != infos["int8"]["model_id"]
    assert infos["int8"]["num_blocks"] > infos["auto"]["num_blocks"]
