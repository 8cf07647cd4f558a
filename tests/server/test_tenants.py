"""Tenant keys (``--api-key KEY:TENANT``): each tenant's blocks are salted with the tenant,
so no tenant hits another's cache whatever ``cache_salt`` it sends, and the routes that show
or change every tenant's cache need an admin key (a key without ``:TENANT``)."""

from __future__ import annotations

import pytest

from kvreuse.api.tenants import APIKeys

from .fresh_app import fresh_client

PROMPT = [(i * 37) % 1900 + 100 for i in range(40)]  # 2 full blocks of 16 + 8 tokens
KEYS = ["admin-key", "acme-key:acme", "globex-key:globex"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cached(client, key: str, **extra) -> int:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **extra}, headers=_auth(key))
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_never_share_blocks_and_introspection_needs_an_admin_key(tiny_llama):
    with fresh_client(tiny_llama, api_key=KEYS, event_buffer_max_size=1000) as (client, _):
        assert _cached(client, "acme-key") == 0
        assert _cached(client, "acme-key") == 32  # its own blocks: a hit
        assert _cached(client, "globex-key") == 0  # the same prompt under another tenant: a miss
        assert _cached(client, "globex-key", cache_salt="x") == 0  # a salt within the tenant separates too
        assert _cached(client, "globex-key", cache_salt="tenant:acme") == 0  # naming acme's salt gets nothing
        assert _cached(client, "admin-key") == 0  # the admin key's unsalted blocks are apart too
        assert _cached(client, "admin-key", cache_salt="tenant:acme") == 32  # admins are trusted: they may

        admin_only = [
            ("GET", "/v1/kv_cache_state"),
            ("GET", "/v1/kv_cache_events"),
            ("POST", "/reset_prefix_cache"),
            ("POST", "/v1/schemas"),
            ("DELETE", "/v1/schemas/s"),
        ]
        for method, path in admin_only:
            r = client.request(method, path, headers=_auth("acme-key"))
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"] == {
                "message": f"{method} {path} needs an admin key (one given without ':tenant'): it shows or changes "
                "every tenant's cache",
                "type": "invalid_request_error",
                "param": None,
                "code": "admin_key_required",
            }
        assert client.get("/v1/kv_cache_state", headers=_auth("admin-key")).status_code == 200
        assert client.get("/v1/schemas", headers=_auth("acme-key")).status_code == 200
        assert client.get("/v1/kv_cache_stats", headers=_auth("acme-key")).status_code == 200  # counts, no ids
        assert client.get("/v1/kv_cache_state", headers=_auth("nope")).status_code == 401


def test_key_specs_are_checked():
    assert APIKeys.parse(["a", "b:t-1", "c:d:e"]).tenants == {"a": None, "b": "t-1", "c:d": "e"}
    for specs, message in [
        (["k:bad name"], "the tenant after the last ':' must be 1-64 letters"),
        ([":t"], "the key must not be empty"),
        (["k", "k:t"], "the same key is given twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            APIKeys.parse(specs)


def test_only_admin_keys_learn_the_zmq_event_socket(tiny_llama):
    """/v1/kvreuse/info names the executor's ZMQ PUB socket, which has no authentication and
    carries every block's token ids: a tenant key gets a 403 there (as on the state and event
    routes), an admin key (a router's) gets the endpoint."""
    from fastapi.testclient import TestClient

    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.events.publisher import ZmqEventPublisher
    from kvreuse.server.api_server import build_app

    engine = AsyncEngine(
        LLMEngine(
            EngineConfig(kv_cache_memory_gib=0.002, block_size=16, max_model_len=512, event_buffer_max_size=1000),
            tiny_llama,
        )
    )
    publisher = ZmqEventPublisher(engine.engine.events, "tcp://127.0.0.1:*")
    try:
        engine.start()
        publisher.start()
        with TestClient(build_app(engine, served_model_name="tiny", api_key=KEYS, publisher=publisher)) as c:
            for path in ("/v1/kv_cache_events", "/v1/kvreuse/info"):
                r = c.get(path, headers=_auth("globex-key"))
                assert r.status_code == 403 and "zmq" not in r.text, r.text
            info = c.get("/v1/kvreuse/info", headers=_auth("admin-key"))
            assert info.status_code == 200 and info.json()["events"]["zmq_endpoint"] == publisher.endpoint
    finally:
        publisher.close()
        engine.shutdown()
