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

And one signal: an executor **marked down** (a failed health probe, a refused connection)
has its waits ended once it has sent no byte for ``DOWN_GRACE_S`` (1 s) since it was seen
down. An executor that answers ``/health`` slowly but still streams keeps its streams; a
stopped or hung one loses them within a second of the probe's verdict.

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

from kvreuse.router.executors import Executor

DEFAULT_FIRST_BYTE_TIMEOUT_S = 300.0  # --upstream-first-byte-timeout
DEFAULT_PROGRESS_TIMEOUT_S = 10.0  # --upstream-progress-timeout
DOWN_GRACE_S = 1.0  # a stream of an executor marked down moves after this long without a byte
FIRST_BYTE_SETTING = "--upstream-first-byte-timeout"
PROGRESS_SETTING = "--upstream-progress-timeout"

T = TypeVar("T")


class Stalled(Exception):
    """An executor sent no byte within a deadline, or none since it was marked down.
    ``timed_out``: a deadline passed (the executor was not known to be down)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Deadlines:
    """The router's deadlines, in seconds (``None``: no limit)."""

    first_byte_s: float | None = DEFAULT_FIRST_BYTE_TIMEOUT_S
    progress_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S
    down_grace_s: float = DOWN_GRACE_S

    @classmethod
    def of(cls, first_byte_s: float, progress_s: float) -> Deadlines:
        """From the flags' values (0: no limit). Raises ``ValueError`` naming the flag for a
        negative or non-finite value."""
        for value, flag in ((first_byte_s, FIRST_BYTE_SETTING), (progress_s, PROGRESS_SETTING)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"{flag} must be a finite number of seconds >= 0 (0: no limit), got {value}")
        return cls(first_byte_s or None, progress_s or None)


DEFAULT_DEADLINES = Deadlines()


async def within(
    aw: Awaitable[T],
    executor: Executor,
    *,
    since: float,
    limit_s: float | None,
    setting: str,
    grace_s: float = DOWN_GRACE_S,
) -> T:
    """``await aw`` (a read from ``executor``), unless ``limit_s`` passes from ``since`` (a
    ``time.monotonic()``: the last byte, or the request's sending) or ``executor`` is marked
    down and ``grace_s`` passes without the result. Then ``aw`` is cancelled (and waited
    for) and ``Stalled`` raised, naming ``setting`` for a deadline. A result that is ready
    wins."""
    task = asyncio.ensure_future(aw)
    down = executor.down_signal()
    down_seen: float | None = None
    try:
        while True:
            ends = [] if limit_s is None else [since + limit_s]
            if down_seen is not None:
                ends.append(max(since, down_seen) + grace_s)
            timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
            await asyncio.wait(
                {task} if down_seen is not None else {task, down}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if task.done():
                return task.result()
            now = time.monotonic()
            if down_seen is None and down.done():
                down_seen = now
                continue
            if limit_s is not None and now >= since + limit_s:
                raise Stalled(f"it sent no byte for {limit_s:g} s ({setting})", timed_out=True)
            if down_seen is not None and now >= max(since, down_seen) + grace_s:
                raise Stalled(
                    f"it was marked down ({executor.last_error}) and sent no byte for {grace_s:g} s after",
                    timed_out=False,
                )
    finally:
        down.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
