"""How long the router waits on an executor: the deadlines of its upstream reads.

Executors send nothing while they queue and prefill a request (a stream's headers come with
its first token, ``kvreuse.server.serving.start_streams``; they send no keep-alive comments
on completion streams), and then one event per decoded chunk. So the router has two clocks:

- **first byte** (``--upstream-first-byte-timeout``, default 300 s; 0: none): from sending a
  streamed request to its first chunk. It covers queueing and a long prefill, so it is
  generous; a non-streamed response (whose first byte is the whole reply) has none.
- **progress** (``--upstream-progress-timeout``, default 10 s; 0: none): between two chunks
  of a stream that has started. A decode step takes milliseconds on a GPU and well under a
  second on a CPU; 10 s of silence means a hung executor (or one whose request was
  preempted and is still waiting, which another executor then serves at once).

And one signal: an executor **marked down** (a failed health probe, a refused connection,
a stream of it that stalled while it sent nothing at all: ``upstream.Upstream.chunks``) has
its waits ended once it has sent no byte for ``DOWN_GRACE_S`` (1 s) since it was seen down,
unless a health probe has brought it back by then. An executor that answers ``/health``
slowly but still streams keeps its streams; a stopped or hung one loses them within a
second of the probe's verdict.

A wait that ends so raises ``Stalled``; the caller retries the request (nothing sent to the
client yet), continues the stream elsewhere (``kvreuse.router.migration``) or ends it with
the error event, and never holds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from kvreuse.router.executors import Executor
from kvreuse.router.keepalive import DEFAULT_KEEPALIVE_S, KEEPALIVE_SETTING

DEFAULT_FIRST_BYTE_TIMEOUT_S = 300.0  # --upstream-first-byte-timeout
DEFAULT_PROGRESS_TIMEOUT_S = 10.0  # --upstream-progress-timeout
DOWN_GRACE_S = 1.0  # a stream of an executor marked down moves after this long without a byte
FIRST_BYTE_SETTING = "--upstream-first-byte-timeout"
PROGRESS_SETTING = "--upstream-progress-timeout"
_OFF = {FIRST_BYTE_SETTING: "no limit", PROGRESS_SETTING: "no limit", KEEPALIVE_SETTING: "no comments"}

T = TypeVar("T")


class Stalled(Exception):
    """An executor sent no byte within a deadline, or none since it was marked down.
    ``timed_out``: a deadline passed (the executor was not known to be down)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Deadlines:
    """The router's deadlines, in seconds (``None``: no limit), and how often a stream that
    waits for a first byte sends its client a keep-alive comment (``keepalive_s``, ``None``:
    never; ``kvreuse.router.keepalive``)."""

    first_byte_s: float | None = DEFAULT_FIRST_BYTE_TIMEOUT_S
    progress_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S
    down_grace_s: float = DOWN_GRACE_S
    keepalive_s: float | None = DEFAULT_KEEPALIVE_S

    @classmethod
    def of(cls, first_byte_s: float, progress_s: float, keepalive_s: float = DEFAULT_KEEPALIVE_S) -> Deadlines:
        """From the flags' values (0: no limit, no comments). Raises ``ValueError`` naming
        the flag for a negative or non-finite value."""
        flags = ((first_byte_s, FIRST_BYTE_SETTING), (progress_s, PROGRESS_SETTING), (keepalive_s, KEEPALIVE_SETTING))
        for value, flag in flags:
            if not 0 <= value < float("inf"):
                raise ValueError(f"{flag} must be a finite number of seconds >= 0 (0: {_OFF[flag]}), got {value}")
        return cls(first_byte_s or None, progress_s or None, keepalive_s=keepalive_s or None)


DEFAULT_DEADLINES = Deadlines()


