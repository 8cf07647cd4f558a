"""Forward one OpenAI request to the executor the router picks, retrying on another
executor while the client has received nothing, and continuing a stream elsewhere when its
executor fails after that.

A request is retried (on an executor it has not tried) when the connection is refused or
breaks, or the executor answers 502/503/504 or a 500 that is not the request's own fault
(``upstream.executor_fault``; a 4xx is the request's error and goes straight to the
client), *before the first byte reaches the client*
(``kvreuse.router.upstream.send``): a non-streamed response is read whole before it is
returned, so an executor dying while it computes one costs a retry, never the request; a
streamed one is returned once its first chunk has arrived, and relayed event by event from
then on.

A stream that breaks after that (the connection drops, it closes without
``data: [DONE]``, or it sends no byte for ``--upstream-progress-timeout`` or for a second
after its executor is marked down: ``kvreuse.router.deadline``) is continued on another
executor from what the client has (``kvreuse.router.migration``, up to ``Router.migration_limit`` executors). With
``--migration-limit 0``, or when it cannot be continued, it ends with the whole events
received so far, then one OpenAI-style error event, ``data: {"error": {"message": ...,
"code": "executor_failed"}}``, which the official client raises as an ``APIError``; the
half-received event is dropped, so everything the client parses is whole. A stream the
router would not continue (the limit at 0, or a request it does not continue, such as
``n`` > 1) passes through untouched. An executor that refuses or drops a
connection is marked down at once; the health loop brings it back.

While a stream waits for its first byte past ``--stream-keepalive-interval``, its response
starts (a 200 event stream) and the client gets keep-alive comments until the byte comes
(``kvreuse.router.keepalive``); what the request answers instead then ends the stream as an
error event.

A client that disconnects while the router waits for the executor (the whole response
of a non-streamed request, the first chunk of a streamed one) is noticed: the upstream
request is closed, which makes the executor abort it and free its blocks, and nothing is
retried. After the first chunk the streaming response closes the upstream stream itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvreuse.api.body import parse_json_body
from kvreuse.api.connection import client_disconnected  # the executor's own watcher
from kvreuse.api.errors import APIError, error_response
from kvreuse.router.affinity import prompt_cache_key
from kvreuse.router.deadline import Stalled
from kvreuse.router.keepalive import Waiting, kept_alive
from kvreuse.router.migration import MIGRATION_OFF, migrating_stream, stream_error_event
from kvreuse.router.prompt_keys import RequestKeys
from kvreuse.router.router import Router
from kvreuse.router.sse import SSE_DONE, EventSplitter, encode, error_event, payload
from kvreuse.router.stream_request import StreamRequest
from kvreuse.router.tenant_usage import UsageTap
from kvreuse.router.upstream import EXECUTOR_HEADER, ClientGone, Retry, Upstream, send

logger = logging.getLogger(__name__)

_FORWARD_HEADERS = ("content-type", "authorization", "accept")
CLIENT_CLOSED = 499  # the status logged for a request whose client left first (nginx's)

__all__ = ["CLIENT_CLOSED", "EXECUTOR_HEADER", "error", "first_byte", "forward", "stream_error_event"]


def error(message: str, status: int, type_: str = "service_unavailable") -> JSONResponse:
    return error_response(message, status=status, type=type_)


async def forward(
    router: Router,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    *,
    chat: bool,
    request: Request | None = None,
    body: Any = None,
    keys: RequestKeys | None = None,
    usage: UsageTap | None = None,
) -> Response:
    """The executor's response to ``raw`` (a completions or chat body), or a 503 when no
    executor could take it. Records routing metrics on ``router``. ``request`` is the
    client's (its body already read): if its client disconnects before the response (or a
    stream's first chunk) arrives, the upstream request is closed and a 499 is returned
    (to nobody); without it, disconnects are not watched. ``body``: ``raw``'s JSON value,
    when the caller has parsed it (else ``raw`` is parsed here, once). ``keys``: the body's,
    when the caller has them (else ``raw`` is hashed here). ``usage`` reads the response's usage for
    the tenant's limits (``kvreuse.router.tenant_usage``): of a migrated stream, the whole
    reply's."""
    gone = asyncio.ensure_future(client_disconnected(request)) if request is not None else None
    try:
        return await _forward(router, path, raw, headers, chat=chat, gone=gone, body=body, keys=keys, usage=usage)
    finally:
        if gone is not None:
            gone.cancel()  # a streamed response watches the client itself from here


