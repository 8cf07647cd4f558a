"""The bounded event buffer: numbers the pool's events and hands them to every consumer.

One producer (the engine thread, through ``append``) and any number of consumers (the
in-process ``LLM.get_kv_cache_events``, HTTP long-poll, SSE, the ZMQ publisher thread),
each reading by event id with its own cursor::

    BlockPool --append--> EventBuffer [oldest ... newest]  (at most max_size events)
                               |-- get_events(after_id, timeout)      threads
                               |-- wait_events(after_id, timeout)     asyncio tasks
                               `-- drain_since_last(timeout)          LLM.get_kv_cache_events

When full, ``append`` drops the oldest event and counts it in ``num_dropped``; a consumer
that falls behind therefore sees a hole in the ids (the first event it gets has
``event_id > after_id + 1``) and must resynchronise from a snapshot. Nothing a consumer
does can make ``append`` wait for it: consumers hold the lock only to copy at most
``max_batch`` already-built events, never across IO or a wait.

``--event-buffer-max-size`` sizes it; 0 (the default, as in TensorRT-LLM) means no
buffer at all: the engine passes ``events=None`` to the pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any

from kvreuse.events.records import Event, KVEvent, KVSnapshot, take_snapshot

DEFAULT_MAX_BATCH = 1024  # events per read; bounds how long a reader holds the lock


class EventBuffer:
    """Thread-safe bounded buffer implementing ``EventSink``; assigns ids and timestamps."""

    def __init__(
        self,
        max_size: int,
        *,
        clock: Callable[[], float] = time.time,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if max_size <= 0:
            raise ValueError(
                f"event buffer size must be positive, got {max_size} "
                "(--event-buffer-max-size 0 turns events off: pass events=None to the pool)"
            )
        self.max_size = max_size
        self.max_batch = max_batch
        self._clock = clock
        self._events: deque[Event] = deque()
        self._next_id = 0
        self._num_dropped = 0
        self._drain_cursor = -1  # last id returned by drain_since_last
        self._cond = threading.Condition(threading.Lock())
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()

    # ------------------------------------------------------------------ producer
    def append(self, event: KVEvent) -> None:
        """Number, timestamp and keep one event; drop (and count) the oldest when full.
        Never raises for a full buffer and never waits for a consumer's IO."""
        with self._cond:
            if len(self._events) >= self.max_size:
                self._events.popleft()
                self._num_dropped += 1
            self._events.append(Event(self._next_id, self._clock(), event))
            self._next_id += 1
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, set()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that loop is closed; its waiter is gone
                pass

    # ------------------------------------------------------------------ queries
    @property
    def last_event_id(self) -> int:
        """Id of the newest event appended so far; -1 before the first."""
        return self._next_id - 1

    @property
    def num_dropped(self) -> int:
        """Events dropped because the buffer was full (for the Prometheus counter)."""
        return self._num_dropped

    def stats(self) -> dict[str, int]:
        with self._cond:
            first = self._events[0].event_id if self._events else self._next_id
            return {
                "max_size": self.max_size,
                "num_events": len(self._events),
                "first_event_id": first,
                "last_event_id": self._next_id - 1,
                "num_dropped": self._num_dropped,
            }

    # ------------------------------------------------------------------ consumers
    def get_events(
        self, after_id: int | None = None, timeout: float = 0.0, max_events: int | None = None
    ) -> list[Event]:
        """Events with ``event_id > after_id`` still held, oldest first, at most
        ``max_events`` (default ``max_batch``). ``after_id=None`` means "everything held".

        Waits up to ``timeout`` seconds when there is none yet; returns ``[]`` on timeout.
        A first event with ``event_id > after_id + 1`` means events were dropped.
        """
        with self._cond:
            after = self._resolve(after_id)
            if timeout > 0:
                self._cond.wait_for(lambda: self._next_id - 1 > after, timeout)
            return self._since(after, max_events)

    async def wait_events(
        self, after_id: int | None = None, timeout: float = 0.0, max_events: int | None = None
    ) -> list[Event]:
        """``get_events`` for asyncio code: waits without blocking the event loop or
        holding a thread."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with self._cond:
            after = self._resolve(after_id)
        while True:
            future = loop.create_future()
            waiter = (loop, future)
            with self._cond:
                events = self._since(after, max_events)
                if events:
                    return events
                self._async_waiters.add(waiter)
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    return []
                await asyncio.wait_for(future, remaining)
            except TimeoutError:
                return []
            finally:
                with self._cond:
                    self._async_waiters.discard(waiter)

    def drain_since_last(self, timeout: float = 0.0) -> list[Event]:
        """Events appended since the previous call (the first call: everything held),
        waiting up to ``timeout`` when there is none. Backs ``LLM.get_kv_cache_events``:
        one shared cursor, so meant for a single in-process reader."""
        with self._cond:
            if timeout > 0:
                self._cond.wait_for(lambda: self._next_id - 1 > self._drain_cursor, timeout)
            events = self._since(self._drain_cursor, None)
            if events:
                self._drain_cursor = events[-1].event_id
            return events

    def snapshot(self, pool: Any) -> KVSnapshot:
        """The pool's registered blocks labelled with the id of the last event they
        reflect. The caller must keep the pool from changing while this runs: run it on the
        engine thread between steps (``AsyncEngine.call``), or hold the lock the engine
        holds while it mutates the pool."""
        return take_snapshot(pool, self.last_event_id)

    # ------------------------------------------------------------------ internals
    def _resolve(self, after_id: int | None) -> int:
        if after_id is not None:
            return after_id
        return (self._events[0].event_id if self._events else self._next_id) - 1

    def _since(self, after: int, max_events: int | None) -> list[Event]:
        if not self._events:
            return []
        start = max(0, after + 1 - self._events[0].event_id)
        limit = self.max_batch if max_events is None else max_events
        return list(islice(self._events, start, start + limit))


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
