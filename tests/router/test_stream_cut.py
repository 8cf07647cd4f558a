"""With migration off (``--migration-limit 0``), a stream whose executor fails mid-response
ends with an OpenAI-style error event that the official client raises, never as a silent
200 without ``[DONE]``, and whole streams pass through byte for byte. The executor is an
in-process transport; the client is ``openai.AsyncOpenAI`` over the router app (ASGI).
(Migration itself: test_migration.py.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvreuse.router.app import build_router_app
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router


def _event(text: str) -> bytes:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


class _Body(httpx.AsyncByteStream):
    """Sends ``chunks``, then breaks the connection (``ReadError``) if ``breaks``."""

    def __init__(self, chunks: list[bytes], breaks: bool) -> None:
        self.chunks, self.breaks = chunks, breaks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.ReadError("connection reset by peer")


def _stream(chunks: list[bytes], *, breaks: bool):
    """What the official client and a raw reader see of one routed streamed completion."""

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(chunks, breaks))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as upstream:
            router = Router(
                [Executor("http://a", healthy=True)],
                PromptHasher(None, HashSettings("m", 4, "sha256")),
                make_policy("kv"),
                client=upstream,
                seed=0,
                migration_limit=0,
            )
            app = build_router_app(router)
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
            raw = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "stream": True})
            marked_down = not router.executors["http://a"].healthy
            router.executors["http://a"].healthy = True  # as the health loop would, for the client's turn
            client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="none", http_client=http, max_retries=0)
            texts, error = [], None
            try:
                async for chunk in await client.completions.create(
                    model="tiny", prompt=[1, 2, 3], max_tokens=8, stream=True
                ):
                    texts.append(chunk.choices[0].text)
            except openai.APIError as exc:
                error = exc
            await http.aclose()
            return raw, texts, error, router, marked_down

    return asyncio.run(scenario())


@pytest.mark.parametrize("breaks", [True, False], ids=["connection_breaks", "closes_without_done"])
def test_a_stream_cut_mid_response_ends_with_an_error_event_the_client_raises(breaks):
    half = _event("never")[:25]  # an event cut in the middle is dropped, never half-sent
    raw, texts, error, router, marked_down = _stream([_event("Hello"), _event(" wor") + half], breaks=breaks)
    failure = "the connection broke (ReadError)" if breaks else "it closed the stream before [DONE]"
    message = (
        f"the executor serving this stream (executor 0) failed mid-response: {failure}; it could not be "
        "continued on another executor: migration is off (--migration-limit 0); the output is incomplete"
    )
    error_event = {"error": {"message": message, "type": "server_error", "param": None, "code": "executor_failed"}}
    assert raw.status_code == 200  # headers went out with the first chunk
    assert (
        raw.content
        == _event("Hello") + _event(" wor") + f"data: {json.dumps(error_event, separators=(',', ':'))}\n\n".encode()
    )
    assert texts == ["Hello", " wor"]
    assert isinstance(error, openai.APIError) and error.message == message
    assert error.body == error_event["error"]
    assert router.metrics.streams_cut._value.get() == 2  # the raw read and the client's
    assert marked_down is breaks  # a broken connection marks the executor down at once
    assert router.executors["http://a"].in_flight == 0


def test_a_whole_stream_passes_through_byte_for_byte():
    chunks = [_event("Hel"), _event("lo")[:10], _event("lo")[10:] + b"data: [DONE]\n\n"]
    raw, texts, error, router, marked_down = _stream(chunks, breaks=False)
    assert raw.content == b"".join(chunks)
    assert (texts, error) == (["Hel", "lo"], None)
    assert router.metrics.streams_cut._value.get() == 0 and not marked_down
