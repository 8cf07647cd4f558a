"""``StreamRequest.of`` reads a streamed body as the executor does; a body the executor
refuses is passed to it untouched (its 400 reaches the client), never a 500 of the router."""

from __future__ import annotations

import asyncio

import httpx

from kvreuse.router.app import build_router_app
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router
from kvreuse.router.stream_request import StreamRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
REFUSAL = {
    "error": {
        "message": "top_logprobs: requires logprobs: true",
        "type": "invalid_request_error",
        "param": "top_logprobs",
        "code": None,
    }
}


def test_a_body_the_executor_refuses_does_not_parse_here():
    assert StreamRequest.of(True, {**CHAT, "top_logprobs": 2}).parsed is None
    assert StreamRequest.of(True, {**CHAT, "top_logprobs": 2, "logprobs": True}).unsupported() == (
        "it asks for logprobs (not continued)"
    )
    assert StreamRequest.of(True, CHAT).unsupported() is None


def test_top_logprobs_without_logprobs_gets_the_executors_400_through_the_router():
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(400, json=REFUSAL)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as upstream:
            router = Router(
                [Executor("http://a", healthy=True)],
                PromptHasher(None, HashSettings("m", 4, "sha256")),
                make_policy("kv"),
                client=upstream,
                seed=0,
            )
            app = build_router_app(router)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
                return await http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2})

    r = asyncio.run(scenario())
    assert (r.status_code, r.json()) == (400, REFUSAL)
    assert len(seen) == 1 and b"return_token_ids" not in seen[0]  # passed through untouched, not retried
