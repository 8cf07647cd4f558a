"""Per-tenant limits on the executor's app over the real engine (tiny random Llama), driven
by the official ``openai`` client through ASGI; the limiter runs on a test clock, so every
``Retry-After`` and token count is exact.

A held stream (``tests.asgi_stream.HeldStream``: the client takes the first chunk and holds
on) is a request in flight for as long as the test needs: it keeps its tenant's slot until
it ends or its client disconnects, and never delays another tenant."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kvreuse.api.limiter import TenantLimiter
from kvreuse.api.tenant_limits import Limits, TenantLimits
from tests.asgi_stream import HeldStream

from .helpers import BLOCK_SIZE, MAX_MODEL_LEN, wait_idle

KEYS = ["admin-key", "acme-key:acme", "globex-key:globex"]
PROMPT = [(i * 53) % 1800 + 150 for i in range(40)]
EXACT = {"temperature": 0.0, "ignore_eos": True}  # max_tokens tokens, always


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    config = EngineConfig(kv_cache_memory_gib=0.004, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(config, tiny_llama))
    engine.start()
    yield engine
    engine.shutdown()


def _app(engine, limits: TenantLimits, clock: Clock):
    from kvreuse.server.api_server import build_app

    limiter = TenantLimiter(limits, clock)
    return build_app(engine, api_key=KEYS, served_model_name="tiny", limiter=limiter), limiter


def _client(app, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _metrics(app, prefix: str = "kvreuse:tenant_") -> list[str]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        text = (await http.get("/metrics", headers=_auth("admin-key"))).text  # tenant names need it
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_a_stream_holds_its_tenants_slot_until_it_ends_or_its_client_leaves(engine):
    clock = Clock()
    app, limiter = _app(engine, TenantLimits(default=Limits(max_in_flight=1)), clock)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True, **EXACT}

    async def scenario():
        acme, globex = _client(app, "acme-key"), _client(app, "globex-key")
        held = HeldStream(app, "/v1/completions", body, _auth("acme-key"))
        await held.start()
        assert (held.status, limiter.in_flight("acme")) == (200, 1)
        with pytest.raises(openai.RateLimitError) as refused:
            await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=EXACT)
        assert refused.value.status_code == 429
        assert refused.value.body == {
            "message": "Too many requests in flight for tenant acme: 1 running, its max_in_flight limit is 1; retry "
            "when one finishes",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        assert (refused.value.response.headers["retry-after"], refused.value.response.headers["retry-after-ms"]) == (
            "1",
            "1000",
        )
        with pytest.raises(openai.RateLimitError):  # chat shares the slot
            await acme.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        # acme at its limit costs globex nothing: its request runs while acme's stream is held
        served = await globex.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=EXACT)
        assert served.usage.completion_tokens == 8 and not held.task.done()
        admin = await _client(app, "admin-key").completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert admin.usage.completion_tokens == 2  # admin keys: unlimited unless [admin] says so

        await held.disconnect()  # the client leaves mid-stream: the slot is free at once
        assert limiter.in_flight("acme") == 0
        again = await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=EXACT)
        assert again.usage.completion_tokens == 8

        held = HeldStream(
            app,
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": True,
                **EXACT,
            },
            _auth("acme-key"),
        )
        await held.start()
        with pytest.raises(openai.RateLimitError):
            await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
        assert limiter.in_flight("acme") == 1
        sent = await held.release()  # read to the end: the slot is freed when the last byte is sent
        assert sent.endswith(b"data: [DONE]\n\n") and limiter.in_flight("acme") == 0
        return await _metrics(app)

    metrics = asyncio.run(scenario())
    assert metrics == [
        'kvreuse:tenant_requests_refused_total{reason="max_in_flight",tenant="acme"} 3.0',
        'kvreuse:tenant_requests_in_flight{tenant="acme"} 0.0',
        'kvreuse:tenant_requests_in_flight{tenant="globex"} 0.0',
        'kvreuse:tenant_requests_in_flight{tenant="(admin)"} 0.0',
    ]
    wait_idle(engine)  # the disconnected stream was aborted: no block is held
    asyncio.run(engine.check_integrity())


def test_tokens_per_minute_reserve_prompt_plus_max_tokens_and_charge_the_usage(engine):
    from kvreuse.sampling_params import SamplingParams

    clock = Clock()
    app, limiter = _app(engine, TenantLimits(tenants={"acme": Limits(tokens_per_minute=120)}), clock)  # 2 tokens/s

    async def greedy_ids() -> list[int]:
        outs = [
            o async for o in engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0), request_id="probe")
        ]
        return outs[-1].output_token_ids

    async def scenario():
        acme = _client(app, "acme-key")
        first = await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=EXACT)
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (40, 8)
        assert limiter.tokens_available("acme") == 72.0  # 48 reserved, 48 used
        with pytest.raises(openai.RateLimitError) as refused:
            await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, extra_body=EXACT)
        assert refused.value.body == {
            "message": "Rate limit reached for tenant acme on tokens per minute: limit 120, available 72, requested 80 "
            "(prompt 40 + up to 40 completion tokens); retry in 4.0s",
            "type": "tokens",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        headers = refused.value.response.headers
        assert (headers["retry-after"], headers["retry-after-ms"]) == ("4", "4000")
        clock.t += 4.0  # the wait it was told
        assert (
            await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, extra_body=EXACT)
        ).usage.total_tokens == 80
        assert limiter.tokens_available("acme") == 0.0

        clock.t += 60.0  # full again: 120
        with pytest.raises(openai.RateLimitError) as too_large:
            await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=81)
        assert too_large.value.body["param"] == "max_tokens"
        assert too_large.value.body["message"].startswith(
            "Request too large for tenant acme on tokens per minute: "
            "limit 120, requested 121 (prompt 40 + up to 81 completion"
        )
        assert too_large.value.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in too_large.value.response.headers

        # n choices: the prompt once, every choice's max_tokens; streamed, charged as it streams
        chat = await acme.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=4, n=2, extra_body=EXACT
        )
        charged_chat = chat.usage.prompt_tokens + 8
        assert chat.usage.total_tokens == charged_chat
        assert limiter.tokens_available("acme") == 120.0 - charged_chat
        clock.t += 60.0
        stream = await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True, extra_body=EXACT)
        assert len([c async for c in stream]) == 8
        assert limiter.tokens_available("acme") == 72.0

        # a request that stops early gets back what it did not use
        clock.t += 60.0
        ids = await greedy_ids()
        stopped = await acme.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [ids[2]]}
        )
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 8
        assert limiter.tokens_available("acme") == 120.0 - stopped.usage.total_tokens
        admin = await _client(app, "admin-key").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=200, extra_body=EXACT
        )
        assert admin.usage.total_tokens == 240  # admin keys are not limited
        charged = 48 + 80 + charged_chat + 48 + stopped.usage.total_tokens
        return charged, await _metrics(app)

    charged, metrics = asyncio.run(scenario())
    assert limiter.tokens_charged("acme") == charged
    assert metrics == [
        'kvreuse:tenant_requests_refused_total{reason="request_too_large",tenant="acme"} 1.0',
        'kvreuse:tenant_requests_refused_total{reason="tokens_per_minute",tenant="acme"} 1.0',
        'kvreuse:tenant_requests_in_flight{tenant="acme"} 0.0',
        'kvreuse:tenant_requests_in_flight{tenant="(admin)"} 0.0',
        f'kvreuse:tenant_tokens_charged_total{{tenant="acme"}} {float(charged)}',
    ]
    wait_idle(engine)


def test_a_bad_request_costs_nothing_and_limits_need_a_tenant_with_a_key(engine):
    clock = Clock()
    app, limiter = _app(engine, TenantLimits(default=Limits(max_in_flight=1, tokens_per_minute=100)), clock)

    async def scenario():
        acme = _client(app, "acme-key")
        with pytest.raises(openai.BadRequestError):  # refused before anything is reserved
            await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
        with pytest.raises(openai.NotFoundError):
            await acme.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)

    asyncio.run(scenario())
    assert (limiter.tokens_available("acme"), limiter.in_flight("acme"), limiter.tokens_charged("acme")) == (
        100.0,
        0,
        0,
    )
    from kvreuse.server.api_server import build_app

    with pytest.raises(ValueError, match="tenants.acmee: no --api-key KEY:acmee names this tenant"):
        build_app(engine, api_key=KEYS, limiter=TenantLimiter(TenantLimits(tenants={"acmee": Limits(1)})))
