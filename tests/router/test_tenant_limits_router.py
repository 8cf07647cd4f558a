"""The router enforces the executor's tenant limits before proxying: the same 429 bodies and
``Retry-After`` headers as the executor, nothing sent to an executor for a refused request,
a tenant's in-flight slot held until its stream ends or its client leaves, and its tokens
charged to the usage the executor answers with.

Real pieces end to end, in one process: the router app (with the tokenizer ``kvreuse
route`` loads) in front of the executor app over the real engine (tiny random Llama),
reached through ASGI; the official ``openai`` client on the router. Both limiters run on
one test clock, so every value is exact."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kvreuse.api.limiter import TenantLimiter
from kvreuse.api.tenant_limits import Limits, TenantLimits
from kvreuse.router.app import build_router_app
from kvreuse.router.cli import route_main
from kvreuse.router.executors import Executor, ExecutorInfo
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import PromptHasher
from kvreuse.router.router import Router
from kvreuse.router.tokenizer import load_tokenizer
from tests.asgi_stream import HeldStream

ADMIN = "admin-key"
KEYS = [ADMIN, "acme-key:acme", "globex-key:globex"]
EXECUTOR = "http://executor"
PROMPT = [(i * 61) % 1700 + 120 for i in range(40)]
EXACT = {"temperature": 0.0, "ignore_eos": True}
LIMITS = TenantLimits(tenants={"acme": Limits(max_in_flight=1, tokens_per_minute=120)})  # 2 tokens/s


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


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


class Cluster:
    """An executor app (keys and limits of its own) and a router app in front of it."""

    def __init__(
        self, engine, clock: Clock, router_limits: TenantLimits = LIMITS, *, metrics_tenant_labels: bool = False
    ) -> None:
        from kvreuse.server.api_server import build_app

        self.metrics_tenant_labels = metrics_tenant_labels
        self.executor_limiter = TenantLimiter(LIMITS, clock)
        self.executor_app = build_app(engine, api_key=KEYS, served_model_name="tiny", limiter=self.executor_limiter)
        self.reached: list[tuple[str, str | None]] = []  # (path, authorization) of POSTs the executor got
        self.router_limiter = TenantLimiter(router_limits, clock)

    async def executor_seen(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            self.reached.append((scope["path"], dict(scope["headers"]).get(b"authorization", b"").decode()))
        await self.executor_app(scope, receive, send)

    async def start(self) -> None:
        self.upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.executor_seen))
        got = await self.upstream.get(f"{EXECUTOR}/v1/kvreuse/info", headers={"authorization": f"Bearer {ADMIN}"})
        info = ExecutorInfo.from_json(EXECUTOR, got.json())
        router = Router(
            [Executor(EXECUTOR, info, healthy=True)],
            PromptHasher(load_tokenizer(info), info.settings),
            make_policy("kv"),
            client=self.upstream,
            seed=0,
            executor_api_key=ADMIN,
        )
        self.router_app = build_router_app(
            router, api_key=KEYS, limiter=self.router_limiter, metrics_tenant_labels=self.metrics_tenant_labels
        )

    async def tenant_metrics(self, key: str | None = None) -> list[str]:
        """The router's ``kvreuse:router_tenant_*`` lines on ``/metrics``, scraped with ``key``."""
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.router_app), base_url="http://r") as h:
            text = (await h.get("/metrics", headers=headers)).text
        return [line for line in text.splitlines() if line.startswith("kvreuse:router_tenant_")]

    def client(self, key: str, *, direct: bool = False) -> openai.AsyncOpenAI:
        app = self.executor_seen if direct else self.router_app
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


async def _greedy_ids(engine) -> list[int]:
    from kvreuse.sampling_params import SamplingParams

    outs = [
        out async for out in engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0), request_id="probe")
    ]
    return outs[-1].output_token_ids


async def _refusal(client: openai.AsyncOpenAI, **request) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        await client.completions.create(model="tiny", prompt=PROMPT, extra_body=EXACT, **request)
    return info.value


