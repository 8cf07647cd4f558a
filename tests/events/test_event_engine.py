"""Events from the real engine (tiny random Llama) behind the real app: completions fill
the cache; /v1/kv_cache_state (taken on the engine thread), the long-poll, SSE and a
separate ZMQ subscriber process all end with the same block set."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from kvreuse.events.buffer import EventBuffer
from kvreuse.events.publisher import ZmqEventPublisher
from kvreuse.events.records import BlocksRemoved, KVSnapshot, event_from_json
from tests.events.event_helpers import CacheMirror, engine_thread_snapshot
from tests.events.test_publisher import SUBSCRIBER
from tests.server.test_events_routes import Server, read_sse

BS = 16


@pytest.fixture(scope="module")
def stack(tiny_llama):
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.server.api_server import build_app

    buffer = EventBuffer(100_000)
    # 0.0002 GiB holds ~25 blocks of the tiny model, so later requests evict earlier ones
    config = EngineConfig(kv_cache_memory_gib=0.0002, block_size=BS, max_model_len=512, max_num_seqs=8)
    engine = AsyncEngine(LLMEngine(config, tiny_llama, events=buffer))
    app = build_app(engine, served_model_name="tiny")
    engine.start()
    publisher = ZmqEventPublisher(
        buffer,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv-events",
        snapshot_fn=engine_thread_snapshot(engine, buffer),
        context=zmq.Context(),
    ).start()
    with Server(app) as url:
        yield url, buffer, engine, publisher
    publisher.close()
    engine.shutdown()


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def wire_blocks(state: dict) -> dict:
    return {
        str(int(b["block_hash"], 16) & (2**64 - 1)): None
        if b["parent_hash"] is None
        else int(b["parent_hash"], 16) & (2**64 - 1)
        for b in state["blocks"]
    }


def test_http_sse_and_zmq_views_equal_the_engine_snapshot(stack):
    url, buffer, engine, publisher = stack
    sub = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, publisher.endpoint, publisher.replay_endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sub.stdout.readline().strip() == "ready"
        system = "You are a helpful assistant who answers briefly and precisely. " * 4
        for i in range(10):
            body = complete(url, system + f"Question {i}: what is {i} plus {i}?")
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the shared prefix hit
        state = httpx.get(f"{url}/v1/kv_cache_state").json()
        assert state["blocks"] and state["last_event_id"] == buffer.last_event_id
        deadline = time.monotonic() + 30
        while publisher.last_event_id < buffer.last_event_id:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        zmq_view, _ = sub.communicate(f"{publisher.last_seq}\n", timeout=60)
    finally:
        sub.kill()
    assert json.loads(zmq_view) == wire_blocks(state)

    # long-poll from nothing
    mirror = CacheMirror()
    while mirror.last_event_id < state["last_event_id"]:
        body = httpx.get(f"{url}/v1/kv_cache_events", params={"after": mirror.last_event_id}).json()
        assert mirror.apply_all(event_from_json(e) for e in body["events"])
    snap = KVSnapshot.from_json(state)
    assert {h: (m.parent_hash, m.priority) for h, m in mirror.blocks.items()} == {
        b.block_hash: (b.parent_hash, b.priority) for b in snap.blocks
    }
    assert any(isinstance(e.data, BlocksRemoved) for e in buffer.get_events(after_id=-1, max_events=10**9))

    # SSE from nothing
    with httpx.stream("GET", f"{url}/v1/kv_cache_events/stream", params={"after": -1}, timeout=30) as response:
        messages = read_sse(response, state["last_event_id"] + 1)
    sse = CacheMirror()
    assert sse.apply_all(event_from_json(m["data"]) for m in messages)
    assert sse.blocks == mirror.blocks


def test_llm_get_kv_cache_events_returns_each_event_once(tiny_llama):
    from kvreuse import LLM, SamplingParams

    llm = LLM("tiny", loaded=tiny_llama, events=EventBuffer(1000), kv_cache_memory_gib=0.001, block_size=BS)
    assert llm.engine.events is not None, "LLMEngine keeps the event sink it was given (self.events)"
    llm.generate(["word " * 40], SamplingParams(max_tokens=4, temperature=0))
    first = llm.get_kv_cache_events(timeout=1.0)
    assert first[0]["event_id"] == 0 and first[0]["data"]["type"] == "created"
    assert any(e["data"]["type"] == "stored" for e in first)
    assert llm.get_kv_cache_events(timeout=0.01) == []
    llm.reset_prefix_cache()
    assert [e["data"]["type"] for e in llm.get_kv_cache_events()] in (["cleared"], ["removed"])
