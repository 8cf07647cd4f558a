"""Noticing that an HTTP client went away, for the server and the router alike."""

from __future__ import annotations

from fastapi import Request


async def client_disconnected(request: Request) -> None:
    """Returns when the client disconnects. The caller must have read the body already:
    the next ASGI message of a plain POST is then ``http.disconnect``. Consumes the
    request's remaining ASGI messages; run it as a task and cancel it when done."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
