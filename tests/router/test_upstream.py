"""``upstream.executor_fault``: what an executor fails for reasons other than the request
(and a stream that stalls: ``deadline``) is retried or continued elsewhere; what the
request caused goes straight to the client. Every executor is the one real executor app
(tiny random Llama, test_migration.py's), reached over a transport that makes chosen
responses fail: a stream that stalls after some events (a hung executor), a stream whose
executor sends an engine error event, a 500 or a 400 before any byte."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from kvreuse.router.deadline import Deadlines

from .test_migration import (
    CHAT,
    COMPLETION,
    _counts,
    _events,
    _Executors,
    _post,
    _reply,
    _scenario,
    executor_app,  # noqa: F401 - the module's fixture
)

ENGINE_ERROR = {
    "error": {
        "message": "engine step failed: RuntimeError('boom')",
        "type": "internal_server_error",
        "param": None,
        "code": None,
    }
}
REQUEST_ERROR = {
    "error": {"message": "top_p: must be > 0", "type": "invalid_request_error", "param": "top_p", "code": None}
}


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class _Body(httpx.AsyncByteStream):
    def __init__(self, data: bytes, *, stall: bool) -> None:
        self.data, self.stall = data, stall

    async def __aiter__(self):
        yield self.data
        if self.stall:
            await asyncio.Event().wait()  # a hung executor: the socket stays open, nothing comes


class _Faulting(_Executors):
    """``cuts`` holds ``(kind, n)`` for each response in turn (``None``: whole): ``stall``
    after ``n`` events, an engine ``error`` event after ``n`` events, or a ``500`` / ``400``
    (``n`` unused) before any byte."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        routed = request.method == "POST" and request.url.path.endswith("completions")
        fault = self.cuts.pop(0) if self.cuts and routed else None
        if fault is not None and fault[0] in ("500", "400"):
            self.streams.append((f"http://{request.url.host}", request.url.path, json.loads(request.content)))
            return httpx.Response(int(fault[0]), json=ENGINE_ERROR if fault[0] == "500" else REQUEST_ERROR)
        response = await self.inner.handle_async_request(request)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return response
        self.streams.append((f"http://{request.url.host}", request.url.path, json.loads(request.content)))
        if fault is None:
            return response
        kind, n = fault
        events = (await response.aread()).split(b"\n\n")
        kept = b"".join(e + b"\n\n" for e in events[:n])
        if kind == "stall":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(kept, stall=True))
        error = ENGINE_ERROR if kind == "error" else REQUEST_ERROR
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_Body(kept + _sse(error) + b"data: [DONE]\n\n", stall=False),
        )


def _reference(app, body, path, chat):
    _scenario(app, _post(body, path))  # the prompt is cached from here on: cached_tokens agree
    return _reply(_events(_scenario(app, _post(body, path))[0]), chat)


def test_a_stream_that_stalls_is_continued_at_the_deadline_to_the_uninterrupted_reply(executor_app):  # noqa: F811
    reference = _reference(executor_app, CHAT, "/v1/chat/completions", True)
    start = time.monotonic()
    raw, transport, router = _scenario(
        executor_app,
        _post(CHAT, "/v1/chat/completions"),
        cuts=[("stall", 4)],
        transport_type=_Faulting,
        deadlines=Deadlines(60.0, 0.5),
    )
    assert time.monotonic() - start >= 0.5
    assert _reply(_events(raw), True) == reference
    assert _counts(router) == {"continued": 1.0}
    (first, *_), (second, second_path, _) = transport.streams
    assert second != first and second_path == "/v1/completions"
    assert not router.executors[first].healthy and "--upstream-progress-timeout" in router.executors[first].last_error
    assert all(e.in_flight == 0 for e in router.executors.values())


def test_an_engine_error_event_mid_stream_is_continued_to_the_uninterrupted_reply(executor_app):  # noqa: F811
    reference = _reference(executor_app, COMPLETION, "/v1/completions", False)
    for n in (0, 3):  # before any event (the request again) and mid-reply (a continuation)
        raw, transport, router = _scenario(
            executor_app, _post(COMPLETION, "/v1/completions"), cuts=[("error", n)], transport_type=_Faulting
        )
        assert _reply(_events(raw), False) == reference, n  # the engine's error never reaches the client
        assert _counts(router) == {"continued": 1.0}
        first = transport.streams[0][0]
        assert router.executors[first].healthy  # a failed step is not a dead executor


def test_an_error_event_the_request_caused_ends_the_stream_as_sent(executor_app):  # noqa: F811
    raw, transport, router = _scenario(
        executor_app, _post(COMPLETION, "/v1/completions"), cuts=[("request", 3)], transport_type=_Faulting
    )
    events = _events(raw)
    assert events[-2:] == [REQUEST_ERROR, "[DONE]"] and len(events) == 5
    assert len(transport.streams) == 1 and _counts(router) == {}


def test_an_engine_500_is_retried_and_a_400_is_passed_straight_through(executor_app):  # noqa: F811
    reference = _reference(executor_app, COMPLETION, "/v1/completions", False)
    raw, transport, router = _scenario(
        executor_app, _post(COMPLETION, "/v1/completions"), cuts=[("500", 0)], transport_type=_Faulting
    )
    assert _reply(_events(raw), False) == reference
    (first, *_), (second, *_) = transport.streams
    assert first == "http://a" and second != first and router.num_retries == 1
    assert router.executors["http://a"].healthy and router.executors["http://a"].failures == 1

    async def call(http, _client):
        r = await http.post("/v1/completions", json={**COMPLETION, "stream": False})
        return r.status_code, r.json()

    for faults, answer, asked in (
        ([("400", 0)], (400, REQUEST_ERROR), 1),  # the request's: not retried
        ([("500", 0)] * 4, (500, ENGINE_ERROR), 4),
    ):  # every executor's: the last one's words
        got, transport, router = _scenario(executor_app, call, cuts=faults, transport_type=_Faulting)
        assert got == answer and len(transport.streams) == asked
        assert router.num_retries == (0 if asked == 1 else 4)  # each executor's 500 counts
