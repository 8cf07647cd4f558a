"""The router enforces the executor's limits before doing any work: body size (413), the
API key (401, before the body is read or anything tokenized; explain and /openapi.json
included), and bodies that are not UTF-8, not JSON or nested too deeply (the executor's
400, not a 500). The router app is driven through ASGI; executors are an in-process
transport that records what reaches them."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvreuse.router.app import build_router_app
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router

KEY, EXECUTOR_KEY = "router-key", "executor-key"
LIMIT = 64 * 1024
BODY = json.dumps({"prompt": list(range(100, 110)), "max_tokens": 1}).encode()


class _CountingHasher(PromptHasher):
    def __init__(self) -> None:
        super().__init__(None, HashSettings("m", 4, "sha256"))
        self.calls = 0

    def request_keys(self, chat, body):
        self.calls += 1
        return super().request_keys(chat, body)


def _call(requests, *, api_key=KEY, executor_key=EXECUTOR_KEY):
    """Send ``requests`` ((method, path, content, headers)) to a router app; returns the
    responses, what the executor saw (authorization headers) and the hasher's call count."""
    seen: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as upstream:
            hasher = _CountingHasher()
            router = Router(
                [Executor("http://a", healthy=True)],
                hasher,
                make_policy("kv"),
                client=upstream,
                seed=0,
                executor_api_key=executor_key,
            )
            app = build_router_app(router, api_key=api_key, max_body_bytes=LIMIT)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                out = [await c.request(m, p, content=b, headers=h) for m, p, b, h in requests]
            return out, hasher.calls

    responses, calls = asyncio.run(scenario())
    return responses, seen, calls


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


def test_an_oversized_body_gets_the_executors_413_before_the_key_or_any_work():
    big = b'{"prompt": "' + b"x" * (LIMIT + 1) + b'"}'
    (declared, keyed), seen, calls = _call(
        [("POST", "/v1/completions", big, {}), ("POST", "/v1/chat/completions", big, _bearer(KEY))]
    )
    for r in (declared, keyed):
        assert r.status_code == 413
        assert r.json() == {
            "error": {
                "message": f"request body exceeds the {LIMIT}-byte limit",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    assert (seen, calls) == ([], 0)


def test_without_the_key_nothing_is_tokenized_or_sent_and_explain_and_openapi_are_closed():
    requests = [
        ("POST", path, BODY, hdrs)
        for path in ("/v1/completions", "/v1/route/explain")
        for hdrs in ({}, _bearer("wrong"))
    ]
    requests += [("GET", "/openapi.json", b"", {}), ("GET", "/v1/models", b"", {})]
    responses, seen, calls = _call(requests)
    for r in responses:
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert (seen, calls) == ([], 0)
    (health, metrics), _, _ = _call([("GET", "/health", b"", {}), ("GET", "/metrics", b"", {})])
    assert (health.status_code, metrics.status_code) == (200, 200)


def test_with_the_key_explain_answers_and_the_executor_gets_the_routers_executor_key():
    (explained, served, spec), seen, calls = _call(
        [
            ("POST", "/v1/route/explain", BODY, _bearer(KEY)),
            ("POST", "/v1/completions", BODY, _bearer(KEY)),
            ("GET", "/openapi.json", b"", _bearer(KEY)),
        ]
    )
    assert explained.status_code == 200 and explained.json()["prompt_blocks"] == 2
    assert served.status_code == 200 and served.json() == {"choices": [{"text": "ok"}]}
    assert spec.status_code == 200 and spec.json()["info"]["title"] == "kvreuse router"
    assert seen == [f"Bearer {EXECUTOR_KEY}"]  # the client's router key never reaches an executor
    assert calls == 2


def test_without_a_router_key_the_clients_own_header_goes_through():
    (served,), seen, _ = _call([("POST", "/v1/completions", BODY, _bearer("clients"))], api_key=None)
    assert served.status_code == 200 and seen == ["Bearer clients"]


def test_bodies_that_do_not_parse_get_a_400_naming_the_body_and_reach_no_executor():
    deep = b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # 60 KB, under the limit
    cases = {
        deep: "request body: JSON is nested too deeply (arrays or objects about 1000 levels deep)",
        b'{"prompt": "\xff"}': "request body is not valid UTF-8 (byte 12 of 15: 0xff)",
        b'{"prompt": ': "request body is not valid JSON: Expecting value: line 1 column 12 (char 11)",
    }
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/route/explain"):
        responses, seen, calls = _call([("POST", path, body, _bearer(KEY)) for body in cases])
        for r, message in zip(responses, cases.values()):
            assert r.status_code == 400, r.text
            assert r.json() == {
                "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
            }
        assert (seen, calls) == ([], 0)


def test_a_tenant_keys_requests_are_hashed_explained_and_forwarded_with_the_tenants_salt():
    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    prompt = {"prompt": list(range(100, 110)), "max_tokens": 1}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as upstream:
            hasher = PromptHasher(None, HashSettings("m", 4, "sha256"))
            router = Router(
                [Executor("http://a", healthy=True)],
                hasher,
                make_policy("kv"),
                client=upstream,
                seed=0,
                executor_api_key=EXECUTOR_KEY,
            )
            # acme's blocks of this prompt are in the index; nobody else's are
            router.index.store("http://a", hasher.keys(prompt["prompt"], "tenant:acme"))
            app = build_router_app(router, api_key=[KEY, "acme-key:acme"], max_body_bytes=LIMIT)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                served = await c.post(
                    "/v1/completions", json={**prompt, "cache_salt": "x"}, headers=_bearer("acme-key")
                )
                plain = await c.post("/v1/completions", json=prompt, headers=_bearer("acme-key"))
                admin = await c.post("/v1/completions", json=prompt, headers=_bearer(KEY))
                # not a salt: forwarded as sent, for the executor's 400 naming cache_salt
                await c.post("/v1/completions", json={**prompt, "cache_salt": ""}, headers=_bearer("acme-key"))
                explained = await c.post("/v1/route/explain", json=prompt, headers=_bearer("acme-key"))
                as_admin = await c.post("/v1/route/explain", json=prompt, headers=_bearer(KEY))
            return served, plain, admin, explained, as_admin

    served, plain, admin, explained, as_admin = asyncio.run(scenario())
    assert [r.status_code for r in (served, plain, admin, explained, as_admin)] == [200] * 5
    assert [b.get("cache_salt") for b in bodies] == ["tenant:acme|x", "tenant:acme", None, ""]
    # explain sees acme's blocks only under acme's key: another key learns nothing of them
    assert [e["overlap_blocks"] for e in explained.json()["executors"]] == [2]
    assert [e["overlap_blocks"] for e in as_admin.json()["executors"]] == [0]


def test_a_routed_response_names_its_executor_to_an_admin_key_only():
    """``x-kvreuse-executor`` (the executor's URL) reaches an admin key and a router without
    keys, never a tenant key: tenants learn executor addresses nowhere (``/health``,
    ``/v1/route/executors``), so not from their own responses either."""
    paths = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
    requests = [("POST", path, BODY, _bearer(key)) for key in ("acme-key", KEY) for path in paths]
    responses, seen, _ = _call(requests, api_key=[KEY, "acme-key:acme"])
    assert [r.status_code for r in responses] == [200] * 6 and len(seen) == 6
    assert [r.headers.get("x-kvreuse-executor") for r in responses] == [None] * 3 + ["http://a"] * 3
    (open_router,), _, _ = _call([("POST", "/v1/completions", BODY, {})], api_key=None)
    assert open_router.headers["x-kvreuse-executor"] == "http://a"
