"""Forward one OpenAI request to the executor the router picks, retrying on another
executor while the client has received nothing.

A request is retried (on an executor it has not tried) when the connection is refused or
breaks, or the executor answers 502/503/504, *before the first byte reaches the client*:
a non-streamed response is read whole before it is returned; a streamed one is returned
once its first chunk has arrived, and passed through event by event from then on.

A stream that breaks after that (the connection drops, or it closes without ``data: [DONE]``)
is never cut silently: the client gets the whole events received so far, then one
OpenAI-style error event, ``data: {"error": {"message": ..., "code": "executor_failed"}}``,
which the official client raises as an ``APIError``; the half-received event is dropped,
so everything the client parses is whole. Tokens already sent cannot be unsent. An
executor that refuses or drops a connection is marked down at once; the health loop
brings it back.

A client that disconnects while the router waits for the executor (the whole response
of a non-streamed request, the first chunk of a streamed one) is noticed: the upstream
request is closed, which makes the executor abort it and free its blocks, and nothing is
retried. After the first chunk the streaming response closes the upstream stream itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvreuse.api.connection import client_disconnected  # the executor's own watcher
from kvreuse.api.body import parse_json_body
from kvreuse.api.errors import APIError, error_response
from kvreuse.router.executors import Executor
from kvreuse.router.prompt_keys import RequestKeys
from kvreuse.router.router import Router
from kvreuse.router.tenant_usage import UsageTap

logger = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({502, 503, 504})
_FORWARD_HEADERS = ("content-type", "authorization", "accept")
EXECUTOR_HEADER = "x-kvreuse-executor"  # which executor served the response
CLIENT_CLOSED = 499  # the status logged for a request whose client left first (nginx's)

T = TypeVar("T")


def error(message: str, status: int, type_: str = "service_unavailable") -> JSONResponse:
    return error_response(message, status=status, type=type_)


async def forward(router: Router, path: str, raw: bytes, headers: dict[str, str], *, chat: bool,
                  request: Request | None = None, keys: RequestKeys | None = None,
                  usage: UsageTap | None = None) -> Response:
    """The executor's response to ``raw`` (a completions or chat body), or a 503 when no
    executor could take it. Records routing metrics on ``router``. ``request`` is the
    client's (its body already read): if its client disconnects before the response (or a
    stream's first chunk) arrives, the upstream request is closed and a 499 is returned
    (to nobody); without it, disconnects are not watched. ``keys``: the body's, when the
    caller has them (else ``raw`` is parsed and hashed here). ``usage`` reads the response's
    usage for the tenant's limits (``kvreuse.router.tenant_usage``)."""
    gone = asyncio.ensure_future(client_disconnected(request)) if request is not None else None
    try:
        return await _forward(router, path, raw, headers, chat=chat, gone=gone, keys=keys, usage=usage)
    finally:
        if gone is not None:
            gone.cancel()  # a streamed response watches the client itself from here


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _unless_gone(aw: Awaitable[T], gone: asyncio.Future | None) -> T:
    """``await aw``, unless ``gone`` completes first: then ``aw`` is cancelled (and waited
    for, so nothing still reads the upstream response when it is closed) and
    ``_ClientGone`` raised. A result that is ready wins over a disconnect, so a response
    returned here is never lost unclosed."""
    if gone is None:
        return await aw
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


