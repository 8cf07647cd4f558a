"""``kvreuse serve --kv-events-endpoint`` as a real subprocess: a ZMQ subscriber process
(plain pyzmq + msgpack), the SSE stream and /v1/kv_cache_state agree on the block set; with
a host tier, and with every tier (host, disk, a real redis-server), the subscriber rebuilds
each level of /v1/kv_cache_state."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import redis

from kvreuse.events.records import event_from_json
from tests.events.event_helpers import CacheMirror, dumping_subscriber
from tests.events.test_event_engine import wire_blocks
from tests.serve_process import free_port, running_server
from tests.server.test_events_routes import read_sse
from tests.tiers.redis_server import RedisServer

DUMPING_SUBSCRIBER = dumping_subscriber(
    r"""
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
""",
    '{str(h): p for h, p in blocks.items()}',
)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [
        "--model",
        "tiny:llama",
        "--kv-cache-memory",
        "0.0002",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--kv-events-endpoint",
        f"tcp://*:{pub_port}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{replay_port}",
        "--log-level",
        "warning",
    ]
    with running_server(port, args, log) as url:
        yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"


def test_zmq_sse_and_state_agree_on_a_running_server(serve):
    url, pub_ep, replay_ep = serve
    sub = subprocess.Popen(
        [sys.executable, "-c", DUMPING_SUBSCRIBER, pub_ep, replay_ep],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sub.stdout.readline().strip() == "ready"
        system = "You are a helpful assistant who answers briefly and precisely. " * 4
        for i in range(10):
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=120,
                json={
                    "model": "tiny",
                    "prompt": system + f"Question {i}: what is {i} plus {i}?",
                    "max_tokens": 40,
                    "temperature": 0,
                },
            )
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
        b["block_hash"]: b["parent_hash"] for b in state["blocks"]
    }
    removed = any(m["data"]["data"]["type"] == "removed" for m in messages)
    assert removed  # the small pool evicted: removals travelled too


# ``kvreuse serve --host-cache-memory`` with ZMQ events: an independent subscriber process
# (plain pyzmq + msgpack) keeps one block set per medium (GPU = device pool, CPU = host tier)
# and converges on /v1/kv_cache_state after a run that moves blocks down and back up.
PER_MEDIUM_SUBSCRIBER = dumping_subscriber(
    r"""
blocks = {}
def apply(payload):
    for e in msgpack.unpackb(payload)[1]:
        if e[0] == "BlockStored":  # [tag, hashes, parent, tokens, block_size, lora_id, medium, ...]
            parent = e[2]
            for h in e[1]:
                blocks[f"{e[6]}:{h}"] = parent; parent = h
        elif e[0] == "BlockRemoved":  # [tag, hashes, medium]
            for h in e[1]: blocks.pop(f"{e[2]}:{h}", None)
        elif e[0] == "AllBlocksCleared":
            blocks.clear()
