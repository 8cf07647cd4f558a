"""``kvreuse serve --host-cache-memory`` with ZMQ events: an independent subscriber process
(plain pyzmq + msgpack) keeps one block set per medium (GPU = device pool, CPU = host tier)
and converges on /v1/kv_cache_state after a run that moves blocks down and back up."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.events.event_helpers import dumping_subscriber
from tests.serve_process import free_port, running_server

PER_MEDIUM_SUBSCRIBER = dumping_subscriber(r"""
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
""", 'blocks')

U64 = 2**64 - 1


def per_level(state: dict) -> dict:
    return {f"{b['cache_level']}:{int(b['block_hash'], 16) & U64}":
            None if b["parent_hash"] is None else int(b["parent_hash"], 16) & U64 for b in state["blocks"]}


@pytest.fixture(scope="module")
def serve_tiered(tmp_path_factory):
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--model", "tiny:llama", "--kv-cache-memory", "0.0002", "--host-cache-memory", "0.002",
            "--max-model-len", "512", "--served-model-name", "tiny", "--kv-events-endpoint", f"tcp://*:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://*:{replay_port}", "--log-level", "warning"]
    with running_server(port, args, log) as url:
        yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"


def test_subscriber_rebuilds_each_level_and_host_hits_are_cached_tokens(serve_tiered):
    url, pub_ep, replay_ep = serve_tiered
    sub = subprocess.Popen([sys.executable, "-c", PER_MEDIUM_SUBSCRIBER, pub_ep, replay_ep],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sub.stdout.readline().strip() == "ready"
        docs = ["Document %d: " % i + "the quick brown fox jumps over the lazy dog. " * 12 for i in range(6)]
        cached, by_tier = [], []
        for round_ in range(2):  # the second round finds the first round's prefixes on the host
            for doc in docs:
                r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": doc + "Summary:", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                details = r.json()["usage"]["prompt_tokens_details"]
                cached.append(details["cached_tokens"])
                by_tier.append(details["cached_tokens_by_tier"])
        assert cached[:6] == [0] * 6 and min(cached[6:]) > 0  # evicted from the device, onboarded from the host
        assert all(sum(split.values()) == n for split, n in zip(by_tier, cached))
        assert set(by_tier[0]) == {"device", "host", "disk", "remote"} and by_tier[6]["host"] > 0
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
            if json.loads(sub.stdout.readline()) == per_level(state):
                break
            assert time.monotonic() < deadline, "the per-medium ZMQ view never matched /v1/kv_cache_state"
            time.sleep(0.2)
    finally:
        sub.kill()
