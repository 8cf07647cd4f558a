"""HTTP endpoints for KV cache events (``app.include_router(events_routes.router)``).

    GET /v1/kv_cache_events?after=ID&timeout=S&max_events=N   long-poll JSON
    GET /v1/kv_cache_events/stream?after=ID                    server-sent events
    GET /v1/kv_cache_state                                     snapshot of every cached block

What the routes read from ``app.state``:

- the ``EventBuffer``: ``app.state.event_buffer`` (``build_app`` sets it to the engine's)
  (the ``LLMEngine`` keeps the sink it gave its pool). None: 404 "events are off".
- the snapshot: ``app.state.kv_snapshot_fn()`` when set (any callable returning a
  consistent ``KVSnapshot``, e.g. ``event_buffer.locked_snapshot``; run in a worker
  thread), else ``await app.state.engine.call(...)``, which runs it on the engine thread
  between steps, so the blocks and ``last_event_id`` describe the same instant.

Hashes are hex strings (see ``kvreuse.events.records``). A consumer that sees a first event id
greater than ``after + 1``, or ``last_event_id < after`` (the executor restarted), must
reload ``/v1/kv_cache_state`` and continue with ``after = its last_event_id``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import KVSnapshot, event_to_json

router = APIRouter()

MAX_POLL_S = 60.0  # a long-poll never holds a connection longer than this
SSE_KEEPALIVE_S = 15.0  # comment line so proxies do not close an idle stream


def _buffer(request: Request) -> EventBuffer:
    buffer = getattr(request.app.state, "event_buffer", None)  # resolved by build_app
    if not isinstance(buffer, EventBuffer):
        raise HTTPException(404, "KV cache events are off: start the server with --event-buffer-max-size N (N > 0)")
    return buffer


async def _snapshot(request: Request, buffer: EventBuffer) -> KVSnapshot:
    snapshot_fn = getattr(request.app.state, "kv_snapshot_fn", None)
    if snapshot_fn is not None:
        return await asyncio.to_thread(snapshot_fn)  # may wait one engine step for its lock
    return await request.app.state.engine.call(lambda engine: buffer.snapshot(engine.pool))


@router.get("/v1/kv_cache_events")
async def kv_cache_events(
    request: Request,
    after: int | None = Query(None, ge=-1, description="last event id seen; omitted: everything held"),
    timeout: float = Query(0.0, ge=0.0, description="seconds to wait when there is nothing new"),
    max_events: int = Query(1000, ge=1, le=10_000),
) -> dict:
    """Events with ``event_id > after``, waiting up to ``timeout`` seconds for the first."""
    buffer = _buffer(request)
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
    buffer = _buffer(request)
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
            reset = {"last_event_id": buffer.last_event_id, "after": cursor,
                     "reason": "event ids went back (the server restarted): reload /v1/kv_cache_state"}
            yield f"event: reset\ndata: {json.dumps(reset)}\n\n".encode()
            cursor = None
        while not await request.is_disconnected():
            events = await buffer.wait_events(cursor, SSE_KEEPALIVE_S)
            if not events:
                yield b": keepalive\n\n"
                continue
            chunk = "".join(f"id: {e.event_id}\nevent: kv_event\ndata: {json.dumps(event_to_json(e))}\n\n" for e in events)
            yield chunk.encode()
            cursor = events[-1].event_id

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


@router.get("/v1/kv_cache_state")
async def kv_cache_state(request: Request) -> dict:
    """Every registered block (hash, parent, token ids, priority, level, depth, in use),
    parents first, with the id of the last event the snapshot reflects."""
    buffer = _buffer(request)
    snapshot = await _snapshot(request, buffer)
    return {**snapshot.to_json(), "num_dropped": buffer.num_dropped}