async def _forward(
    router: Router,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    *,
    chat: bool,
    gone: asyncio.Future | None,
    body: Any,
    keys: RequestKeys | None,
    usage: UsageTap | None,
) -> Response:
    if body is None:
        try:
            body = parse_json_body(raw)
        except APIError as exc:
            return exc.response()  # the executor's 400 for this body, without tokenizing or sending it
    if keys is None:
        # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
        keys = await asyncio.to_thread(router.hasher.request_keys, chat, body if isinstance(body, dict) else {})
    stream = StreamRequest.of(chat, body)
    refusal = None if stream is None else _refusal(router, stream)
    upstream_raw = stream.upstream_body() if stream is not None and refusal is None else raw
    fwd = {k: v for k, v in headers.items() if k.lower() in _FORWARD_HEADERS}
    tried: list[str] = []
    affinity = prompt_cache_key(body)
    attempts = first_byte(router, path, upstream_raw, fwd, keys, affinity, tried, gone, stream=stream is not None)
    if stream is None:
        result = await attempts
    else:
        every_s = router.deadlines.keepalive_s
        waiting = Waiting(attempts, every_s, orphan=_close)
        if not await waiting.ready(every_s):  # no first byte yet: start the stream, keep-alives until it comes

            async def then(late: Response | Upstream) -> AsyncGenerator[bytes, None]:
                # its status (200) is sent already: what the request answered instead (an
                # executor's 4xx, the 503 when no executor could take it) ends it as an error event
                if isinstance(late, Upstream):
                    async with aclosing(_events(router, late, stream, refusal, keys, path, fwd, tried)) as events:
                        async for data in events:
                            yield data
                    return
                if usage is not None:
                    usage.response(late.status_code, bytes(late.body))
                yield _answer_event(late)

            events = kept_alive(waiting, then)
            if usage is not None:
                events = _tapped(events, usage)
            return StreamingResponse(events, status_code=200, headers={"content-type": "text/event-stream"})
        result = waiting.result()
    if not isinstance(result, Upstream):
        if usage is not None:
            usage.response(result.status_code, bytes(result.body))
        return result
    headers_out = {"content-type": result.content_type, EXECUTOR_HEADER: result.executor.url}
    events = _events(router, result, stream, refusal, keys, path, fwd, tried)
    if usage is not None:
        events = _tapped(events, usage)
    return StreamingResponse(events, status_code=result.status_code, headers=headers_out)


async def first_byte(
    router: Router,
    path: str,
    raw: bytes,
    fwd: dict[str, str],
    keys: RequestKeys,
    affinity: str | None,
    tried: list[str],
    gone: asyncio.Future | None,
    *,
    stream: bool,
) -> Response | Upstream:
    """The first executor's answer to ``raw`` that is not a failure before its first byte
    (``upstream.send``), trying executors not in ``tried`` (each failed one is added), or
    the response the client gets instead: the last executor's own error, the 503 when none
    could take it, the 499 when the client left (``gone``). ``affinity``: the request's
    ``prompt_cache_key``."""
    last_error = "no healthy executor"
    last_answer: Response | None = None  # the last executor's own error, when it answered one
    while True:
        routed = router.decide(keys, exclude=tried, affinity_key=affinity)
        if routed is None:
            if last_answer is not None:
                return last_answer  # every executor failed it: the client gets the executor's words
            return error(f"no executor could serve the request ({last_error}); tried {router.labels(tried)}", 503)
        executor = router.executors[routed.decision.choice]
        blocks = router.prompt_blocks(keys)
        executor.begin(blocks)
        router.metrics.decision(routed.decision, routed.candidates)
        try:
            return await send(
                router.client, executor, path, raw, fwd, blocks, gone, stream=stream, deadlines=router.deadlines
            )
        except ClientGone:
            executor.end(blocks)
            logger.info("client left before %s answered; its request there was closed", executor.url)
            return error("the client disconnected before the response", CLIENT_CLOSED, "client_disconnected")
        except Retry as exc:
            router.count_retry(executor, blocks)
            tried.append(executor.name)
            last_error, last_answer = str(exc), exc.response
            logger.info("retrying a request after %s failed before its first byte: %s", executor.url, exc)
        except BaseException:  # cancelled: the client left while it was sent keep-alives
            executor.end(blocks)
            raise


