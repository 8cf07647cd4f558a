"""Mid-stream migration through the real router app, in process: every executor is the one
real executor app (tiny random Llama), reached over a transport that cuts chosen streams
after a given number of whole events (then half an event, then a broken connection), as a
SIGKILL does. The continued reply must be the uninterrupted one: same text, token ids,
finish reason and usage, for every cut point. (tests/router/test_migration_e2e.py kills
real executor processes.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvreuse.router.app import build_router_app
from kvreuse.router.deadline import DEFAULT_DEADLINES
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import PromptHasher
from kvreuse.router.router import Router, fetch_info

NAMES = ("http://a", "http://b", "http://c", "http://d")


@pytest.fixture(scope="module")
def executor_app(tiny_llama):
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.server.api_server import build_app

    engine = AsyncEngine(
        LLMEngine(EngineConfig(kv_cache_memory_gib=0.02, block_size=16, max_model_len=512, max_num_seqs=8), tiny_llama)
    )
    engine.start()
    yield build_app(engine, served_model_name="tiny")
    engine.shutdown()


class _Breaking(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self):
        yield self.data
        raise httpx.ReadError("connection reset by peer")


class _Executors(httpx.AsyncBaseTransport):
    """Every executor name reaches the same real app; streamed responses are cut as ``cuts``
    says, in order (``None``: whole). Records each streamed request's path and body."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.cuts: list[int | None] = []
        self.streams: list[tuple[str, str, dict]] = []  # (executor, path, body)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return response
        self.streams.append((f"http://{request.url.host}", request.url.path, json.loads(request.content)))
        cut = self.cuts.pop(0) if self.cuts else None
        if cut is None:
            return response
        events = (await response.aread()).split(b"\n\n")
        assert cut < len(events) - 2, "cut inside the stream, before [DONE]"
        kept = b"".join(e + b"\n\n" for e in events[:cut]) + events[cut][:12]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Breaking(kept))


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(info):
    """The tokenizer as ``kvreuse route`` loads it (once per model here: it takes a while)."""
    from kvreuse.router.tokenizer import load_tokenizer

    if info.model_id not in _TOKENIZERS:
        _TOKENIZERS[info.model_id] = load_tokenizer(info)
    return _TOKENIZERS[info.model_id]


def _scenario(
    app,
    calls,
    *,
    cuts=(),
    limit=3,
    executors=NAMES,
    api_key=None,
    limiter=None,
    transport_type=None,
    deadlines=DEFAULT_DEADLINES,
):
    """Run ``calls(http, client)`` against a fresh router over ``executors`` whose streams are
    cut as ``cuts`` says (``api_key``, ``limiter``: the router app's; ``transport_type``: an
    ``_Executors`` that cuts otherwise; ``deadlines``: the router's); returns (what calls
    returned, the transport, the router)."""

    async def run():
        transport = (transport_type or _Executors)(app)
        transport.cuts = list(cuts)
        upstream = httpx.AsyncClient(transport=transport)
        infos = [await fetch_info(upstream, name) for name in executors]
        router = Router(
            [Executor(i.url, i, healthy=True) for i in infos],
            PromptHasher(_tokenizer(infos[0]), infos[0].settings),
            make_policy("round_robin"),
            client=upstream,
            seed=0,
            migration_limit=limit,
            deadlines=deadlines,
        )
        app_ = build_router_app(router, api_key=api_key, limiter=limiter)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app_), base_url="http://r")
        client = openai.AsyncOpenAI(base_url="http://r/v1", api_key="none", http_client=http, max_retries=0)
        try:
            return await calls(http, client), transport, router
        finally:
            await http.aclose()
            await upstream.aclose()

    return asyncio.run(run())


def _events(raw: bytes) -> list:
    out = []
    for event in raw.split(b"\n\n"):
        if event and not event.startswith(b":"):  # a keep-alive comment (a continuation's slow first byte)
            assert event.startswith(b"data: "), event
            out.append("[DONE]" if event == b"data: [DONE]" else json.loads(event[6:]))
    return out


def _reply(events: list, chat: bool) -> dict:
    """Text, token ids, finish reason and usage of a one-choice stream (ids only where sent)."""
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    text, ids, finish, usage = "", [], None, None
    for e in events[:-1]:
        usage = e.get("usage") or usage
        for c in e["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            ids += c.get("token_ids") or []
            finish = c["finish_reason"] or finish
    return {"text": text, "ids": ids, "finish": finish, "usage": usage}


def _counts(router) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for m in router.metrics.migrations.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }


