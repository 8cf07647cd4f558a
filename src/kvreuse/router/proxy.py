"""Forward one OpenAI request to the executor the router picks, retrying on another
executor while the client has received nothing.

A request is retried (on an executor it has not tried) when the connection is refused or
breaks, or the executor answers 502/503/504, *before the first byte reaches the client*:
a non-streamed response is read whole before it is returned; a streamed one is returned
once its first chunk has arrived, and passed through untouched from then on (a break
after that ends the stream: tokens already sent cannot be unsent). An executor that
refuses or drops a connection is marked down at once; the health loop brings it back.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvreuse.router.executors import Executor
from kvreuse.router.router import Router

logger = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({502, 503, 504})
_FORWARD_HEADERS = ("content-type", "authorization", "accept")
EXECUTOR_HEADER = "x-kvreuse-executor"  # which executor served the response


def error(message: str, status: int, type_: str = "service_unavailable") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": None}}, status_code=status)


async def forward(router: Router, path: str, raw: bytes, headers: dict[str, str], *, chat: bool) -> Response:
    """The executor's response to ``raw`` (a completions or chat body), or a 503 when no
    executor could take it. Records routing metrics on ``router``."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None  # the executor will answer it with its own 400; route it by load
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
            response = await _send(router, executor, path, raw, fwd, blocks)
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
                blocks: int) -> Response:
    client = router.client
    request = client.build_request("POST", executor.url + path, content=raw, headers=headers,
                                   timeout=httpx.Timeout(10.0, read=None))
    try:
        resp = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        executor.mark_down(f"connection failed: {exc!r}")
        raise _Retry(repr(exc)) from None
    if resp.status_code in _RETRY_STATUS:
        await resp.aclose()
        raise _Retry(f"{executor.url} answered {resp.status_code}")
    out_headers = {"content-type": resp.headers.get("content-type", "application/json"), EXECUTOR_HEADER: executor.url}
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            content = await resp.aread()
        except httpx.TransportError as exc:
            executor.mark_down(f"connection broke: {exc!r}")
            raise _Retry(repr(exc)) from None
        finally:
            await resp.aclose()
        executor.end(blocks)
        return Response(content, status_code=resp.status_code, headers=out_headers)
    chunks = resp.aiter_raw()
    try:
        first = await anext(chunks)
    except (httpx.TransportError, StopAsyncIteration) as exc:
        await resp.aclose()
        executor.mark_down(f"stream broke before its first byte: {exc!r}")
        raise _Retry(repr(exc)) from None

    async def relay() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            logger.warning("stream from %s broke mid-response: %r", executor.url, exc)
        finally:
            await resp.aclose()
            executor.end(blocks)

    return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)