""",
    'blocks',
)
U64 = 2**64 - 1


def keyed_levels(state: dict) -> dict:
    return {
        f"{b['cache_level']}:{int(b['block_hash'], 16) & U64}": None
        if b["parent_hash"] is None
        else int(b["parent_hash"], 16) & U64
        for b in state["blocks"]
    }


@pytest.fixture(scope="module")
def serve_tiered(tmp_path_factory):
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [
        "--model",
        "tiny:llama",
        "--kv-cache-memory",
        "0.0002",
        "--host-cache-memory",
        "0.002",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--kv-events-endpoint",
        f"tcp://*:{pub_port}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{replay_port}",
        "--log-level",
        "warning",
    ]
    with running_server(port, args, log) as url:
        yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"


def test_subscriber_rebuilds_each_level_and_host_hits_are_cached_tokens(serve_tiered):
    url, pub_ep, replay_ep = serve_tiered
    sub = subprocess.Popen(
        [sys.executable, "-c", PER_MEDIUM_SUBSCRIBER, pub_ep, replay_ep],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sub.stdout.readline().strip() == "ready"
        docs = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * 12 for i in range(6)]
        cached, by_tier = [], []
        for _round in range(2):  # the second round finds the first round's prefixes on the host
            for doc in docs:
                r = httpx.post(
                    f"{url}/v1/completions",
                    timeout=120,
                    json={"model": "tiny", "prompt": doc + "Summary:", "max_tokens": 4, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                details = r.json()["usage"]["prompt_tokens_details"]
                cached.append(details["cached_tokens"])
                by_tier.append(details["cached_tokens_by_tier"])
        assert cached[:6] == [0] * 6 and min(cached[6:]) > 0  # evicted from the device, onboarded from the host
        assert all(sum(split.values()) == n for split, n in zip(by_tier, cached))
        assert set(by_tier[0]) == {"device", "host", "disk", "remote", "object"} and by_tier[6]["host"] > 0
        host_hits = sum(split["host"] for split in by_tier)
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvreuse:prefix_cache_hits_by_tier_total{{model_name="tiny",tier="host"}} {float(host_hits)}' in metrics
        assert 'kvreuse:kv_tier_blocks_moved_total{direction="device_to_host",model_name="tiny"}' in metrics
        state = httpx.get(f"{url}/v1/kv_cache_state").json()
        levels = {b["cache_level"] for b in state["blocks"]}
        assert levels == {"GPU", "CPU"}
        deadline = time.monotonic() + 30
        while True:
            sub.stdin.write("dump\n")
            sub.stdin.flush()
            if json.loads(sub.stdout.readline()) == keyed_levels(state):
                break
            assert time.monotonic() < deadline, "the per-medium ZMQ view never matched /v1/kv_cache_state"
            time.sleep(0.2)
    finally:
        sub.kill()


# ``kvreuse serve`` with every tier (a small device pool, a host tier, a disk directory with a
# cap of a few blocks, a real redis-server) publishing ZMQ events: an independent subscriber
# process (plain pyzmq + msgpack, nothing of kvreuse) keeps one block set per medium (GPU, CPU,
# DISK, REMOTE) and, after a run that moves blocks through every tier (offload, spill, write-
# through, cap evictions, refused corrupted files, a flushed Redis found missing), rebuilds
# exactly the per-level sets of /v1/kv_cache_state.
LEVEL_SUBSCRIBER = dumping_subscriber(
    r"""
levels, stored, removed = {}, {}, {}
def apply(payload):
    for e in msgpack.unpackb(payload)[1]:
        if e[0] == "BlockStored":  # [tag, hashes, parent, tokens, block_size, lora_id, medium, ...]
            parent, held = e[2], levels.setdefault(e[6], {})
            for h in e[1]:
                held[str(h)] = parent; parent = h
            stored[e[6]] = stored.get(e[6], 0) + len(e[1])
        elif e[0] == "BlockRemoved":  # [tag, hashes, medium]
            for medium, held in levels.items():
                if e[2] in (None, medium):
                    for h in e[1]: held.pop(str(h), None)
            removed[e[2]] = removed.get(e[2], 0) + len(e[1])
        elif e[0] == "AllBlocksCleared":
            levels.clear()
