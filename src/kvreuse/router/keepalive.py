"""Keep-alive comments to a streaming client while the router waits for an executor's first
byte.

Executors send nothing while they queue and prefill a request (``kvreuse.router.deadline``),
and a stream continued on another executor (``kvreuse.router.migration``) waits for that
one's first byte the same way: up to ``--upstream-first-byte-timeout`` (300 s). A client
whose read timeout is shorter would see a silent cut. So while a stream waits for a first
byte, the router sends its client an SSE comment, ``: keep-alive``, every
``--stream-keepalive-interval`` seconds (``DEFAULT_KEEPALIVE_S``; 0: none). A comment is no
event: the official ``openai`` and ``anthropic`` clients skip lines that start with ``:``
(tests/router/test_keepalive.py runs both against the router).

``Waiting`` runs the wait (one or several tries of executors) in its own task, so its caller,
an SSE body, can send the comments meanwhile (``beats``); a caller that leaves first (the
client went) cancels the task and hands a result that came anyway to ``orphan`` (to close an
upstream response nobody will read).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Generic, TypeVar

import anyio

KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it
DEFAULT_KEEPALIVE_S = 5.0  # --stream-keepalive-interval
KEEPALIVE_SETTING = "--stream-keepalive-interval"

T = TypeVar("T")


class Waiting(Generic[T]):
    """``aw`` (a wait for an executor's first byte) run in its own task; ``every_s``: the
    keep-alive interval (``None``: no comments). ``orphan`` gets a result nobody took."""

    def __init__(
        self,
        aw: Awaitable[T],
        every_s: float | None,
        *,
        orphan: Callable[[T], Awaitable[None]] | None = None,
    ) -> None:
        self.task: asyncio.Future[T] = asyncio.ensure_future(aw)
        self.every_s, self.orphan = every_s, orphan

    async def ready(self, timeout_s: float | None) -> bool:
        """Whether the wait is over within ``timeout_s`` (``None``: wait until it is). A
        caller cancelled meanwhile cancels the wait too."""
        try:
            done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
        except BaseException:
            await self.abandon()
            raise
        return bool(done)

    async def beats(self) -> AsyncGenerator[bytes, None]:
        """``KEEPALIVE`` every ``every_s`` until the wait is over (then ``result``). Closed
        before (the client left), it abandons the wait."""
        try:
            while not await self.ready(self.every_s):
                yield KEEPALIVE
        finally:
            if not self.task.done():
                await self.abandon()

    def result(self) -> T:
        """The wait's result (or its exception); only once ``ready`` or ``beats`` saw it over."""
        return self.task.result()

    async def abandon(self) -> None:
        """Cancel the wait and wait for it to end (shielded: the caller may be cancelled
        itself); a result it had anyway goes to ``orphan``."""
        self.task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(self.task, return_exceptions=True)
            if self.orphan is not None and not self.task.cancelled() and self.task.exception() is None:
                await self.orphan(self.task.result())


async def kept_alive(
    waiting: Waiting[T], then: Callable[[T], AsyncGenerator[bytes, None]]
) -> AsyncGenerator[bytes, None]:
    """An SSE body for a wait that has lasted an interval already: ``KEEPALIVE`` at once (the
    client has waited that long for its headers) and every ``waiting.every_s`` until the wait
    is over, then ``then(result)``'s bytes."""
    taken = False
    try:
        yield KEEPALIVE
        async with aclosing(waiting.beats()) as beats:
            async for beat in beats:
                yield beat
        result, taken = waiting.result(), True
    finally:
        if not taken:  # closed first (the client left): nothing reads what the wait brings
            await waiting.abandon()
    async with aclosing(then(result)) as rest:
        async for data in rest:
            yield data