COMPLETION = {
    "prompt": "The migration of a stream, token by token:",
    "max_tokens": 24,
    "temperature": 0.0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
CHAT = {
    "messages": [{"role": "user", "content": "Continue this stream elsewhere, please."}],
    "max_tokens": 24,
    "temperature": 0.0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def _post(body: dict, path: str):
    async def call(http, _client):
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.content

    return call


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_cut_point_continues_to_the_uninterrupted_reply(executor_app, chat):
    body, path = (CHAT, "/v1/chat/completions") if chat else (COMPLETION, "/v1/completions")
    _scenario(executor_app, _post(body, path))  # the prompt is cached from here on: cached_tokens agree
    raw, _, _ = _scenario(executor_app, _post(body, path))
    whole = _events(raw)
    reference = _reply(whole, chat)
    assert reference["finish"] == "length" and reference["usage"]["completion_tokens"] == 24
    assert reference["ids"] == []  # the client did not ask for token ids: none reach it
    n_events = len(whole) - 2  # the chunks before the usage chunk and [DONE]
    for cut in range(0, n_events):
        raw, transport, router = _scenario(executor_app, _post(body, path), cuts=[cut])
        assert _reply(_events(raw), chat) == reference, f"cut after {cut} events"
        assert _counts(router) == {"continued": 1.0}
        (first, first_path, first_body), (second, second_path, second_body) = transport.streams
        assert first_path == path and first_body["return_token_ids"] is True and second != first
        if cut == 0:  # the client had nothing: the same request again
            assert second_path == path and second_body == first_body
        else:  # the prompt's ids and the ids sent, for the rest of the budget
            assert second_path == "/v1/completions"
            assert len(second_body["prompt"]) + second_body["max_tokens"] == reference["usage"]["total_tokens"]


def test_token_ids_and_usage_are_the_clients_when_it_asks(executor_app):
    body = {
        **COMPLETION,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    whole = _events(_scenario(executor_app, _post(body, "/v1/completions"))[0])
    reference = _reply(whole, False)
    assert len(reference["ids"]) == 24
    prompt_ids = whole[0]["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == reference["usage"]["prompt_tokens"]
    raw, _, router = _scenario(executor_app, _post(body, "/v1/completions"), cuts=[6])
    events = _events(raw)
    assert _reply(events, False) == reference
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert sum("prompt_token_ids" in c for e in events[:-1] for c in e["choices"]) == 1  # not the continuation's
    per_chunk = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert per_chunk == sorted(per_chunk) and per_chunk[-1] == 24  # continuous usage counts the whole reply


def test_a_stop_string_is_found_across_the_cut_as_without_one(executor_app):
    text = _reply(_events(_scenario(executor_app, _post(COMPLETION, "/v1/completions"))[0]), False)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # ends the reply half way
    body = {**COMPLETION, "stop": [stop]}
    raw, _, _ = _scenario(executor_app, _post(body, "/v1/completions"))
    whole = _events(raw)
    reference = _reply(whole, False)
    assert reference["finish"] == "stop" and reference["text"] == text[: text.index(stop)]
    for cut in range(1, len(whole) - 2):
        raw, transport, _ = _scenario(executor_app, _post(body, "/v1/completions"), cuts=[cut])
        assert _reply(_events(raw), False) == reference, f"cut after {cut} events"
        assert "stop" not in transport.streams[1][2]  # the router applies the stop string itself


def test_three_migrations_then_the_limit_ends_the_stream_with_an_error_the_client_raises(executor_app):
    _scenario(executor_app, _post(CHAT, "/v1/chat/completions"))  # cached from here on
    reference = _reply(_events(_scenario(executor_app, _post(CHAT, "/v1/chat/completions"))[0]), True)
    raw, transport, router = _scenario(executor_app, _post(CHAT, "/v1/chat/completions"), cuts=[3, 2, 4])
    assert _reply(_events(raw), True) == reference
    assert sorted(s[0] for s in transport.streams) == list(NAMES)  # each on an executor not tried before
    assert _counts(router) == {"continued": 3.0}

    async def read(_http, client):
        texts = []
        try:
            async for chunk in await client.chat.completions.create(
                model="tiny",
                messages=CHAT["messages"],
                max_tokens=24,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                texts.append(chunk.choices[0].delta.content or "")
        except openai.APIError as exc:
            return texts, exc
        return texts, None

    (texts, error), _, router = _scenario(executor_app, read, cuts=[3, 2, 4, 2])
    assert isinstance(error, openai.APIError) and error.body["code"] == "executor_failed"
    assert (
        "it could not be continued on another executor: the migration limit is reached (--migration-limit 3)"
        in error.message
    )
    assert reference["text"].startswith("".join(texts)) and texts
    assert _counts(router) == {"continued": 3.0, "limit": 1.0}


@pytest.mark.parametrize(
    "case,extra,limit,executors,reason",
    [
        ("off", {}, 0, NAMES, "migration is off (--migration-limit 0)"),
        ("alone", {}, 3, NAMES[:1], "no other healthy executor (tried executor 0)"),
        ("n", {"n": 2}, 3, NAMES, "it asks for n = 2 choices (only n = 1 is continued)"),
        ("logprobs", {"logprobs": 2}, 3, NAMES, "it asks for logprobs (not continued)"),
    ],
)
def test_a_stream_that_cannot_be_continued_ends_with_an_error_the_client_raises(
    executor_app, case, extra, limit, executors, reason
):
    async def read(_http, client):
        texts = []
        try:
            async for chunk in await client.completions.create(
                model="tiny",
                prompt=COMPLETION["prompt"],
                max_tokens=24,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True, **extra},
            ):
                texts.append(chunk.choices[0].text)
        except openai.APIError as exc:
            return texts, exc
        return texts, None

    (texts, error), _, router = _scenario(executor_app, read, cuts=[3], limit=limit, executors=executors)
    assert texts and isinstance(error, openai.APIError)
    failure = "the executor serving this stream (executor 0) failed mid-response: the connection broke (ReadError); "
    assert (
        error.message == f"{failure}it could not be continued on another executor: {reason}; the output is incomplete"
    )
    assert router.metrics.streams_cut._value.get() == 1
    outcome = {"off": "limit", "alone": "no_executor"}.get(case, "unsupported")
    assert _counts(router) == {outcome: 1.0}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_stream_reaches_the_client_as_the_executor_sends_it(executor_app, chat):
    # what the router asks for on top (token ids, usage on every chunk) is stripped again
    body, path = (CHAT, "/v1/chat/completions") if chat else (COMPLETION, "/v1/completions")
    body = {**body, "stream_options": None}

    async def direct():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=executor_app), base_url="http://x") as http:
            return (await http.post(path, json=body)).content

    routed, _, router = _scenario(executor_app, _post(body, path))
    mine, theirs = _events(routed), _events(asyncio.run(direct()))
    for e in mine[:-1] + theirs[:-1]:
        e.pop("id"), e.pop("created")
    assert [json.dumps(e) for e in mine] == [json.dumps(e) for e in theirs]  # keys in the executor's order too
    assert b"token_ids" not in routed and b"usage" not in routed
    assert _counts(router) == {}


def test_a_reply_cut_after_its_last_chunk_is_ended_by_the_router(executor_app):
    _scenario(executor_app, _post(COMPLETION, "/v1/completions"))  # cached from here on
    whole = _events(_scenario(executor_app, _post(COMPLETION, "/v1/completions"))[0])
    last = len(whole) - 2  # the finish chunk is sent; the usage chunk and [DONE] are not
    raw, transport, router = _scenario(executor_app, _post(COMPLETION, "/v1/completions"), cuts=[last])
    assert _reply(_events(raw), False) == _reply(whole, False)
    assert len(transport.streams) == 1 and _counts(router) == {"finished": 1.0}


def test_a_pml_prompt_is_not_continued_and_says_why(executor_app):
    schema = '<schema name="migr"><system>Be brief.</system><module name="doc">The well is dry.</module></schema>'

    async def calls(_http, client):
        texts = []
        try:
            async for chunk in await client.completions.create(
                model="tiny",
                prompt='<prompt schema="migr"><doc/><user>Why?</user></prompt>',
                max_tokens=24,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                texts.append(chunk.choices[0].text)
        except openai.APIError as exc:
            return texts, exc
        return texts, None

    async def register():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=executor_app), base_url="http://x") as http:
            assert (await http.post("/v1/schemas", json={"schema": schema})).status_code == 200

    asyncio.run(register())
    (texts, error), _, router = _scenario(executor_app, calls, cuts=[3])
    assert texts and isinstance(error, openai.APIError)
    assert (
        "it could not be continued on another executor: the executor sent no prompt_token_ids (a PML prompt"
        in error.message
    )
    assert _counts(router) == {"unsupported": 1.0}


def test_a_tenant_is_charged_the_whole_migrated_reply(executor_app):
    from kvreuse.api.limiter import TenantLimiter
    from kvreuse.api.tenant_limits import Limits, TenantLimits

    text = _reply(_events(_scenario(executor_app, _post(COMPLETION, "/v1/completions"))[0]), False)["text"]
    body = {
        **{k: v for k, v in COMPLETION.items() if k != "stream_options"},  # the client asks for no usage
        "stop": [text[len(text) // 2 : len(text) // 2 + 6]],
    }  # ends early: usage < the reservation
    whole = _events(
        _scenario(executor_app, _post({**body, "stream_options": {"include_usage": True}}, "/v1/completions"))[0]
    )
    usage = _reply(whole, False)["usage"]
    total = usage["total_tokens"]
    assert usage["completion_tokens"] < 24
    limiter = TenantLimiter(TenantLimits(tenants={"acme": Limits(tokens_per_minute=100_000)}))

    async def call(http, _client):
        r = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer acme-key"})
        assert r.status_code == 200, r.text
        return r.content

    raw, _, router = _scenario(executor_app, call, cuts=[7], api_key=["admin-key", "acme-key:acme"], limiter=limiter)
    assert b'"usage"' not in raw and raw.endswith(b"data: [DONE]\n\n")  # read by the router, not sent
    assert _counts(router) == {"continued": 1.0}
    assert limiter.tokens_charged("acme") == total  # the reply's usage, across both executors (not the reservation)


class _CutBeforeDone(_Executors):
    """Streams lose only their ``[DONE]`` (the executor dies right after its usage chunk)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return response
        self.streams.append((f"http://{request.url.host}", request.url.path, json.loads(request.content)))
        data = await response.aread()
        assert data.endswith(b"data: [DONE]\n\n")
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Breaking(data[: -len(b"data: [DONE]\n\n")])
        )


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_reply_cut_after_its_usage_chunk_gets_one_usage_chunk(executor_app, chat):
    body, path = (CHAT, "/v1/chat/completions") if chat else (COMPLETION, "/v1/completions")
    _scenario(executor_app, _post(body, path))  # cached from here on
    whole = _events(_scenario(executor_app, _post(body, path))[0])
    raw, transport, router = _scenario(executor_app, _post(body, path), transport_type=_CutBeforeDone)
    events = _events(raw)
    assert _reply(events, chat) == _reply(whole, chat)
    assert sum(1 for e in events[:-1] if e["choices"] == []) == 1  # the usage chunk, once (not again at the end)
    assert len(events) == len(whole)
    assert len(transport.streams) == 1 and _counts(router) == {"finished": 1.0}


@pytest.mark.parametrize("salt", [None, "mine"])
def test_a_continuation_carries_the_tenants_salt(executor_app, salt):
    """A tenant key's continuation has the salt its first request had (isolation)."""
    from kvreuse.api.tenants import tenant_salt

    body = {**COMPLETION, **({"cache_salt": salt} if salt else {})}

    async def call(http, _client):
        r = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer acme-key"})
        assert r.status_code == 200, r.text
        return r.content

    _, transport, _ = _scenario(executor_app, call, cuts=[5], api_key=["admin-key", "acme-key:acme"])
    (_, _, first), (_, p2, second) = transport.streams
    assert p2 == "/v1/completions"
    assert first["cache_salt"] == second["cache_salt"] == tenant_salt("acme", salt)


def test_a_continuation_carries_the_clients_authorization(executor_app):
    """Without router keys the executors check the client's key: the continuation sends it too."""
    seen = []

    class _Rec(_Executors):
        async def handle_async_request(self, request):
            seen.append(request.headers.get("authorization"))
            return await super().handle_async_request(request)

    async def call(http, _client):
        r = await http.post("/v1/completions", json=COMPLETION, headers={"authorization": "Bearer acme-key"})
        return r.content

    _, transport, _ = _scenario(executor_app, call, cuts=[5], transport_type=_Rec)
    assert transport.streams[1][1] == "/v1/completions"
    assert seen[-2:] == ["Bearer acme-key", "Bearer acme-key"], seen
