"""``/v1/messages`` over the tiny Llama: the message shape, Anthropic's errors, the event
sequence, cache_control's usage and retention (exact counts)."""

from __future__ import annotations

import json

import pytest

from .helpers import BLOCK_SIZE, words


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def _body(**extra):
    return {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": words(20, 71)}],
        **extra,
    }


def test_a_message_in_anthropic_shape(client):
    r = client.post("/v1/messages", json=_body(), headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "tiny" and body["stop_sequence"] is None
    assert body["stop_reason"] in ("max_tokens", "end_turn")
    assert [b["type"] for b in body["content"]] in (["text"], [])
    usage = body["usage"]
    n = client.post("/v1/messages/count_tokens", json=_body()).json()["input_tokens"]
    # no breakpoint: nothing is written; reads and plain input add up to the prompt
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == n
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    assert 1 <= usage["output_tokens"] <= 4


def test_count_tokens_is_the_rendered_prompt(client, async_engine):
    body = {"model": "tiny", "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/messages/count_tokens", json=body)
    text = async_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert r.json() == {"input_tokens": len(async_engine.tokenizer.encode(text, add_special_tokens=False))}


@pytest.mark.parametrize(
    ("body", "status", "kind", "message"),
    [
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
            "max_tokens: field required",
        ),
        (_body(model="other"), 404, "not_found_error", "model: the model `other` does not exist"),
        (
            _body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            400,
            "invalid_request_error",
            "messages[0].content[0]: type 'image' is not supported",
        ),
        (
            _body(tools=[{"name": "f", "input_schema": {"type": "object"}}]),
            400,
            "invalid_request_error",
            "tools: this model's chat template does not render tools",
        ),
        (
            _body(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
                    }
                ]
            ),
            400,
            "invalid_request_error",
            "messages[0].content[0].cache_control.ttl: Input should be '5m' or '1h'",
        ),
        (
            _body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)
                        ],
                    }
                ]
            ),
            400,
            "invalid_request_error",
            "messages[0].content[4].cache_control: a request may have at most 4 blocks with cache_control, got 5",
        ),
        (
            _body(
                system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
                cache_control={"type": "ephemeral", "ttl": "1h"},
            ),
            400,
            "invalid_request_error",
            "cache_control.ttl: a 1h cache_control may not follow a 5m one (system[0].cache_control)",
        ),
        (_body(temperature=1.5), 400, "invalid_request_error", "temperature: Input should be less than or equal to 1"),
    ],
)
def test_errors_in_anthropic_shape(client, body, status, kind, message):
    r = client.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"type", "error"} and got["type"] == "error"
    assert got["error"]["type"] == kind and got["error"]["message"].startswith(message), got


def test_openai_routes_keep_their_shape(client):
    r = client.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_stream_event_sequence(client):
    body = _body(stream=True, max_tokens=3, messages=[{"role": "user", "content": words(20, 72)}])
    with client.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.read().decode())
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(payload["type"] == name for name, payload in events)
    start, final = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 1
    assert (
        final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        or final["delta"]["stop_reason"] == "end_turn"
    )
    assert final["usage"]["output_tokens"] == 3 or final["delta"]["stop_reason"] == "end_turn"
    whole = client.post("/v1/messages", json={**body, "stream": False}).json()
    text = "".join(p["delta"]["text"] for n, p in events if n == "content_block_delta")
    assert whole["content"] == ([{"type": "text", "text": text}] if text else [])


def test_two_breakpoints_usage_exact_on_first_and_repeat(client, async_engine):
    system = words(60, 73)
    history = [{"role": "user", "content": words(80, 74)}, {"role": "assistant", "content": words(10, 75)}]
    body = _body(
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[
            *history[:1],
            {
                "role": "assistant",
                "content": [{"type": "text", "text": history[1]["content"], "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "user", "content": "and then?"},
        ],
    )
    tok = async_engine.tokenizer
    chat = [{"role": "system", "content": system}, *history]

    def tokens(messages, gen=False):
        return len(
            tok.encode(
                tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False), add_special_tokens=False
            )
        )

    n = tokens([*chat, {"role": "user", "content": "and then?"}], gen=True)
    system_end, last_bp = tokens(chat[:1]), tokens(chat)
    stored = last_bp // BLOCK_SIZE * BLOCK_SIZE  # full blocks up to the last breakpoint
    first = client.post("/v1/messages", json=body).json()["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert first["cache_creation_input_tokens"] == stored
    assert first["cache_creation"] == {
        "ephemeral_1h_input_tokens": system_end,
        "ephemeral_5m_input_tokens": stored - system_end,
    }
    assert first["input_tokens"] == n - stored
    second = client.post("/v1/messages", json=body).json()["usage"]
    cached = (n - 1) // BLOCK_SIZE * BLOCK_SIZE  # every block but the one holding the last token
    assert second["cache_read_input_tokens"] == cached
    assert second["cache_creation_input_tokens"] == 0
    assert second["input_tokens"] == n - cached


def test_stop_sequence_is_reported(client):
    probe = client.post(
        "/v1/messages", json=_body(max_tokens=6, messages=[{"role": "user", "content": words(20, 76)}])
    ).json()
    text = probe["content"][0]["text"] if probe["content"] else ""
    stop = text.strip()[2:4]
    if len(stop) < 2:
        pytest.skip("the random model's reply is too short to cut")
    r = client.post(
        "/v1/messages",
        json=_body(max_tokens=6, stop_sequences=[stop], messages=[{"role": "user", "content": words(20, 76)}]),
    ).json()
    assert r["stop_reason"] == "stop_sequence" and r["stop_sequence"] == stop
    assert text.startswith(r["content"][0]["text"] if r["content"] else "")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: Input should be a valid list"),
        ({"system": {"text": "x"}}, "system: Input should be a valid list"),
        ({"max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
        ({"cache_control": "ephemeral"}, "cache_control: Input should be a valid dictionary"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role: Input should be 'user' or 'assistant'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
            "messages[0].content[0]: input is required in a tool_use block",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "document", "source": {"type": "base64", "data": "x"}}]}
                ]
            },
            "messages[0].content[0].source.type: Input should be 'text'",
        ),
        ({"stop_sequences": ["a"] * 5}, "stop_sequences: List should have at most 4 items"),
        ({"stop_sequences": [""]}, "stop_sequences: each must be a non-empty string"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 600,
                    }
                ]
            },
            "messages[0].content[4].cache_control: a request may have at most 4 blocks with cache_control, got 600",
        ),
    ],
)
def test_hostile_input_gets_a_400_naming_the_field(client, fields, message):
    r = client.post("/v1/messages", json=_body(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message), r.json()


def test_a_body_over_the_limit_is_anthropics_413_and_nothing_else_is_disturbed(client):
    huge = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 100_000  # 10^5 breakpoints
    r = client.post("/v1/messages", json=_body(messages=[{"role": "user", "content": huge}]))
    assert r.status_code == 413
    assert r.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "request body exceeds the 65536-byte limit"},
    }
    assert client.post("/v1/messages", json=_body()).status_code == 200


