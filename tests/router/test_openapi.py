"""The router's ``/openapi.json`` describes its request bodies with the executor's models,
as strictly as the executor's own description (same generator, same schemas), and its
routes still forward what the client sent."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from kvreuse.router.app import build_router_app
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router

ROUTED = ("/v1/completions", "/v1/chat/completions")


def _router_spec() -> dict:
    router = Router(
        [Executor("http://a", healthy=True)],
        PromptHasher(None, HashSettings("m", 4, "sha256")),
        make_policy("kv"),
        client=httpx.AsyncClient(),
        seed=0,
    )

    async def get():
        app = build_router_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:
            return (await c.get("/openapi.json")).json()

    return asyncio.run(get())


def _executor_spec() -> dict:
    from kvreuse.server.chat_routes import router as chat_routes
    from kvreuse.server.completions_routes import router as completions_routes

    app = FastAPI()
    app.include_router(completions_routes)
    app.include_router(chat_routes)
    return app.openapi()


def test_the_routed_bodies_are_the_executors_models_schema_for_schema():
    router, executor = _router_spec(), _executor_spec()
    for path in ROUTED:
        assert router["paths"][path]["post"]["requestBody"] == executor["paths"][path]["post"]["requestBody"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions"):
        assert router["components"]["schemas"][name] == executor["components"]["schemas"][name], name
    assert router["components"]["schemas"]["CompletionRequest"]["required"] == ["prompt"]
    assert router["components"]["schemas"]["ChatCompletionRequest"]["required"] == ["messages"]


def test_explain_takes_either_body_and_the_other_routes_stay_described():
    spec = _router_spec()
    body = spec["paths"]["/v1/route/explain"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert sorted(s["$ref"] for s in body["anyOf"]) == [
        "#/components/schemas/ChatCompletionRequest",
        "#/components/schemas/CompletionRequest",
    ]
    assert {p: sorted(ops) for p, ops in spec["paths"].items()} == {
        "/v1/completions": ["post"],
        "/v1/chat/completions": ["post"],
        "/v1/messages": ["post"],
        "/v1/messages/count_tokens": ["post"],
        "/v1/route/explain": ["post"],
        "/v1/models": ["get"],
        "/health": ["get"],
        "/metrics": ["get"],
        "/v1/route/executors": ["get"],
    }
    assert spec["paths"]["/v1/completions"]["post"]["operationId"] == "completions_v1_completions_post"


def test_docs_and_redoc_answer_as_openapi_json_does():
    router = Router(
        [Executor("http://a", healthy=True)],
        PromptHasher(None, HashSettings("m", 4, "sha256")),
        make_policy("kv"),
        client=httpx.AsyncClient(),
        seed=0,
    )

    async def get():
        app = build_router_app(router, api_key="key")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:
            return {
                (p, k): (await c.get(p, headers={"authorization": "Bearer key"} if k else {}))
                for p in ("/openapi.json", "/docs", "/redoc")
                for k in (False, True)
            }

    got = asyncio.run(get())
    for with_key, status in ((False, 401), (True, 200)):
        assert {p: r.status_code for (p, k), r in got.items() if k is with_key} == dict.fromkeys(
            ("/openapi.json", "/docs", "/redoc"), status
        )
    assert '"CompletionRequest"' in got[("/docs", True)].text  # the description is in the page


def test_explain_answers_a_body_its_description_rules_out_with_the_executors_400():
    """Found by the schema fuzzing (tests/router/test_schema_fuzz.py): explain took any JSON
    object, so bodies its own description rules out got a 200 and a routing decision."""
    router = Router(
        [Executor("http://a", healthy=True)],
        PromptHasher(None, HashSettings("m", 4, "sha256")),
        make_policy("kv"),
        client=httpx.AsyncClient(),
        seed=0,
    )
    bodies = [
        {"prompt": 5},
        {"prompt": [1, 2], "max_tokens": "many"},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},  # without logprobs
        {"prompt": [1, 2]},  # valid: explained
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
    ]

    async def post():
        app = build_router_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:
            return [await c.post("/v1/route/explain", json=b) for b in bodies]

    *bad, ok_completion, ok_chat = asyncio.run(post())
    assert [r.status_code for r in bad] == [400] * 5
    assert [r.json()["error"]["param"] for r in bad] == ["prompt", "max_tokens", "messages[0].role", "messages", None]
    assert bad[0].json()["error"] == {
        "message": "prompt: Input should be a valid string (got 5)",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    assert (ok_completion.status_code, ok_chat.status_code) == (200, 200)
    assert ok_chat.json()["endpoint"] == "chat"
