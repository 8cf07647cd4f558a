"""The proxy when the client leaves before its response, prompts the router cannot hash, and
``/v1/route/explain`` as a dry run. Executors are played by in-process HTTP transports."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.requests import Request

from kvreuse.router.app import build_router_app
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.proxy import EXECUTOR_HEADER, forward
from kvreuse.router.router import Router

BS = 4
RAW = json.dumps({"prompt": list(range(100, 110)), "max_tokens": 1}).encode()  # 10 tokens: 3 prompt blocks
JSON = {"content-type": "application/json"}


def _router(client: httpx.AsyncClient, names=("a",), policy: str = "kv") -> Router:
    executors = [Executor(f"http://{n}", healthy=True) for n in names]
    return Router(
        executors, PromptHasher(None, HashSettings("m", BS, "sha256")), make_policy(policy), client=client, seed=0
    )


def _client_request() -> tuple[Request, asyncio.Event]:
    """A POST whose body was read; setting the event is the client disconnecting."""
    left = asyncio.Event()

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive), left


class _Stalled(httpx.AsyncByteStream):
    """A body that sends ``first`` (if any) and then nothing until it is closed."""

    def __init__(self, first: bytes | None, closed: list[str]) -> None:
        self.first, self.closed = first, closed

    async def __aiter__(self):
        if self.first is not None:
            yield self.first
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.append("closed")


@pytest.mark.parametrize("stage", ["before_headers", "during_body", "before_first_chunk"])
def test_a_client_that_leaves_closes_the_upstream_request(stage):
    # before_headers: a non-streamed response (the executor's headers come with the whole
    # answer); during_body: headers came, the body has not; before_first_chunk: a stream
    # whose first token has not come. In each the upstream request must be closed (the
    # executor then aborts it and frees its blocks) and nothing retried elsewhere.
    upstream: list[str] = []

    async def scenario():
        reached = asyncio.Event()

        async def handle(request: httpx.Request) -> httpx.Response:
            upstream.append(request.url.host)
            reached.set()
            if stage == "before_headers":
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    upstream.append("cancelled")
                    raise
            if stage == "during_body":
                return httpx.Response(200, headers=JSON, stream=_Stalled(b'{"choi', upstream))
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stalled(None, upstream))

        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            router = _router(client, ("a", "b"))
            request, left = _client_request()
            task = asyncio.create_task(forward(router, "/v1/completions", RAW, JSON, chat=False, request=request))
            await reached.wait()
            assert sum(e.in_flight for e in router.executors.values()) == 1
            left.set()
            response = await task
            return response, router

    response, router = asyncio.run(scenario())
    assert response.status_code == 499
    assert json.loads(response.body)["error"]["type"] == "client_disconnected"
    assert upstream[1:] == ["cancelled" if stage == "before_headers" else "closed"]
    assert len(upstream) == 2  # one executor tried, no retry
    assert [e.in_flight for e in router.executors.values()] == [0, 0]
    assert [e.in_flight_blocks for e in router.executors.values()] == [0, 0]
    assert router.num_retries == 0
    assert all(e.healthy for e in router.executors.values())


def test_a_client_that_stays_gets_the_response():
    async def scenario():
        def handle(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"choices": [{"text": "ok"}]})

        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            router = _router(client)
            request, _ = _client_request()
            response = await forward(router, "/v1/completions", RAW, JSON, chat=False, request=request)
            return response, router

    response, router = asyncio.run(scenario())
    assert (response.status_code, json.loads(response.body)) == (200, {"choices": [{"text": "ok"}]})
    assert router.executors["http://a"].in_flight == 0


def test_unhashable_token_ids_reach_the_executor_and_its_400_comes_back():
    huge = json.dumps({"prompt": [10**30] * 40, "max_tokens": 1}).encode()
    seen: list[bytes] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        error = {"message": "token id out of range", "type": "invalid_request_error"}
        return httpx.Response(400, json={"error": error})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            router = _router(client)
            response = await forward(router, "/v1/completions", huge, JSON, chat=False)
            app = build_router_app(router)  # no lifespan through ASGITransport: nothing is probed
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
                explain = await c.post("/v1/route/explain", json={"prompt": [10**30] * 40})
            return response, explain, router

    response, explain, router = asyncio.run(scenario())
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["message"] == "token id out of range"
    assert seen == [huge]
    assert router.executors["http://a"].in_flight == 0
    assert explain.status_code == 200
    d = explain.json()
    assert (d["prompt_tokens"], d["prompt_blocks"], d["choice"]) == (0, 0, "http://a")
    assert [(e["overlap_blocks"], e["score"]) for e in d["executors"]] == [(0, 0.0)]


def test_explain_does_not_move_round_robin():
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            router = _router(client, ("a", "b"), policy="round_robin")
            app = build_router_app(router)
            pairs = []
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
                for _ in range(4):
                    explained = (await c.post("/v1/route/explain", json={"prompt": [1, 2]})).json()["choice"]
                    served = (await c.post("/v1/completions", content=RAW, headers=JSON)).headers[EXECUTOR_HEADER]
                    pairs.append((explained, served))
            return pairs

    assert asyncio.run(scenario()) == [
        ("http://a", "http://a"),
        ("http://b", "http://b"),
        ("http://a", "http://a"),
        ("http://b", "http://b"),
    ]


class _Events(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self):
        yield self.data


def test_a_routed_body_is_parsed_once_and_forwarded_as_parsed(monkeypatch):
    import kvreuse.router.app as app_module
    import kvreuse.router.proxy as proxy_module

    parsed: list[bytes] = []
    real = app_module.parse_json_body

    def counting(raw: bytes):
        parsed.append(raw)
        return real(raw)

    monkeypatch.setattr(app_module, "parse_json_body", counting)
    monkeypatch.setattr(proxy_module, "parse_json_body", counting)
    seen: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if seen[-1].get("stream"):
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, stream=_Events(b"data: [DONE]\n\n")
            )
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    stream = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "stream": True}).encode()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            app = build_router_app(_router(client))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
                plain = await c.post("/v1/completions", content=RAW, headers=JSON)
                streamed = await c.post("/v1/completions", content=stream, headers=JSON)
            return plain, streamed

    plain, streamed = asyncio.run(scenario())
    assert (plain.status_code, streamed.status_code, streamed.content) == (200, 200, b"data: [DONE]\n\n")
    assert parsed == [RAW, stream]  # once per request, by the app
    assert seen[0] == json.loads(RAW)
    assert seen[1] == {
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def test_when_every_executor_fails_the_503_names_them_by_id_never_by_address():
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"connect to {request.url} refused")

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            router = _router(client, ("a", "b"), policy="round_robin")
            return await forward(router, "/v1/completions", RAW, JSON, chat=False), router

    response, router = asyncio.run(scenario())
    message = json.loads(response.body)["error"]["message"]
    assert response.status_code == 503
    assert message == (
        "no executor could serve the request (ConnectError('connect to executor 1/v1/completions refused')); "
        "tried executor 0, executor 1"
    )
    assert [e.last_error for e in router.executors.values()] == [
        "connection failed: ConnectError('connect to http://a/v1/completions refused')",
        "connection failed: ConnectError('connect to http://b/v1/completions refused')",
    ]  # the admin route (/v1/route/executors) and the log keep the addresses


class _DoneThenOpen(httpx.AsyncByteStream):
    """A stream that sends ``data`` (ending with ``[DONE]``) and then keeps its connection open
    until it is closed, as an executor slow to close it would."""

    def __init__(self, data: bytes, closed: list[str]) -> None:
        self.data, self.closed = data, closed

    async def __aiter__(self):
        yield self.data
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.append("closed")


def test_a_passed_through_stream_ends_at_done_and_releases_its_executor():
    # Executors send nothing after data: [DONE] (serving.sse's last event), so the relay of a
    # stream the router does not continue (here: migration off) ends the client's response
    # there, closes the upstream response and frees the executor's place, without waiting for
    # the executor to close the connection (it read on until the progress deadline, then
    # appended an error event after [DONE] and marked the executor down).
    from kvreuse.router.deadline import Deadlines

    events = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    closed: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_DoneThenOpen(events, closed))

    stream = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "stream": True}).encode()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            router = _router(client)
            router.migration_limit = 0
            router.deadlines = Deadlines(60.0, 1.0)
            response = await forward(router, "/v1/completions", stream, JSON, chat=False)
            body = b"".join([chunk async for chunk in response.body_iterator])
            return body, router

    body, router = asyncio.run(scenario())
    assert body == events
    assert closed == ["closed"]
    a = router.executors["http://a"]
    assert (a.in_flight, a.in_flight_blocks, a.healthy) == (0, 0, True)
    assert router.metrics.streams_cut._value.get() == 0