async def _forward(router: Router, path: str, raw: bytes, headers: dict[str, str], *, chat: bool,
                   gone: asyncio.Future | None, keys: RequestKeys | None, usage: UsageTap | None) -> Response:
    if keys is None:
        try:
            body = parse_json_body(raw)
        except APIError as exc:
            return exc.response()  # the executor's 400 for this body, without tokenizing or sending it
        # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
        keys = await asyncio.to_thread(router.hasher.request_keys, chat, body if isinstance(body, dict) else {})
    fwd = {k: v for k, v in headers.items() if k.lower() in _FORWARD_HEADERS}
    tried: list[str] = []
    last_error = "no healthy executor"
    while True:
        routed = router.decide(keys, exclude=tried)
        if routed is None:
            return error(f"no executor could serve the request ({last_error}); tried {tried or 'none'}", 503)
        executor = router.executors[routed.decision.choice]
        blocks = router.prompt_blocks(keys)
        executor.begin(blocks)
        router.metrics.decision(routed)
        try:
            response = await _send(router, executor, path, raw, fwd, blocks, gone, usage)
        except _ClientGone:
            executor.end(blocks)
            logger.info("client left before %s answered; its request there was closed", executor.url)
            return error("the client disconnected before the response", CLIENT_CLOSED, "client_disconnected")
        except _Retry as exc:
            executor.end(blocks)
            executor.failures += 1
            tried.append(executor.name)
            last_error = str(exc)
            router.num_retries += 1
            router.metrics.retries.inc()
            logger.info("retrying a request after %s failed before its first byte: %s", executor.url, exc)
            continue
        return response


class _Retry(Exception):
    """The executor failed before the client got a byte."""


async def _send(router: Router, executor: Executor, path: str, raw: bytes, headers: dict[str, str],
                blocks: int, gone: asyncio.Future | None, usage: UsageTap | None) -> Response:
    """Raises ``_Retry`` (nothing reached the client; ``executor.end`` is the caller's) or
    ``_ClientGone`` (the upstream response is closed; ``executor.end`` is the caller's)."""
    client = router.client
    request = client.build_request("POST", executor.url + path, content=raw, headers=headers,
                                   timeout=httpx.Timeout(10.0, read=None))
    try:
        # A non-streamed response's headers come when it is complete: the wait is here.
        resp = await _unless_gone(client.send(request, stream=True), gone)
    except httpx.TransportError as exc:
        executor.mark_down(f"connection failed: {exc!r}")
        raise _Retry(repr(exc)) from None
    if resp.status_code in _RETRY_STATUS:
        await resp.aclose()
        raise _Retry(f"{executor.url} answered {resp.status_code}")
    out_headers = {"content-type": resp.headers.get("content-type", "application/json"), EXECUTOR_HEADER: executor.url}
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            content = await _unless_gone(resp.aread(), gone)
        except httpx.TransportError as exc:
            executor.mark_down(f"connection broke: {exc!r}")
            raise _Retry(repr(exc)) from None
        finally:
            await resp.aclose()
        executor.end(blocks)
        if usage is not None and resp.status_code == 200:
            usage.json_body(content)
        return Response(content, status_code=resp.status_code, headers=out_headers)
    chunks = resp.aiter_raw()
    try:
        first = await _unless_gone(anext(chunks), gone)
    except (httpx.TransportError, StopAsyncIteration) as exc:
        await resp.aclose()
        executor.mark_down(f"stream broke before its first byte: {exc!r}")
        raise _Retry(repr(exc)) from None
    except _ClientGone:
        await resp.aclose()
        raise

    async def relay() -> AsyncIterator[bytes]:
        pending = b""  # the part of the stream after its last whole event
        done = False
        try:
            async for chunk in _prepend(first, chunks):
                whole, sep, pending = (pending + chunk).rpartition(SSE_SEPARATOR)
                if sep:
                    done = (whole + sep).endswith(SSE_DONE)
                    events = whole + sep if usage is None else usage.events(whole + sep)
                    if events:
                        yield events
            failure = None if done else "it closed the stream before [DONE]"
        except httpx.TransportError as exc:
            failure = f"the connection broke ({type(exc).__name__})"
            executor.mark_down(f"stream broke mid-response: {exc!r}")
        finally:
            await resp.aclose()
            executor.end(blocks)
        if failure is not None:
            logger.warning("stream from %s cut mid-response: %s", executor.url, failure)
            router.metrics.streams_cut.inc()
            yield stream_error_event(executor.url, failure)

    return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)


SSE_SEPARATOR = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


def stream_error_event(executor_url: str, failure: str) -> bytes:
    """The SSE event that ends a stream whose executor failed mid-response."""
    message = (f"the executor serving this stream ({executor_url}) failed mid-response: {failure}; "
               "the output is incomplete")
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "executor_failed"}}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