def _seen(error: openai.RateLimitError) -> tuple[dict, dict[str, str]]:
    headers = error.response.headers
    return error.body, {k: headers[k] for k in ("retry-after", "retry-after-ms", "x-should-retry") if k in headers}


def test_the_router_refuses_tokens_per_minute_before_proxying_with_the_executors_429(engine):
    clock = Clock()
    cluster = Cluster(engine, clock)

    async def scenario():
        await cluster.start()
        refusals = {}
        for direct in (True, False):  # the same story straight to the executor, then through the router
            acme = cluster.client("acme-key", direct=direct)
            served = await acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=EXACT)
            assert served.usage.total_tokens == 48
            before = len(cluster.reached)
            refusals[direct] = [_seen(await _refusal(acme, max_tokens=40)), _seen(await _refusal(acme, max_tokens=81))]
            if not direct:
                assert len(cluster.reached) == before  # the router's refusals reach no executor
        return refusals

    refusals = asyncio.run(scenario())
    assert refusals[False] == refusals[True]  # the router's 429s are the executor's, word for word
    assert refusals[False] == [
        (
            {
                "message": "Rate limit reached for tenant acme on tokens per minute: limit 120, available 72, "
                "requested 80 (prompt 40 + up to 40 completion tokens); retry in 4.0s",
                "type": "tokens",
                "param": None,
                "code": "rate_limit_exceeded",
            },
            {"retry-after": "4", "retry-after-ms": "4000"},
        ),
        (
            {
                "message": "Request too large for tenant acme on tokens per minute: limit 120, requested 121 "
                "(prompt 40 + up to 81 completion tokens); lower max_tokens (or n, or the prompt), "
                "or raise its tokens_per_minute",
                "type": "tokens",
                "param": "max_tokens",
                "code": "rate_limit_exceeded",
            },
            {"x-should-retry": "false"},
        ),
    ]
    # three straight to the executor (two refused there), one routed, with the router's admin key: only the
    # router counted it against acme
    assert cluster.reached == [("/v1/completions", "Bearer acme-key")] * 3 + [("/v1/completions", f"Bearer {ADMIN}")]
    assert cluster.router_limiter.tokens_charged("acme") == cluster.executor_limiter.tokens_charged("acme") == 48


