"""HTTP endpoints for KV cache events (``app.include_router(events_routes.build_router(feed))``).

    GET /v1/kv_cache_events?after=ID&timeout=S&max_events=N   long-poll JSON
    GET /v1/kv_cache_events/stream?after=ID                    server-sent events
    GET /v1/kv_cache_state                                     snapshot of every cached block

The routes serve the ``EventFeed`` they were built with (``kvreuse.server.context``): its
``buffer`` (``build_app`` gives the one the engine's pool writes to) and its ``snapshot()``
(``build_app``'s runs on the engine thread between steps, so the blocks and
``last_event_id`` describe the same instant). Built with ``None`` (events off), every
route answers 404 "events are off".

Hashes are hex strings (see ``kvreuse.events.records``). A consumer that sees a first event id
greater than ``after + 1``, or ``last_event_id < after`` (the executor restarted), must
reload ``/v1/kv_cache_state`` and continue with ``after = its last_event_id``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from kvreuse.events.records import event_to_json
from kvreuse.server.context import EventFeed

MAX_POLL_S = 60.0  # a long-poll never holds a connection longer than this
SSE_KEEPALIVE_S = 15.0  # comment line so proxies do not close an idle stream
EVENTS_OFF = "KV cache events are off: start the server with --event-buffer-max-size N (N > 0)"


def build_router(feed: EventFeed | None) -> APIRouter:
    """The three event routes over ``feed`` (``None``: each answers 404 ``EVENTS_OFF``).
    Each app builds its own, so apps in one process never share a feed."""
    router = APIRouter()

    def feed_or_404() -> EventFeed:
        if feed is None:
            raise HTTPException(404, EVENTS_OFF)
        return feed

    @router.get("/v1/kv_cache_events")
    async def kv_cache_events(
        after: int | None = Query(None, ge=-1, description="last event id seen; omitted: everything held"),
        timeout: float = Query(0.0, ge=0.0, description="seconds to wait when there is nothing new"),
        max_events: int = Query(1000, ge=1, le=10_000),
    ) -> dict:
        """Events with ``event_id > after``, waiting up to ``timeout`` seconds for the first."""
        buffer = feed_or_404().buffer
        wait = 0.0 if after is not None and after > buffer.last_event_id else min(timeout, MAX_POLL_S)
        events = await buffer.wait_events(after, wait, max_events)
        stats = buffer.stats()
        return {
            "events": [event_to_json(e) for e in events],
            "last_event_id": stats["last_event_id"],
            "first_event_id": stats["first_event_id"],
            "num_dropped": stats["num_dropped"],
        }

    @router.get("/v1/kv_cache_events/stream")
    async def kv_cache_events_stream(request: Request, after: int | None = Query(None, ge=-1)) -> StreamingResponse:
        """Server-sent events, one per KV event, ``id:`` = event id, so a reconnecting
        ``EventSource`` resumes after ``Last-Event-ID``. Without either, it starts with the
        events still held. A cursor beyond the last event id (the server restarted) gets an
        ``event: reset`` first, then every event held."""
        buffer = feed_or_404().buffer
        last_header = request.headers.get("last-event-id")
        if last_header is not None:
            try:
                after = int(last_header)
            except ValueError:
                raise HTTPException(400, "Last-Event-ID must be an integer event id") from None

        async def stream() -> AsyncIterator[bytes]:
            cursor = after
            if cursor is not None and cursor > buffer.last_event_id:
                # Ids went back: this server restarted since the client's last event (a browser
                # EventSource reconnects with its old Last-Event-ID). Say so, then send all held.
                reset = {
                    "last_event_id": buffer.last_event_id,
                    "after": cursor,
                    "reason": "event ids went back (the server restarted): reload /v1/kv_cache_state",
                }
                yield f"event: reset\ndata: {json.dumps(reset)}\n\n".encode()
                cursor = None
            while not await request.is_disconnected():
                events = await buffer.wait_events(cursor, SSE_KEEPALIVE_S)
                if not events:
                    yield b": keepalive\n\n"
                    continue
                chunk = "".join(
                    f"id: {e.event_id}\nevent: kv_event\ndata: {json.dumps(event_to_json(e))}\n\n" for e in events
                )
                yield chunk.encode()
                cursor = events[-1].event_id

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    @router.get("/v1/kv_cache_state")
    async def kv_cache_state() -> dict:
        """Every registered block (hash, parent, token ids, priority, level, depth, in use),
        parents first, with the id of the last event the snapshot reflects."""
        served = feed_or_404()
        snapshot = await served.snapshot()
        return {**snapshot.to_json(), "num_dropped": served.buffer.num_dropped}

    return router
