"""One request sent to one executor, up to its first byte: the whole response of a
non-streamed request, or a streamed one whose first chunk has arrived (``Upstream``).

``send`` raises ``Retry`` when nothing reached the client yet and another executor may
take the request (the connection is refused or breaks, the executor answers 502/503/504 or
a 500 that is not the request's fault (``executor_fault``), a stream ends before its first
byte, or a wait passes its deadline: ``kvreuse.router.deadline``); an executor that refuses
or drops a connection, or misses a deadline, is marked down at once. It raises
``ClientGone`` when the client disconnects first: the upstream request is closed, which
makes the executor abort it and free its blocks.

After the first chunk, ``Upstream.chunks`` waits at most the progress deadline for each
next one (and ends the wait once its executor is marked down and silent): it raises
``Stalled`` then, and the caller continues the stream elsewhere or ends it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import anyio
import httpx
from fastapi.responses import Response

from kvreuse.router.deadline import (
    DEFAULT_DEADLINES,
    FIRST_BYTE_SETTING,
    PROGRESS_SETTING,
    Deadlines,
    ReadClock,
    Stalled,
    within,
)
from kvreuse.router.executors import Executor
from kvreuse.router.sse import EventSplitter, payload

RETRY_STATUS = frozenset({502, 503, 504})
EXECUTOR_HEADER = "x-kvreuse-executor"  # which executor served the response
# an executor's 500 or error event with this code failed because of the request itself: passed through
REQUEST_FAULT_CODE = "request_failed"
_ERROR_EVENT = b'data: {"error"'  # how an executor's error event starts (serving.sse)

T = TypeVar("T")


class Retry(Exception):
    """The executor failed before the client got a byte of its response. ``response``: what
    it answered, if it answered (the client gets it when no executor is left to try)."""

    def __init__(self, message: str, response: Response | None = None) -> None:
        super().__init__(message)
        self.response = response


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class ExecutorFault(Exception):
    """A stream's executor sent an error event that is not the request's fault
    (``executor_fault``): its words are the message."""


def executor_fault(status: int, error: object) -> bool:
    """Whether an executor's error is its own and not the request's, so another executor
    may take the request: ``status`` is its response's (200 for a stream's error event),
    ``error`` the OpenAI ``error`` object of its body or event. 502/503/504 always; a 500 or
    an error event unless its ``type`` is ``invalid_request_error`` or its ``code`` is
    ``REQUEST_FAULT_CODE`` (the executor's word that the request itself failed); any other
    status (4xx: the request's error) never."""
    if status in RETRY_STATUS:
        return True
    if status not in (200, 500):
        return False
    if not isinstance(error, dict):
        return status == 500
    return error.get("type") != "invalid_request_error" and error.get("code") != REQUEST_FAULT_CODE


def fault_of_event(event: bytes) -> str | None:
    """The message of ``event`` when it is an executor's error event that is not the
    request's fault (``executor_fault``), else ``None``."""
    if not event.startswith(_ERROR_EVENT):
        return None
    error = (payload(event) or {}).get("error")
    if not executor_fault(200, error):
        return None
    return str(error.get("message") if isinstance(error, dict) else error)


async def unless_gone(aw: Awaitable[T], gone: asyncio.Future | None) -> T:
    """``await aw``, unless ``gone`` completes first: then ``aw`` is cancelled (and waited
    for, so nothing still reads the upstream response when it is closed) and
    ``ClientGone`` raised. A result that is ready wins over a disconnect, so a response
    returned here is never lost unclosed. A ``gone`` cancelled is a watch that ended (the
    client's response started, ``kvreuse.router.keepalive``), not a disconnect: ``aw`` is
    then awaited alone."""
    if gone is None:
        return await aw
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and gone.cancelled():
            await asyncio.wait({task})
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class Upstream:
    """A streamed response whose first chunk has arrived; it holds ``executor.begin``'s
    place until ``close`` (idempotent), which also closes the connection."""

    def __init__(
        self,
        executor: Executor,
        resp: httpx.Response,
        first: bytes,
        rest: AsyncIterator[bytes],
        blocks: int,
        deadlines: Deadlines = DEFAULT_DEADLINES,
    ) -> None:
        self.executor, self.resp, self.blocks = executor, resp, blocks
        self.status_code = resp.status_code
        self.content_type = resp.headers.get("content-type", "text/event-stream")
        self._first: bytes | None = first
        self._rest = rest
        self._clock = ReadClock(
            executor, limit_s=deadlines.progress_s, setting=PROGRESS_SETTING, grace_s=deadlines.down_grace_s
        )
        self._closed = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The raw bytes as they come (the first chunk included). Raises
        ``httpx.TransportError`` when the connection breaks, ``Stalled`` when no byte comes
        within the progress deadline or since the executor was marked down
        (``kvreuse.router.deadline``). A missed deadline marks the executor down only when
        none of its streams got a byte meanwhile: one that still streams is alive, and this
        request is waiting there (queued, preempted); marking it down would cut its other
        streams a grace later."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while True:
            began = time.monotonic()
            try:
                chunk = await self._clock.read(anext(self._rest), since=began)
            except StopAsyncIteration:
                return
            except Stalled as exc:
                if exc.timed_out and self.executor.last_byte_at < began:
                    self.executor.mark_down(f"a stream stalled: {exc}")
                raise
            self.executor.last_byte_at = time.monotonic()
            yield chunk

    async def events(self) -> AsyncIterator[bytes]:
        """Whole SSE events (``kvreuse.router.sse``); a half-received last one is dropped."""
        splitter = EventSplitter()
        async for chunk in self.chunks():
            for event in splitter.feed(chunk):
                yield event

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._clock.close()
            await self.resp.aclose()
            self.executor.end(self.blocks)


async def send(
    client: httpx.AsyncClient,
    executor: Executor,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    blocks: int,
    gone: asyncio.Future | None,
    *,
    stream: bool = True,
    deadlines: Deadlines = DEFAULT_DEADLINES,
) -> Response | Upstream:
    """``executor``'s response to ``raw`` at ``path``. Raises ``Retry`` or ``ClientGone``
    (``executor.end`` is then the caller's); a returned ``Response`` has ended its place,
    an ``Upstream`` ends it when closed. ``stream``: ``raw`` asks for a stream, so its
    first byte has ``deadlines.first_byte_s`` (a non-streamed reply has no deadline, only
    its executor's health)."""
    request = client.build_request(
        "POST", executor.url + path, content=raw, headers=headers, timeout=httpx.Timeout(10.0, read=None)
    )
    start = time.monotonic()

    def watched(aw: Awaitable[T]) -> Awaitable[T]:
        return unless_gone(
            within(
                aw,
                executor,
                since=start,
                limit_s=deadlines.first_byte_s if stream else None,
                setting=FIRST_BYTE_SETTING,
                grace_s=deadlines.down_grace_s,
            ),
            gone,
        )

    try:
        # A non-streamed response's headers come when it is complete: the wait is here.
        resp = await watched(client.send(request, stream=True))
    except httpx.TransportError as exc:
        executor.mark_down(f"connection failed: {exc!r}")
        raise Retry(executor.scrub(repr(exc))) from None
    except Stalled as exc:
        raise _stalled(executor, exc) from None
    if resp.status_code in RETRY_STATUS:
        await resp.aclose()
        raise Retry(f"{executor.label} answered {resp.status_code}")
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            content = await watched(resp.aread())
        except httpx.TransportError as exc:
            executor.mark_down(f"connection broke: {exc!r}")
            raise Retry(executor.scrub(repr(exc))) from None
        except Stalled as exc:
            raise _stalled(executor, exc) from None
        finally:
            await resp.aclose()
        if resp.status_code >= 500:
            error = (payload(b"data: " + content + b"\n\n") or {}).get("error")
            if executor_fault(resp.status_code, error):
                message = error.get("message") if isinstance(error, dict) else None
                raise Retry(
                    f"{executor.label} answered {resp.status_code}: {message or content[:200]!r}",
                    Response(content, status_code=resp.status_code, headers=response_headers(executor, resp)),
                )
        executor.end(blocks)
        return Response(content, status_code=resp.status_code, headers=response_headers(executor, resp))
    chunks = resp.aiter_raw()
    try:
        first = await watched(anext(chunks))
        executor.last_byte_at = time.monotonic()
    except (httpx.TransportError, StopAsyncIteration) as exc:
        await resp.aclose()
        executor.mark_down(f"stream broke before its first byte: {exc!r}")
        raise Retry(executor.scrub(repr(exc))) from None
    except Stalled as exc:
        await resp.aclose()
        raise _stalled(executor, exc) from None
    except BaseException:  # ClientGone, or the wait cancelled (its client left while it sent keep-alives)
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        raise
    return Upstream(executor, resp, first, chunks, blocks, deadlines)


def _stalled(executor: Executor, exc: Stalled) -> Retry:
    """The ``Retry`` of a wait that ``exc`` ended; a missed deadline marks ``executor`` down."""
    if exc.timed_out:
        executor.mark_down(f"no first byte: {exc}")
    return Retry(f"{executor.label}: {exc}")


def response_headers(executor: Executor, resp: httpx.Response) -> dict[str, str]:
    return {"content-type": resp.headers.get("content-type", "application/json"), EXECUTOR_HEADER: executor.url}