def test_a_routed_stream_holds_the_slot_and_is_charged_its_usage(engine):
    clock = Clock()
    cluster = Cluster(engine, clock)
    limiter = cluster.router_limiter
    stream_body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True, **EXACT}

    async def scenario():
        await cluster.start()
        acme, globex = cluster.client("acme-key"), cluster.client("globex-key")
        held = HeldStream(cluster.router_app, "/v1/completions", stream_body, {"authorization": "Bearer acme-key"})
        await held.start()
        assert (held.status, limiter.in_flight("acme")) == (200, 1)
        before = len(cluster.reached)
        in_flight = await _refusal(acme, max_tokens=2)
        assert _seen(in_flight) == (
            {
                "message": "Too many requests in flight for tenant acme: 1 running, its "
                "max_in_flight limit is 1; retry when one finishes",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            },
            {"retry-after": "1", "retry-after-ms": "1000"},
        )
        assert len(cluster.reached) == before
        assert (
            await globex.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body=EXACT)
        ).usage.completion_tokens == 4
        assert not held.task.done()  # globex ran while acme's stream was held
        await held.disconnect()
        assert limiter.in_flight("acme") == 0
        assert limiter.tokens_charged("acme") == 48  # its usage if the router read it, else its reservation: 48

        clock.t += 60.0
        held = HeldStream(cluster.router_app, "/v1/completions", stream_body, {"authorization": "Bearer acme-key"})
        await held.start()
        await _refusal(acme, max_tokens=2)
        sent = (await held.release()).decode()
        assert limiter.in_flight("acme") == 0
        # the client did not ask for usage: it gets none, though the router read it
        assert '"usage"' not in sent and sent.endswith("data: [DONE]\n\n")
        assert limiter.tokens_charged("acme") == 96 and limiter.tokens_available("acme") == 72.0

        clock.t += 60.0
        chunks = [
            c
            async for c in await acme.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=EXACT,
            )
        ]
        assert chunks[-1].usage.total_tokens == 48  # asked for: passed through

        # a request that stops early is charged its usage, streamed or not, usage asked for or not
        clock.t += 60.0
        stop = {"stop_token_ids": [(await _greedy_ids(engine))[2]]}
        whole = await acme.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body=stop
        )
        assert whole.usage.completion_tokens < 8
        assert limiter.tokens_charged("acme") == 144 + whole.usage.total_tokens
        streamed = [
            c
            async for c in await acme.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True, extra_body=stop
            )
        ]
        assert all(c.usage is None for c in streamed) and streamed[-1].choices[0].finish_reason == "stop"
        assert limiter.tokens_charged("acme") == 144 + 2 * whole.usage.total_tokens
        assert limiter.tokens_available("acme") == 120.0 - 2 * whole.usage.total_tokens
        scraped = {key: await cluster.tenant_metrics(key) for key in (ADMIN, None, "globex-key")}
        return whole.usage.total_tokens, scraped

    stopped, scraped = asyncio.run(scenario())
    assert scraped[ADMIN] == [
        'kvreuse:router_tenant_requests_refused_total{reason="max_in_flight",tenant="acme"} 2.0',
        'kvreuse:router_tenant_requests_in_flight{tenant="acme"} 0.0',
        'kvreuse:router_tenant_requests_in_flight{tenant="globex"} 0.0',
        f'kvreuse:router_tenant_tokens_charged_total{{tenant="acme"}} {144.0 + 2 * stopped}',
    ]
    # the tenant seal: a scraper without the admin key sees sums over tenants, no names
    assert (
        scraped[None]
        == scraped["globex-key"]
        == [
            'kvreuse:router_tenant_requests_refused_total{reason="max_in_flight",tenant="(all)"} 2.0',
            'kvreuse:router_tenant_requests_in_flight{tenant="(all)"} 0.0',
            f'kvreuse:router_tenant_tokens_charged_total{{tenant="(all)"}} {144.0 + 2 * stopped}',
        ]
    )


def test_metrics_tenant_labels_shows_tenant_names_to_every_scraper(engine):
    cluster = Cluster(engine, Clock(), metrics_tenant_labels=True)

    async def scenario():
        await cluster.start()
        await cluster.client("acme-key").completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=EXACT)
        return await cluster.tenant_metrics(None)

    assert asyncio.run(scenario()) == [
        'kvreuse:router_tenant_requests_in_flight{tenant="acme"} 0.0',
        'kvreuse:router_tenant_tokens_charged_total{tenant="acme"} 42.0',
    ]
    from kvreuse.router.cli import build_parser

    base = ["--executor", "http://e"]
    assert build_parser().parse_args([*base, "--metrics-tenant-labels"]).metrics_tenant_labels is True
    assert build_parser().parse_args(base).metrics_tenant_labels is False


def test_chat_through_the_router_reserves_what_the_context_leaves_without_max_tokens(engine):
    clock = Clock()
    cluster = Cluster(engine, clock, TenantLimits(tenants={"acme": Limits(tokens_per_minute=500)}))
    limiter = cluster.router_limiter
    messages = [{"role": "user", "content": "hello there"}]

    async def scenario():
        await cluster.start()
        acme = cluster.client("acme-key")
        chat = await acme.chat.completions.create(model="tiny", messages=messages, max_tokens=3, n=2, extra_body=EXACT)
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + 6
        assert limiter.tokens_available("acme") == 500.0 - chat.usage.total_tokens
        with pytest.raises(openai.RateLimitError) as refused:  # it may fill the 512-token context: 512 > 500
            await acme.chat.completions.create(model="tiny", messages=messages)
        return chat.usage.prompt_tokens, refused.value.body["message"]

    prompt, message = asyncio.run(scenario())
    assert message.startswith(
        f"Request too large for tenant acme on tokens per minute: limit 500, requested 512 "
        f"(prompt {prompt} + up to {512 - prompt} completion tokens)"
    )


