"""The router app's own routes: the open ``/health`` says whether each executor is healthy
and never where it is; ``/v1/route/executors`` names them, behind the key (an admin key's,
when there are tenants). (Routing: test_proxy.py; the OpenAPI description: test_openapi.py.)"""

from __future__ import annotations

import asyncio

import httpx

from kvreuse.router.app import build_router_app
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router

URLS = ("http://10.1.2.3:8001", "http://10.1.2.4:8002")


def _get(requests, *, healthy=(True, False), api_key=None):
    """``[(path, key or None)]`` -> responses of a router app over two executors."""

    async def scenario():
        executors = [Executor(u, healthy=h) for u, h in zip(URLS, healthy)]
        executors[1].last_error = f"connection failed: {URLS[1]} refused"
        router = Router(
            executors,
            PromptHasher(None, HashSettings("m", 4, "sha256")),
            make_policy("kv"),
            client=httpx.AsyncClient(),
            seed=0,
        )
        app = build_router_app(router, api_key=api_key)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:
            return [await c.get(p, headers={"authorization": f"Bearer {k}"} if k else {}) for p, k in requests]

    return asyncio.run(scenario())


def test_health_lists_each_executors_health_and_no_address():
    (up,) = _get([("/health", None)])
    assert up.status_code == 200
    assert up.json() == {"status": "ok", "policy": "kv", "executors": [{"healthy": True}, {"healthy": False}]}
    assert "10.1.2" not in up.text and "http" not in up.text
    (down,) = _get([("/health", None)], healthy=(False, False))
    assert down.status_code == 503 and down.json()["status"] == "error"


def test_health_stays_open_and_addressless_with_keys():
    (health,) = _get([("/health", None)], api_key=["admin", "tkey:alpha"])
    assert health.status_code == 200 and "10.1.2" not in health.text


def test_the_executors_route_names_them_for_an_admin_key_only():
    admin, tenant, none = _get(
        [("/v1/route/executors", "admin"), ("/v1/route/executors", "tkey"), ("/v1/route/executors", None)],
        api_key=["admin", "tkey:alpha"],
    )
    assert [e["url"] for e in admin.json()["executors"]] == list(URLS)
    assert [e["healthy"] for e in admin.json()["executors"]] == [True, False]
    assert admin.json()["executors"][1]["last_error"] == f"connection failed: {URLS[1]} refused"
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    assert "10.1.2" not in tenant.text
    assert none.status_code == 401


def test_without_keys_the_executors_route_is_open_as_every_route_is():
    (r,) = _get([("/v1/route/executors", None)])
    assert r.status_code == 200 and [e["url"] for e in r.json()["executors"]] == list(URLS)


def _explain(key, *, api_key=("admin", "tkey:alpha")):
    """``POST /v1/route/explain`` of a token-id prompt with ``key``, on the two executors of ``_get``."""

    async def scenario():
        router = Router(
            [Executor(u, healthy=h) for u, h in zip(URLS, (True, False))],
            PromptHasher(None, HashSettings("m", 4, "sha256")),
            make_policy("kv"),
            client=httpx.AsyncClient(),
            seed=0,
        )
        app = build_router_app(router, api_key=list(api_key) if api_key else None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return await c.post("/v1/route/explain", json={"prompt": [1, 2, 3, 4, 5]}, headers=headers)

    return asyncio.run(scenario())


def test_explain_names_executors_by_id_to_a_tenant_and_never_by_address():
    r = _explain("tkey")
    assert r.status_code == 200 and "10.1.2" not in r.text and "http" not in r.text
    d = r.json()
    assert [(e["id"], e["healthy"]) for e in d["executors"]] == [(0, True), (1, False)]
    assert d["choice_id"] == 0
    assert "choice" not in d and all("executor" not in e for e in d["executors"])


def test_explain_adds_the_addresses_for_an_admin_key_and_without_keys():
    for r in (_explain("admin"), _explain(None, api_key=None)):
        d = r.json()
        assert [(e["id"], e["executor"]) for e in d["executors"]] == [(0, URLS[0]), (1, URLS[1])]
        assert (d["choice_id"], d["choice"]) == (0, URLS[0])


def test_the_executors_route_gives_each_executors_id_beside_its_url():
    (r,) = _get([("/v1/route/executors", "admin")], api_key=["admin"])
    assert [(e["id"], e["url"]) for e in r.json()["executors"]] == [(0, URLS[0]), (1, URLS[1])]
