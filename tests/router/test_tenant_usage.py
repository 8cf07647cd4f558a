"""A request the executor would refuse for its context is not the tenant limiter's to refuse:
through the router it gets the executor's 400 naming the field, word for word, on the
OpenAI routes and on /v1/messages (issue 33: it used to get the router's 429
``request_too_large``, since ``max_tokens`` alone was over the tenant's tokens per minute).
A request that fits the model's context but not the tenant's budget keeps the 429.

The router and executor apps of ``test_tenant_limits_router`` (the real engine, context 512
tokens, acme at 120 tokens per minute, one test clock)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .test_tenant_limits_router import EXACT, PROMPT, Clock, Cluster


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    engine = AsyncEngine(
        LLMEngine(EngineConfig(kv_cache_memory_gib=0.004, block_size=16, max_model_len=512), tiny_llama)
    )
    engine.start()
    yield engine
    engine.shutdown()


CHAT = [{"role": "user", "content": "alpha bravo charlie delta echo foxtrot golf"}]
REQUESTS = [  # (path, body, the field the executor's 400 names)
    ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, **EXACT}, "max_tokens"),  # 40 + 500
    ("/v1/completions", {"model": "tiny", "prompt": PROMPT * 13, "max_tokens": 1}, "prompt"),  # 520 tokens
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 600}, "max_tokens"),
    ("/v1/messages", {"model": "tiny", "messages": CHAT, "max_tokens": 600}, None),  # Anthropic's shape: no param
]


def _answers(cluster: Cluster, requests) -> dict[bool, list[tuple[int, dict]]]:
    """Each request straight to the executor, then through the router, as acme."""

    async def scenario():
        await cluster.start()
        answers: dict[bool, list[tuple[int, dict]]] = {}
        for direct in (True, False):
            app = cluster.executor_seen if direct else cluster.router_app
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                answers[direct] = []
                for path, body, _ in requests:
                    key = {"x-api-key": "acme-key"} if path == "/v1/messages" else {"authorization": "Bearer acme-key"}
                    resp = await http.post(path, json=body, headers=key)
                    answers[direct].append((resp.status_code, resp.json()))
        return answers

    return asyncio.run(scenario())


def test_a_request_over_the_context_gets_the_executors_400_not_the_limiters_429(engine):
    cluster = Cluster(engine, Clock())
    answers = _answers(cluster, REQUESTS)
    assert answers[False] == answers[True]  # the router's answers are the executor's, word for word
    for (status, body), (path, _, param) in zip(answers[False], REQUESTS, strict=True):
        assert status == 400, (path, body)
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith("max_tokens: prompt (")
        else:
            assert (body["error"]["param"], body["error"]["code"]) == (param, "context_length_exceeded")
    # every one reached the executor through the router too, and none cost acme a token
    assert [path for path, _ in cluster.reached] == [path for path, _, _ in REQUESTS] * 2
    assert cluster.router_limiter.tokens_charged("acme") == cluster.executor_limiter.tokens_charged("acme") == 0


def test_a_request_that_fits_the_context_but_not_the_budget_keeps_the_429(engine):
    cluster = Cluster(engine, Clock())
    over_budget = [  # 40 + 200 and 8 + 200 tokens: within the context of 512, over acme's 120 a minute
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, **EXACT}, "max_tokens"),
        ("/v1/messages", {"model": "tiny", "messages": CHAT, "max_tokens": 200}, None),
    ]
    answers = _answers(cluster, over_budget)
    assert answers[False] == answers[True]
    (completion_status, completion), (messages_status, messages) = answers[False]
    assert completion_status == messages_status == 429
    assert completion["error"]["message"].startswith("Request too large for tenant acme on tokens per minute")
    assert completion["error"]["param"] == "max_tokens"
    assert messages["type"] == "error" and messages["error"]["type"] == "rate_limit_error"
    assert messages["error"]["message"].startswith("Request too large for tenant acme on tokens per minute")
    assert [path for path, _ in cluster.reached] == [path for path, _, _ in over_budget]  # the router sent none
