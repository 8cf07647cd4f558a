"""One HTTP request through an ASGI app in this process, its response streamed as it comes.

``asgi_call`` yields a ``ResponseStart`` (status and headers), then the body's chunks (bytes),
as the app sends them: a replica answers a streamed completion event by event. Closing the
generator early (the caller went away: Ray cancels the replica's generator) tells the app
its client disconnected, which is how ``kvreuse serve`` learns to abort a request and free
its blocks (``kvreuse.api.connection.client_disconnected``); the app's task then ends on
its own and is not waited for here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[MutableMapping[str, Any]]],
        Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]

_RUNNING: set[asyncio.Task] = set()  # apps still finishing after their caller left (kept from GC)


def _finished(task: asyncio.Task) -> None:
    """Drop a finished app task; its exception (Starlette re-raises after sending the 500 it
    answered) has been answered, so it is only retrieved here, never left unretrieved."""
    _RUNNING.discard(task)
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: list[tuple[str, str]]


def http_scope(method: str, path: str, query: str, headers: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The ASGI scope of ``method path?query`` with ``headers`` (names lower-cased)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method.upper(),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("kvreuse-replica", 80),
    }


async def asgi_call(
    app: ASGIApp, method: str, path: str, query: str, headers: Sequence[tuple[str, str]], body: bytes
) -> AsyncGenerator[ResponseStart | bytes, None]:
    """``app``'s response to one request: a ``ResponseStart``, then body chunks. Raises what
    the app raises before it sends its response start (after that, Starlette has sent the
    500 itself or the stream just ends)."""
    messages: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
    left = asyncio.Event()  # set when our caller stops reading: the app's client disconnected
    sent_body = False

    async def receive() -> MutableMapping[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(http_scope(method, path, query, headers), receive, send))
    _RUNNING.add(task)
    task.add_done_callback(_finished)
    try:
        while True:
            if not messages.empty():
                message = messages.get_nowait()
            elif task.done():
                task.result()  # the app raised: raise it here
                return  # it returned without finishing its response: the body just ends
            else:
                getter = asyncio.ensure_future(messages.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                message = getter.result()
            if message["type"] == "http.response.start":
                headers_out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield ResponseStart(int(message["status"]), headers_out)
            elif message["type"] == "http.response.body":
                chunk = bytes(message.get("body", b""))
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
    finally:
        left.set()
