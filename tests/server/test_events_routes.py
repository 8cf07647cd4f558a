"""HTTP event endpoints on a real uvicorn server: long-poll, SSE with resume, snapshot
resync; the pool is driven from an 'engine' thread under the step lock."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from kvreuse.cache.block_pool import BlockPool
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import KVSnapshot, event_from_json
from kvreuse.server import events_routes
from kvreuse.server.context import EventFeed
from tests.events.event_helpers import CacheMirror, locked_snapshot
from tests.events.test_publisher import run_requests  # same request driver as the ZMQ tests

BS = 4


class Server:
    def __init__(self, app: FastAPI) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def served():
    buffer = EventBuffer(10_000)
    pool = BlockPool(16, BS, events=buffer)
    lock = threading.Lock()
    snapshot = locked_snapshot(pool, buffer, lock)  # may wait one "engine step" for the lock: run in a thread
    app = FastAPI()
    app.include_router(events_routes.build_router(EventFeed(buffer, lambda: asyncio.to_thread(snapshot))))
    with Server(app) as url:
        yield url, buffer, pool, lock


def pool_state(pool):
    return {b.block_hash: (b.parent_hash, b.priority) for b in pool.cached_hashes()}


def mirror_state(mirror):
    return {h: (m.parent_hash, m.priority) for h, m in mirror.blocks.items()}


def test_long_poll_returns_events_and_waits_for_new_ones(served):
    url, buffer, pool, lock = served
    with lock:
        run_requests(pool, random.Random(1), 5)
    body = httpx.get(f"{url}/v1/kv_cache_events", params={"after": -1}).json()
    events = [event_from_json(e) for e in body["events"]]
    assert [e.event_id for e in events] == list(range(buffer.last_event_id + 1))
    assert body["last_event_id"] == buffer.last_event_id and body["num_dropped"] == 0
    mirror = CacheMirror()
    assert mirror.apply_all(events) and mirror_state(mirror) == pool_state(pool)

    def later():
        time.sleep(0.3)
        with lock:
            run_requests(pool, random.Random(2), 1)

    threading.Thread(target=later).start()
    start = time.monotonic()
    body = httpx.get(
        f"{url}/v1/kv_cache_events", params={"after": mirror.last_event_id, "timeout": 10}, timeout=20
    ).json()
    assert 0.2 < time.monotonic() - start < 5 and body["events"][0]["event_id"] == mirror.last_event_id + 1
    # an id from the future (the executor restarted) answers at once, so the router resyncs
    start = time.monotonic()
    body = httpx.get(f"{url}/v1/kv_cache_events", params={"after": 10**6, "timeout": 10}, timeout=20).json()
    assert body["events"] == [] and time.monotonic() - start < 5  # well before the 10 s timeout


def test_snapshot_plus_later_events_equal_the_pool_while_it_changes(served):
    url, buffer, pool, lock = served
    stop = threading.Event()

    def engine():
        rng = random.Random(3)
        while not stop.is_set():
            with lock:
                run_requests(pool, rng, 2)
            time.sleep(0.001)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        time.sleep(0.1)
        state = httpx.get(f"{url}/v1/kv_cache_state").json()
        assert state["block_size"] == BS and all(len(b["block_hash"]) == 64 for b in state["blocks"])
        mirror = CacheMirror()
        mirror.load(KVSnapshot.from_json(state))
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
    while mirror.last_event_id < buffer.last_event_id:
        body = httpx.get(f"{url}/v1/kv_cache_events", params={"after": mirror.last_event_id}).json()
        assert mirror.apply_all(event_from_json(e) for e in body["events"])
    assert mirror_state(mirror) == pool_state(pool)


def read_sse(response, n: int, lines=None) -> list[dict]:
    out, current = [], {}
    for line in response.iter_lines() if lines is None else lines:
        if line.startswith("id: "):
            current["id"] = int(line[4:])
        elif line.startswith("data: "):
            current["data"] = json.loads(line[6:])
        elif line == "" and current:
            out.append(current)
            current = {}
            if len(out) == n:
                return out
    return out


def test_sse_stream_and_resume_with_last_event_id(served):
    url, buffer, pool, lock = served
    with lock:
        run_requests(pool, random.Random(4), 4)
    n = buffer.last_event_id + 1
    with httpx.stream("GET", f"{url}/v1/kv_cache_events/stream", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        first = read_sse(response, n)
    assert [m["id"] for m in first] == list(range(n)) and all(m["data"]["event_id"] == m["id"] for m in first)

    def later():
        time.sleep(0.2)
        with lock:
            run_requests(pool, random.Random(5), 3)

    threading.Thread(target=later).start()
    mirror = CacheMirror()
    assert mirror.apply_all(event_from_json(m["data"]) for m in first)
    headers = {"Last-Event-ID": str(mirror.last_event_id)}
    with httpx.stream("GET", f"{url}/v1/kv_cache_events/stream", headers=headers, timeout=10) as response:
        time.sleep(0.5)  # let the later requests land first
        more = read_sse(response, buffer.last_event_id - mirror.last_event_id)
    assert mirror.apply_all(event_from_json(m["data"]) for m in more)
    assert mirror_state(mirror) == pool_state(pool)


def test_sse_resume_from_beyond_the_last_id_says_reset_then_sends_everything(served):
    """A browser EventSource reconnecting to a restarted server sends its old, higher
    Last-Event-ID: the stream says ``reset`` and starts over instead of waiting forever."""
    url, buffer, pool, lock = served
    with lock:
        run_requests(pool, random.Random(6), 2)
    n = buffer.last_event_id + 1
    headers = {"Last-Event-ID": str(buffer.last_event_id + 50)}
    with httpx.stream("GET", f"{url}/v1/kv_cache_events/stream", headers=headers, timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: reset"
        reset = json.loads(next(lines)[len("data: ") :])
        assert (reset["last_event_id"], reset["after"]) == (n - 1, n + 49)
        assert next(lines) == ""
        events = read_sse(response, n, lines)
    assert [m["id"] for m in events] == list(range(n))
    mirror = CacheMirror()
    assert mirror.apply_all(event_from_json(m["data"]) for m in events)
    assert mirror_state(mirror) == pool_state(pool)


def test_events_off_is_a_404_that_names_the_flag():
    app = FastAPI()
    app.include_router(events_routes.build_router(None))
    with Server(app) as url:
        r = httpx.get(f"{url}/v1/kv_cache_events")
    assert r.status_code == 404 and "--event-buffer-max-size" in r.text