class ReadClock:
    """The deadlines of the reads from ``executor``, one at a time, each awaited in its
    caller's task (``read``) under its own ``anyio.CancelScope``. One timer per clock,
    re-armed only when it fires before the current read's end, so a stream's chunk costs a
    cancel scope, not a timer or a task; ``executor.mark_down`` brings it forward. ``close``
    when done."""

    def __init__(
        self, executor: Executor, *, limit_s: float | None, setting: str, grace_s: float = DOWN_GRACE_S
    ) -> None:
        self.executor, self.limit_s, self.setting, self.grace_s = executor, limit_s, setting, grace_s
        self._since = 0.0  # when the current read began (time.monotonic(), the loop's clock)
        self._down_seen: float | None = None  # when the executor was first seen down
        self._scope: anyio.CancelScope | None = None  # the current read's (None: between reads)
        self._timer: asyncio.TimerHandle | None = None
        self._stalled: Stalled | None = None  # what the timer ended the current read with

    async def read(self, aw: Awaitable[T], *, since: float | None = None) -> T:
        """``await aw`` unless ``limit_s`` passes from ``since`` (default: now) or the
        executor is, or gets, marked down and ``grace_s`` passes from then (or ``since``,
        the later) without the result: then ``aw`` is cancelled and ``Stalled`` raised."""
        self._since = time.monotonic() if since is None else since
        if self.executor.healthy:
            self._down_seen = None  # up again (the health probe brought it back): no grace to keep
        elif self._down_seen is None:
            self._down_seen = time.monotonic()
        # An anyio scope, not Task.cancel: the read may run in a task of an anyio task group
        # (Starlette's streaming response), which a bare cancellation would tear down whole.
        scope = self._scope = anyio.CancelScope()
        self.executor.on_down.add(self._marked_down)
        self._arm()
        try:
            with scope:
                return await aw
            stalled, self._stalled = self._stalled, None  # only the timer cancels the scope
            raise stalled or Stalled("the read was cancelled", timed_out=False)
        finally:
            self._scope = None
            self.executor.on_down.discard(self._marked_down)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ends(self) -> tuple[float | None, float | None]:
        """(the deadline's end, the grace's end) of the current read."""
        limit_end = None if self.limit_s is None else self._since + self.limit_s
        down_end = None if self._down_seen is None else max(self._since, self._down_seen) + self.grace_s
        return limit_end, down_end

    def _arm(self) -> None:
        end = _earliest(*self._ends())
        if end is None or (self._timer is not None and self._timer.when() <= end):
            return  # no end, or the timer fires first and re-arms then
        self.close()
        self._timer = asyncio.get_running_loop().call_at(end, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._scope is None:
            return  # between reads: the next one arms it
        limit_end, down_end = self._ends()
        now = time.monotonic()
        end = _earliest(limit_end, down_end)
        if end is None:
            return
        if now < end:
            self._timer = asyncio.get_running_loop().call_at(end, self._fire)
            return
        if down_end is not None and (limit_end is None or down_end < limit_end):
            if self.executor.healthy:  # a health probe brought it back within the grace: no cut
                self._down_seen = None
                self._arm()
                return
            why = self.executor.scrub(self.executor.last_error or "")  # told to the client: no address
            self._stalled = Stalled(
                f"it was marked down ({why}) and sent no byte for {self.grace_s:g} s after",
                timed_out=False,
            )
        else:
            self._stalled = Stalled(f"it sent no byte for {self.limit_s:g} s ({self.setting})", timed_out=True)
        self._scope.cancel()

    def _marked_down(self) -> None:
        if self._down_seen is None:
            self._down_seen = time.monotonic()
        self._arm()


async def within(
    aw: Awaitable[T],
    executor: Executor,
    *,
    since: float,
    limit_s: float | None,
    setting: str,
    grace_s: float = DOWN_GRACE_S,
) -> T:
    """One ``ReadClock.read``: ``await aw`` (a read from ``executor``), unless ``limit_s``
    passes from ``since`` (a ``time.monotonic()``: the last byte, or the request's sending)
    or ``executor`` is marked down and ``grace_s`` passes without the result. Then ``aw``
    is cancelled and ``Stalled`` raised, naming ``setting`` for a deadline."""
    clock = ReadClock(executor, limit_s=limit_s, setting=setting, grace_s=grace_s)
    try:
        return await clock.read(aw, since=since)
    finally:
        clock.close()


def _earliest(*ends: float | None) -> float | None:
    known = [e for e in ends if e is not None]
    return min(known) if known else None
