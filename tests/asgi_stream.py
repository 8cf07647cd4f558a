"""One streamed POST driven straight through an ASGI app, with a client that holds on.

``HeldStream`` sends the request as uvicorn would (ASGI 2.3: the app is told of a
disconnect through ``receive``), takes the response start and the first body chunk, then
blocks the app's next ``send`` until ``release()`` (the client reads on: the stream runs to
its end) or ``disconnect()`` (the client goes away, as uvicorn reports it). Between the two
the request is exactly "a stream in flight", for as long as the test needs, without timing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class HeldStream:
    def __init__(self, app: Any, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
        self.app, self.path = app, path
        self.body = json.dumps(body).encode()
        self.headers = [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.body)).encode()),
        ]
        self.headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.status: int | None = None
        self.chunks: list[bytes] = []
        self._body_sent = False
        self._first = asyncio.Event()
        self._gate = asyncio.Event()
        self._gone = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.append(message["body"])
                self._first.set()
                await self._gate.wait()
            if not message.get("more_body", False):
                self._first.set()  # a response without a body chunk to hold on (an error)

    async def start(self) -> None:
        """Send the request; return once the first body chunk arrived (the app is then
        blocked sending the next one)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": self.headers,
            "client": ("127.0.0.1", 50000),
            "server": ("test", 80),
        }
        self.task = asyncio.ensure_future(self.app(scope, self._receive, self._send))
        await asyncio.wait({self.task, asyncio.ensure_future(self._first.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():
            self.task.result()  # raise what the app raised

    async def release(self) -> bytes:
        """Let the stream run to its end; everything it sent."""
        self._gate.set()
        await self.task
        return b"".join(self.chunks)

    async def disconnect(self) -> None:
        """The client goes away; returns when the app has returned."""
        self._gone.set()
        await self.task