def _events(
    router: Router,
    upstream: Upstream,
    stream: StreamRequest | None,
    refusal: tuple[str, str] | None,
    keys: RequestKeys,
    path: str,
    fwd: dict[str, str],
    tried: list[str],
) -> AsyncGenerator[bytes, None]:
    """The client's events of ``upstream``: continued elsewhere if it fails, unless
    ``refusal`` (or the request did not ask for a stream: passed through)."""
    if stream is not None and refusal is None:
        return migrating_stream(router, upstream, stream, keys, path, fwd, tried)
    return _relay(router, upstream, refusal)


def _answer_event(response: Response) -> bytes:
    """``response`` (an error the router or an executor answered) as an SSE error event."""
    content = bytes(response.body)
    answer = payload(b"data: " + content + b"\n\n")
    if answer is not None and isinstance(answer.get("error"), dict):
        return encode(answer)
    return error_event(f"the request failed with status {response.status_code}: {content[:200]!r}")


async def _close(result: Response | Upstream) -> None:
    """A first answer that came when nobody waited for it any more."""
    if isinstance(result, Upstream):
        await result.close()


async def _tapped(events: AsyncGenerator[bytes, None], usage: UsageTap) -> AsyncGenerator[bytes, None]:
    """``events`` (whole SSE events) as ``usage`` leaves them, having read their usage."""
    async with aclosing(events) as stream:
        async for data in stream:
            data = usage.events(data)
            if data:
                yield data


def _refusal(router: Router, stream: StreamRequest) -> tuple[str, str] | None:
    """``(outcome, why)`` when no failure of this stream could be continued (it is then
    passed through untouched), else ``None``."""
    if router.migration_limit == 0:
        return "limit", MIGRATION_OFF
    why = stream.unsupported()
    return None if why is None else ("unsupported", why)


async def _relay(router: Router, upstream: Upstream, refusal: tuple[str, str] | None) -> AsyncGenerator[bytes, None]:
    """``upstream``'s bytes in whole events, untouched, then the error event if it fails
    (saying ``refusal``'s why: the stream is not one the router continues). It ends at
    ``[DONE]``: executors send nothing after it (``serving.sse``), so the response is
    finished and the upstream closed (the executor's place freed) without waiting for the
    executor to close the connection."""
    splitter = EventSplitter()
    done = False
    try:
        async with aclosing(upstream.chunks()) as chunks:
            async for chunk in chunks:
                events = splitter.feed(chunk)
                if events:
                    done = SSE_DONE in events
                    yield b"".join(events)  # all of the chunk's whole events: [DONE] is the last one sent
                    if done:
                        break
        failure = None if done else "it closed the stream before [DONE]"
    except httpx.TransportError as exc:
        failure = f"the connection broke ({type(exc).__name__})"
        upstream.executor.mark_down(f"stream broke mid-response: {exc!r}")
    except Stalled as exc:  # hung or down: ended, never held
        failure = str(exc)
    finally:
        await upstream.close()
    if failure is not None:
        logger.warning("stream from %s cut mid-response: %s", upstream.executor.url, failure)
        router.metrics.streams_cut.inc()
        if refusal is not None:
            router.metrics.migration(refusal[0])
        yield stream_error_event(upstream.executor.label, failure, None if refusal is None else refusal[1])