def test_route_refuses_bad_limits_before_waiting_for_executors(tmp_path, capsys):
    bad = tmp_path / "limits.toml"
    bad.write_text("[tenants.acme]\nmax_in_flight = 0\n")
    assert route_main(["--executor", "http://127.0.0.1:9", "--api-key", "k:acme", "--tenant-limits", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f"kvreuse route: --tenant-limits {bad}: tenants.acme.max_in_flight: expected a "
        'whole number >= 1 or "unlimited", got 0\n'
    )
    assert (
        route_main(
            [
                "--executor",
                "http://127.0.0.1:9",
                "--api-key",
                "k:acme",
                "--tenant-limits",
                str(bad),
                "--tenant-max-in-flight",
                "2",
            ]
        )
        == 2
    )  # the file is still checked
    assert (
        route_main(["--executor", "http://127.0.0.1:9", "--api-key", "k:acme", "--tenant-tokens-per-minute", "0"]) == 2
    )
    assert "--tenant-tokens-per-minute: expected a whole number >= 1, got 0" in capsys.readouterr().err


def test_a_request_the_executor_refuses_costs_the_tenant_nothing_on_the_router(engine):
    """docs/router.md#tenant-limits: a request refused by validation (400, 404) costs nothing,
    through the router as straight to the executor, streamed or not."""
    clock = Clock()
    cluster = Cluster(engine, clock)

    async def scenario():
        await cluster.start()
        charged = {}
        for direct in (True, False):
            acme = cluster.client("acme-key", direct=direct)
            with pytest.raises(openai.NotFoundError):  # unknown model: the executor's 404
                await acme.completions.create(model="nope", prompt=PROMPT, max_tokens=8, extra_body=EXACT)
            with pytest.raises(openai.NotFoundError):
                await acme.completions.create(model="nope", prompt=PROMPT, max_tokens=8, stream=True, extra_body=EXACT)
            limiter = cluster.executor_limiter if direct else cluster.router_limiter
            charged[direct] = (
                limiter.tokens_charged("acme"),
                limiter.tokens_available("acme"),
                limiter.in_flight("acme"),
            )
        return charged

    charged = asyncio.run(scenario())
    assert charged == {True: (0, 120.0, 0), False: (0, 120.0, 0)}


class _Breaks(httpx.AsyncByteStream):
    """``chunks``, then the connection breaks (the executor died mid-stream)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("connection reset by peer")


def test_a_routed_stream_cut_short_keeps_its_reservation_charged_whatever_usage_its_chunks_carry():
    """Per-chunk usage (``continuous_usage_stats``) counts one choice's tokens so far: a stream
    cut before its usage chunk keeps its reservation charged (docs/router.md#tenant-limits),
    here n = 2, where each chunk's usage is one choice's."""
    import json

    from kvreuse.router.prompt_keys import HashSettings

    def chunk(index: int, completion: int) -> bytes:
        body = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "tiny",
            "choices": [{"index": index, "text": "x", "logprobs": None, "finish_reason": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion},
        }
        return f"data: {json.dumps(body)}\n\n".encode()

    def handle(request: httpx.Request) -> httpx.Response:
        events = [chunk(0, 1), chunk(1, 1), chunk(0, 2), chunk(1, 2)]  # 4 tokens out when it died
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Breaks(events))

    limiter = TenantLimiter(TenantLimits(tenants={"acme": Limits(tokens_per_minute=120)}), Clock())

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as upstream:
            router = Router(
                [Executor("http://a", healthy=True)],
                PromptHasher(None, HashSettings("m", 4, "sha256")),
                make_policy("kv"),
                client=upstream,
                seed=0,
                executor_api_key=ADMIN,
            )
            app = build_router_app(router, api_key=KEYS, limiter=limiter)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
                sent = await http.post(
                    "/v1/completions",
                    headers={"authorization": "Bearer acme-key"},
                    json={
                        "model": "tiny",
                        "prompt": [1, 2, 3],
                        "max_tokens": 8,
                        "n": 2,
                        "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    },
                )
        return sent.text.count('"usage"'), '"executor_failed"' in sent.text, limiter.tokens_charged("acme")

    assert asyncio.run(scenario()) == (4, True, 19)  # prompt 3 + 2 x 8 reserved; 4 chunks' usage relayed
