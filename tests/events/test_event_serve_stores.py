"""``kvreuse serve`` with every tier (a small device pool, a host tier, a disk directory with a
cap of a few blocks, a real redis-server) publishing ZMQ events: an independent subscriber
process (plain pyzmq + msgpack, nothing of kvreuse) keeps one block set per medium (GPU, CPU,
DISK, REMOTE) and, after a run that moves blocks through every tier (offload, spill, write-
through, cap evictions, refused corrupted files, a flushed Redis found missing), rebuilds
exactly the per-level sets of /v1/kv_cache_state."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import redis

from tests.events.event_helpers import dumping_subscriber
from tests.serve_process import free_port, running_server
from tests.tiers.redis_server import RedisServer

LEVEL_SUBSCRIBER = dumping_subscriber(r"""
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
""", '{"levels": {m: h for m, h in levels.items() if h}, "stored": stored, "removed": removed}')

U64 = 2**64 - 1
DOCS = ["Document %d: " % i + f"the quick brown fox {i} jumps over the lazy dog {i}. " * 10 for i in range(8)]


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
    args = ["--model", "tiny:llama", "--kv-cache-memory", "0.0002", "--host-cache-memory", "0.0002",
            "--disk-cache-dir", str(disk), "--disk-cache-size", "0.0002", "--remote-cache", redis_server.url,
            "--max-model-len", "512", "--served-model-name", "tiny", "--kv-events-endpoint", f"tcp://*:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://*:{replay_port}", "--log-level", "warning"]
    try:
        with running_server(port, args, work / "serve.log") as url:
            yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", disk, redis_server.url
    finally:
        redis_server.stop()


def run_docs(url: str, docs=DOCS) -> list[dict]:
    out = []
    for doc in docs:
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": doc + "Summary:", "max_tokens": 2, "temperature": 0})
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
    sub = subprocess.Popen([sys.executable, "-c", LEVEL_SUBSCRIBER, pub_ep, replay_ep],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
