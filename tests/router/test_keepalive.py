"""Keep-alive comments while a stream waits for a first byte (``kvreuse.router.keepalive``): the
official ``openai`` and ``anthropic`` clients, with a read timeout shorter than the wait, read
the whole stream through the router (served by uvicorn on a real socket), since they skip the
``: keep-alive`` comments; with the comments off their read timeout fires. Executors are
in-process transports that answer late where told."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from kvreuse.router.app import build_router_app
from kvreuse.router.deadline import Deadlines
from kvreuse.router.executors import Executor
from kvreuse.router.keepalive import KEEPALIVE
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router

from .cluster import free_port

LATE_S = 3.0  # how long an executor waits before its first byte
READ_TIMEOUT_S = 1.5  # the clients' read timeout: shorter than that wait
EVERY_S = 0.1  # --stream-keepalive-interval: far shorter
SSE = {"content-type": "text/event-stream"}


def _event(text: str) -> bytes:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


COMPLETION = _event("Hello") + _event(" world") + b"data: [DONE]\n\n"


def _anthropic_stream() -> bytes:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 0},
    }
    events = [
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


class _Body(httpx.AsyncByteStream):
    """``chunks`` after ``delay_s``; then (``breaks``) a broken connection."""

    def __init__(self, chunks: list[bytes], delay_s: float = 0.0, *, breaks: bool = False) -> None:
        self.chunks, self.delay_s, self.breaks = chunks, delay_s, breaks

    async def __aiter__(self):
        await asyncio.sleep(self.delay_s)
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.ReadError("connection reset by peer")


@contextlib.asynccontextmanager
async def _served(handler, names, every_s, *, migration_limit=0):
    """The router app over executors ``names`` (answered by ``handler``), served by uvicorn."""
    import uvicorn

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as upstream:
        router = Router(
            [Executor(n, healthy=True) for n in names],
            PromptHasher(None, HashSettings("m", 4, "sha256")),
            make_policy("round_robin"),
            client=upstream,
            seed=0,
            migration_limit=migration_limit,
            deadlines=Deadlines.of(60.0, 60.0, every_s),
        )
        config = uvicorn.Config(
            build_router_app(router), host="127.0.0.1", port=free_port(), lifespan="off", log_level="warning"
        )
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            yield f"http://127.0.0.1:{config.port}", router
        finally:
            server.should_exit = True
            await task


def _openai(base: str):
    import openai

    return openai.AsyncOpenAI(
        base_url=base + "/v1", api_key="none", max_retries=0, timeout=openai.Timeout(10.0, read=READ_TIMEOUT_S)
    )


async def _texts(stream) -> list[str]:
    return [c.choices[0].text async for c in stream]


def _late_completion(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers=SSE, stream=_Body([COMPLETION], LATE_S))


@pytest.mark.parametrize("every_s", [EVERY_S, 0.0])
def test_the_openai_client_reads_a_stream_whose_first_byte_is_late(every_s):
    import openai

    async def scenario():
        async with _served(_late_completion, ["http://a"], every_s) as (base, router):
            client = _openai(base)
            try:
                got = await _texts(await client.completions.create(model="tiny", prompt=[1, 2, 3], stream=True))
            except openai.APITimeoutError:
                got = "read timeout"
            await client.close()
            async with httpx.AsyncClient(timeout=30) as raw:
                body = (await raw.post(base + "/v1/completions", json={"prompt": [1, 2, 3], "stream": True})).content
            return got, body, router

    got, body, router = asyncio.run(scenario())
    beats = (len(body) - len(COMPLETION)) // len(KEEPALIVE)
    if every_s:
        assert got == ["Hello", " world"]
        assert beats >= 1 and body == KEEPALIVE * beats + COMPLETION  # comments first, then the events untouched
    else:
        assert got == "read timeout"  # the silent wait the comments exist for
        assert body == COMPLETION
    a = router.executors["http://a"]
    assert (a.in_flight, a.healthy) == (0, True)


def test_a_continuation_waiting_for_its_new_executor_sends_keepalives():
    # a sends half an event, then its connection breaks; the client has no event yet, so the
    # request is sent again to b, which answers late: the client hears comments meanwhile
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(200, headers=SSE, stream=_Body([b'data: {"id":"cm'], breaks=True))
        return _late_completion(request)

    async def scenario():
        async with _served(handler, ["http://a", "http://b"], EVERY_S, migration_limit=1) as (base, router):
            client = _openai(base)
            got = await _texts(await client.completions.create(model="tiny", prompt=[1, 2, 3], stream=True))
            await client.close()
            return got, router

    got, router = asyncio.run(scenario())
    assert got == ["Hello", " world"]
    assert router.metrics.migrations.labels(outcome="continued")._value.get() == 1
    assert [e.in_flight for e in router.executors.values()] == [0, 0]


def test_an_error_answered_after_the_keepalives_began_ends_the_stream_as_an_error_event():
    import openai

    message = "prompt is too long for this executor"

    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(LATE_S)
        return httpx.Response(400, json={"error": {"message": message, "type": "invalid_request_error"}})

    async def scenario():
        async with _served(handler, ["http://a"], EVERY_S) as (base, router):
            client = _openai(base)
            try:
                await _texts(await client.completions.create(model="tiny", prompt=[1, 2, 3], stream=True))
            except openai.APIError as exc:
                return type(exc).__name__, exc.message, router
            finally:
                await client.close()

    name, said, router = asyncio.run(scenario())
    assert (name, said) == ("APIError", message)
    assert router.executors["http://a"].in_flight == 0


@pytest.mark.parametrize("every_s", [EVERY_S, 0.0])
def test_the_anthropic_client_reads_a_messages_stream_whose_first_byte_is_late(every_s):
    import anthropic

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=SSE, stream=_Body([_anthropic_stream()], LATE_S))

    async def scenario():
        async with _served(handler, ["http://a"], every_s) as (base, router):
            client = anthropic.AsyncAnthropic(
                base_url=base, api_key="none", max_retries=0, timeout=anthropic.Timeout(10.0, read=READ_TIMEOUT_S)
            )
            try:
                stream = await client.messages.create(
                    model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}], stream=True
                )
                got = [e.type async for e in stream]
            except anthropic.APITimeoutError:
                got = "read timeout"
            await client.close()
            return got, router

    got, router = asyncio.run(scenario())
    if every_s:
        assert got == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    else:
        assert got == "read timeout"
    assert router.executors["http://a"].in_flight == 0


def test_a_client_that_leaves_during_the_keepalives_has_its_upstream_request_closed():
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        try:
            await asyncio.Event().wait()  # no answer, ever
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def scenario():
        async with _served(handler, ["http://a"], EVERY_S) as (base, router):
            async with httpx.AsyncClient(timeout=10) as client:
                body = {"prompt": [1, 2, 3], "stream": True}
                async with client.stream("POST", base + "/v1/completions", json=body) as r:
                    first = await anext(r.aiter_raw())
            a = router.executors["http://a"]
            for _ in range(200):  # the router notices at its next comment
                if a.in_flight == 0 and seen:
                    break
                await asyncio.sleep(0.05)
            return r.status_code, first, seen, a

    status, first, seen, a = asyncio.run(scenario())
    assert (status, first) == (200, KEEPALIVE)
    assert seen == ["cancelled"]  # the request to the executor was closed
    assert (a.in_flight, a.in_flight_blocks, a.healthy) == (0, 0, True)


def test_the_interval_flag_defaults_to_5_s_and_0_turns_the_comments_off():
    from kvreuse.router.keepalive import DEFAULT_KEEPALIVE_S

    assert DEFAULT_KEEPALIVE_S == 5.0 and Deadlines().keepalive_s == 5.0
    assert Deadlines.of(300.0, 10.0).keepalive_s == 5.0
    assert Deadlines.of(300.0, 10.0, 0.5).keepalive_s == 0.5
    assert Deadlines.of(300.0, 10.0, 0.0).keepalive_s is None
    with pytest.raises(
        ValueError,
        match=r"^--stream-keepalive-interval must be a finite number of seconds >= 0 \(0: no comments\), got -1",
    ):
        Deadlines.of(300.0, 10.0, -1.0)


def test_a_body_closed_before_it_took_the_result_hands_it_to_orphan():
    # the client leaves at the first comment; the wait's answer (an upstream stream, say) is
    # then nobody's: it goes to ``orphan`` (which closes it), and a wait still running is cancelled
    from kvreuse.router.keepalive import Waiting, kept_alive

    async def answer(delay_s: float) -> str:
        await asyncio.sleep(delay_s)
        return "upstream"

    async def never(result: str):
        yield b"never sent"

    async def scenario():
        orphans: list[str] = []

        async def orphan(result: str) -> None:
            orphans.append(result)

        done = Waiting(answer(0.0), 0.05, orphan=orphan)
        await asyncio.sleep(0.01)  # its answer is in
        body = kept_alive(done, never)
        first = await anext(body)
        await body.aclose()
        running = Waiting(answer(60.0), 0.05, orphan=orphan)
        body = kept_alive(running, never)
        await anext(body)
        await anext(body)  # the second comment, from the wait's beats
        await body.aclose()
        return first, orphans, running.task.cancelled()

    assert asyncio.run(scenario()) == (KEEPALIVE, ["upstream"], True)
