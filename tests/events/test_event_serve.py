"""``kvreuse serve --kv-events-endpoint`` as a real subprocess: a ZMQ subscriber process
(plain pyzmq + msgpack), the SSE stream and /v1/kv_cache_state agree on the block set."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from kvreuse.events.records import event_from_json
from tests.events.event_helpers import CacheMirror, dumping_subscriber
from tests.serve_process import free_port, running_server
from tests.events.test_event_engine import wire_blocks
from tests.events.test_event_routes import read_sse

DUMPING_SUBSCRIBER = dumping_subscriber(r"""
blocks = {}
def apply(payload):
    for e in msgpack.unpackb(payload)[1]:
        if e[0] == "BlockStored":
            parent = e[2]
            for h in e[1]:
                blocks[h] = parent; parent = h
        elif e[0] == "BlockRemoved":
            for h in e[1]: blocks.pop(h, None)
        elif e[0] == "AllBlocksCleared":
            blocks.clear()
""", '{str(h): p for h, p in blocks.items()}')


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--model", "tiny:llama", "--kv-cache-memory", "0.0002", "--max-model-len", "512",
            "--served-model-name", "tiny", "--kv-events-endpoint", f"tcp://*:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://*:{replay_port}", "--log-level", "warning"]
    with running_server(port, args, log) as url:
        yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"


def test_zmq_sse_and_state_agree_on_a_running_server(serve):
    url, pub_ep, replay_ep = serve
    sub = subprocess.Popen([sys.executable, "-c", DUMPING_SUBSCRIBER, pub_ep, replay_ep],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sub.stdout.readline().strip() == "ready"
        system = "You are a helpful assistant who answers briefly and precisely. " * 4
        for i in range(10):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": system + f"Question {i}: what is {i} plus {i}?", "max_tokens": 40,
                "temperature": 0})
            assert r.status_code == 200, r.text
        state = httpx.get(f"{url}/v1/kv_cache_state").json()
        assert state["blocks"] and state["num_dropped"] == 0
        deadline = time.monotonic() + 30
        while True:  # the server is idle now: the subscriber converges on the snapshot
            sub.stdin.write("dump\n")
            sub.stdin.flush()
            if json.loads(sub.stdout.readline()) == wire_blocks(state):
                break
            assert time.monotonic() < deadline, "ZMQ view never matched /v1/kv_cache_state"
            time.sleep(0.2)
    finally:
        sub.kill()

    with httpx.stream("GET", f"{url}/v1/kv_cache_events/stream", params={"after": -1}, timeout=30) as response:
        messages = read_sse(response, state["last_event_id"] + 1)
    mirror = CacheMirror()
    assert mirror.apply_all(event_from_json(m["data"]) for m in messages)
    assert {h.hex(): m.parent_hash.hex() if m.parent_hash else None for h, m in mirror.blocks.items()} == {
        b["block_hash"]: b["parent_hash"] for b in state["blocks"]}
    removed = any(m["data"]["data"]["type"] == "removed" for m in messages)
    assert removed  # the small pool evicted: removals travelled too