def test_a_failure_mid_stream_is_an_error_event_after_what_was_sent():
    import asyncio
    from types import SimpleNamespace

    from kvreuse.api.anthropic_prompt import MessagesPrompt
    from kvreuse.api.cache_breakpoints import CachePlan
    from kvreuse.engine.async_engine import EngineError
    from kvreuse.engine.outputs import RequestOutput
    from kvreuse.server.messages_routes import _stream

    first = RequestOutput("m", [1] * 20, [7], [7], "Hi", "Hi", False, None, 20, 16, 0.01)

    class Streams:
        closed = False

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            yield 0, first
            raise EngineError("the engine failed: boom")

        async def aclose(self):
            Streams.closed = True

    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=None, block_size=16), metrics=None)

    async def collect():
        return [e async for e in _stream(ctx, Streams(), MessagesPrompt([1] * 20, CachePlan()), "msg_1", "tiny", ())]

    events = _events("".join(asyncio.run(collect())))
    assert [n for n, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta", "error"]
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 16,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 1,
    }
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the engine failed: boom"}}
    assert Streams.closed


def test_a_tenants_tokens_per_minute_hold_on_messages_with_x_api_key(tiny_llama):
    import asyncio

    import httpx

    from kvreuse.api.limiter import TenantLimiter
    from kvreuse.api.tenant_limits import Limits, TenantLimits
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.server.api_server import build_app

    now = [100.0]
    limiter = TenantLimiter(TenantLimits(tenants={"acme": Limits(tokens_per_minute=120)}), lambda: now[0])
    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory_gib=0.004, block_size=BLOCK_SIZE), tiny_llama))
    engine.start()
    try:
        app = build_app(engine, api_key=["admin-key", "acme-key:acme"], served_model_name="tiny", limiter=limiter)

        async def scenario():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://t", headers={"x-api-key": "acme-key"}
            ) as acme:
                n = (await acme.post("/v1/messages/count_tokens", json=_body())).json()["input_tokens"]
                ok = await acme.post("/v1/messages", json=_body())
                refused = await acme.post("/v1/messages", json=_body(max_tokens=121 - n))
                wrong = await acme.post("/v1/messages", json=_body(), headers={"x-api-key": "nope"})
                return n, ok, refused, wrong

        n, ok, refused, wrong = asyncio.run(scenario())
    finally:
        engine.shutdown()
    usage = ok.json()["usage"]
    assert limiter.tokens_charged("acme") == n + usage["output_tokens"]
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.json()["error"]["message"].startswith("Request too large for tenant acme on tokens per minute")
    assert wrong.status_code == 401 and wrong.json() == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
        },
    }


def test_cache_control_on_a_document_sets_its_blocks_retention(client, async_engine):
    """A ``cache_control`` over a document block: the document's own blocks (and the head text
    encoded before it, inside the same range) take the document priority (50, 5 minutes),
    not the default 35, as a plain prompt's marked blocks do."""
    from kvreuse.api.anthropic_prompt import render_messages
    from kvreuse.api.anthropic_protocol import MessagesRequest
    from kvreuse.api.cache_breakpoints import BreakpointPolicy

    doc = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": words(40, 1201)},
        "title": "Notes",
        "cache_control": {"type": "ephemeral"},
    }
    body = _body(messages=[{"role": "user", "content": [doc, {"type": "text", "text": "Sum it up."}]}])
    prompt = render_messages(async_engine.tokenizer, MessagesRequest.model_validate(body), BreakpointPolicy())
    ((start, end, priority, duration_ms),) = [
        (r.token_start, r.token_end, r.priority, r.duration_ms) for r in prompt.plan.ranges
    ]
    assert (start, priority, duration_ms) == (0, 50, 300_000)
    layout = prompt.documents.layout()
    pieces = [len(p) for p, pos in zip(layout.documents, layout.document_positions) if pos < end]
    expected = sum(-(-n // BLOCK_SIZE) for n in pieces)

    def by_priority(engine):
        return dict(engine.pool.blocks_by_priority())

    before = async_engine.call_blocking(by_priority)
    assert client.post("/v1/messages", json=body).status_code == 200
    after = async_engine.call_blocking(by_priority)
    assert after.get(50, 0) - before.get(50, 0) == expected
    async_engine.call_blocking(lambda engine: engine.check_integrity())