""",
    '{"levels": {m: h for m, h in levels.items() if h}, "stored": stored, "removed": removed}',
)
DOCS = [f"Document {i}: " + f"the quick brown fox {i} jumps over the lazy dog {i}. " * 10 for i in range(8)]


def per_level(state: dict) -> dict:
    """The snapshot's blocks as the subscriber keeps them: medium -> wire hash -> wire parent."""
    out: dict[str, dict[str, int | None]] = {}
    for b in state["blocks"]:
        parent = None if b["parent_hash"] is None else int(b["parent_hash"], 16) & U64
        out.setdefault(b["cache_level"], {})[str(int(b["block_hash"], 16) & U64)] = parent
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus page (labels in any order, ``model_name`` implied)."""
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}\{{([^}}]*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"{name} {labels} not on /metrics")


@pytest.fixture(scope="module")
def serve_all_tiers(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-stores")
    redis_server = RedisServer(work)
    if redis_server.binary is None:
        pytest.skip("redis-server not on PATH (apt-get install redis-server; .ci/run installs it)")
    redis_server.start()
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    disk = work / "disk"
    args = [
        "--model",
        "tiny:llama",
        "--kv-cache-memory",
        "0.0002",
        "--host-cache-memory",
        "0.0002",
        "--disk-cache-dir",
        str(disk),
        "--disk-cache-size",
        "0.0002",
        "--remote-cache",
        redis_server.url,
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--kv-events-endpoint",
        f"tcp://*:{pub_port}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{replay_port}",
        "--log-level",
        "warning",
    ]
    try:
        with running_server(port, args, work / "serve.log") as url:
            yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", disk, redis_server.url
    finally:
        redis_server.stop()


def run_docs(url: str, docs=DOCS) -> list[dict]:
    out = []
    for doc in docs:
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": doc + "Summary:", "max_tokens": 2, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"])
    return out


def writes_done(url: str, timeout: float = 60.0) -> str:
    """/metrics once no disk / remote write is queued or in progress."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        if metric(text, "kvreuse:kv_tier_writes_pending") == 0:
            return text
        assert time.monotonic() < deadline, "the tier writer never finished"
        time.sleep(0.1)


def test_subscriber_rebuilds_every_level_of_every_tier_exactly(serve_all_tiers):
    url, pub_ep, replay_ep, disk, redis_url = serve_all_tiers
    sub = subprocess.Popen(
        [sys.executable, "-c", LEVEL_SUBSCRIBER, pub_ep, replay_ep],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sub.stdout.readline().strip() == "ready"
        run_docs(url)  # computed: written through to disk and Redis; the host spills, the disk cap evicts
        again = run_docs(url, DOCS[::-1])  # newest first: found on the device, then the host, then below
        writes_done(url)
        for path in disk.rglob("*.kvb"):  # every block file on disk corrupted: refused when read
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        refused = run_docs(url)
        writes_done(url)
        redis.Redis.from_url(redis_url).flushall()  # Redis loses everything, unseen
        run_docs(url)
        text = writes_done(url)
        assert sum(t["host"] for t in again) > 0 and sum(t["remote"] for t in again + refused) > 0
        assert metric(text, "kvreuse:disk_tier_events_total", event="corrupt") > 0
        for _ in range(5):  # quiescent: a snapshot, the wire caught up with it, nothing after it
            state = httpx.get(f"{url}/v1/kv_cache_state").json()
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/v1/kvreuse/info").json()["events"]["zmq_last_event_id"] < state["last_event_id"]:
                assert time.monotonic() < deadline, "the publisher never reached the snapshot's event"
                time.sleep(0.05)
            sub.stdin.write("dump\n")
            sub.stdin.flush()
            seen = json.loads(sub.stdout.readline())
            if httpx.get(f"{url}/v1/kv_cache_state").json()["last_event_id"] == state["last_event_id"]:
                break
        else:
            pytest.fail("events kept coming after the run")
        assert seen["levels"] == per_level(state)
        assert set(seen["levels"]) == {"GPU", "CPU", "DISK", "REMOTE"}
        assert all(seen["removed"].get(level, 0) > 0 for level in ("GPU", "CPU", "DISK", "REMOTE"))
        text = httpx.get(f"{url}/metrics").text
        for level, tier in (("CPU", "host"), ("DISK", "disk"), ("REMOTE", "remote")):
            assert metric(text, "kvreuse:kv_tier_blocks_stored_total", tier=tier) == seen["stored"][level]
            assert metric(text, "kvreuse:kv_tier_blocks_removed_total", tier=tier) == seen["removed"][level]
            assert metric(text, "kvreuse:kv_tier_blocks_held", tier=tier) == len(seen["levels"][level])
    finally:
        sub.kill()
