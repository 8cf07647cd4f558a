"""A tenant's tokens per minute hold on /v1/messages through the router: reserved before
proxying (a refusal is Anthropic's 429 and reaches no executor) and charged the usage the
executor answers with, streamed or not. The router and executor apps of
``test_tenant_limits_router`` (the real engine, one test clock)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .test_tenant_limits_router import ADMIN, Clock, Cluster


@pytest.fixture(scope="module")
def engine(tiny_llama):
    """An engine of this module's own (the executor ``Cluster`` builds its app over it)."""
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    engine = AsyncEngine(
        LLMEngine(EngineConfig(kv_cache_memory_gib=0.004, block_size=16, max_model_len=512), tiny_llama)
    )
    engine.start()
    yield engine
    engine.shutdown()


def _body(**extra):
    return {
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "alpha bravo charlie delta echo foxtrot golf"}],
        **extra,
    }


def _total(usage: dict) -> int:
    return (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
        + usage["output_tokens"]
    )


def test_messages_tokens_per_minute_through_the_router(engine):
    clock = Clock()
    cluster = Cluster(engine, clock)
    limiter = cluster.router_limiter

    async def scenario():
        await cluster.start()
        transport = httpx.ASGITransport(app=cluster.router_app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://r", headers={"x-api-key": "acme-key"}
        ) as acme:
            n = (await acme.post("/v1/messages/count_tokens", json=_body())).json()["input_tokens"]
            first = await acme.post("/v1/messages", json=_body())
            assert first.status_code == 200, first.text
            used = _total(first.json()["usage"])
            assert limiter.tokens_charged("acme") == used  # corrected from the reservation (n + 8)
            before = len(cluster.reached)
            refused = await acme.post("/v1/messages", json=_body(max_tokens=120 - n + 1))
            assert len(cluster.reached) == before  # nothing sent
            clock.t += 60.0
            async with acme.stream("POST", "/v1/messages", json=_body(stream=True)) as streamed:
                text = (await streamed.aread()).decode()
            delta = next(
                json.loads(f.split("\ndata: ", 1)[1])
                for f in text.split("\n\n")
                if f.startswith("event: message_delta")
            )
            return n, used, refused, _total(delta["usage"])

    n, used, refused, streamed = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["x-should-retry"] == "false"
    assert refused.json() == {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": (
                f"Request too large for tenant acme on tokens per minute: limit 120, requested 121 (prompt {n} + up to "
                f"{121 - n} completion tokens); lower max_tokens (or n, or the prompt), or raise its tokens_per_minute"
            ),
        },
    }
    assert limiter.tokens_charged("acme") == used + streamed
    assert cluster.reached[-1] == ("/v1/messages", f"Bearer {ADMIN}")
