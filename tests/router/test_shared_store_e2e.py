"""Two ``kvreuse serve`` executors sharing one real redis-server behind ``kvreuse route``: a
prompt computed on A is written through to Redis, and the router counts its blocks as
reachable from B at the REMOTE weight (from B's ``remote_store`` identity and A's REMOTE
events), exactly; B then hits them (read back from Redis) and holds them on its device."""

from __future__ import annotations

import time

import httpx
import pytest

from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS
from tests.tiers.redis_server import RedisServer

from .cluster import Proc, free_port, router, wait_healthy

PROMPT = " ".join(f"clause number {i} of the shared system prompt;" for i in range(40))


def tiered_executor(port: int, log_dir: str, redis_url: str) -> Proc:
    return Proc(["serve", "--model", "tiny:llama", "--port", str(port), "--device", "cpu",
                 "--kv-cache-memory", "0.01", "--host-cache-memory", "0.01", "--max-model-len", "1024",
                 "--remote-cache", redis_url, "--event-buffer-max-size", "10000", "--log-level", "warning"],
                f"{log_dir}/executor-{port}.log")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    logs = tmp_path_factory.mktemp("shared")
    redis_server = RedisServer(logs)
    if redis_server.binary is None:
        pytest.skip("redis-server not on PATH (apt-get install redis-server; .ci/run installs it)")
    redis_server.start()
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    execs = [tiered_executor(p, str(logs), redis_server.url).start() for p in ports]
    route_port = free_port()
    # a loaded machine may take minutes to start two executors: the router waits for them
    procs = [*execs, router(route_port, urls, str(logs), "--seed", "0", "--startup-timeout", "300").start()]
    try:
        wait_healthy(f"http://127.0.0.1:{route_port}", procs, timeout=300, all_of=2)
        yield urls, f"http://127.0.0.1:{route_port}"
    finally:
        for p in procs:
            p.stop()
        redis_server.stop()


def explain_until(router_url: str, done, timeout: float = 30.0) -> dict:
    """``/v1/route/explain`` of PROMPT until ``done(overlaps by executor)`` (events are async)."""
    deadline = time.monotonic() + timeout
    while True:
        d = httpx.post(f"{router_url}/v1/route/explain", json={"prompt": PROMPT}, timeout=10).json()
        overlaps = {e["executor"]: e["overlap_blocks"] for e in d["executors"]}
        if done(overlaps) or time.monotonic() > deadline:
            return d | {"overlaps": overlaps}
        time.sleep(0.1)


def complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_blocks_written_by_one_executor_are_reachable_from_the_other_at_the_remote_weight(shared):
    (a, b), route = shared
    info_a, info_b = (httpx.get(f"{u}/v1/kvreuse/info").json() for u in (a, b))
    assert info_a["remote_store"] == info_b["remote_store"] and len(info_a["remote_store"]) == 16
    assert "127.0.0.1" not in info_a["remote_store"] and info_a["cache_levels"] == ["GPU", "CPU", "REMOTE"]
    usage = complete(a)  # computed on A only; written through to Redis
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    n = usage["prompt_tokens"] // 16  # full blocks: on A's device and in Redis
    remote_weight = DEFAULT_TIER_WEIGHTS["REMOTE"]
    d = explain_until(route, lambda o: o[b] > 0)
    assert d["prompt_blocks"] == n
    assert d["overlaps"] == {a: float(n), b: float(sum([remote_weight] * n))}  # B: every block, through Redis
    assert d["choice"] == a  # equal load: the device copy wins
    on_b = complete(b)  # B reads them back from the store it shares
    assert on_b["prompt_tokens_details"]["cached_tokens_by_tier"]["remote"] == (usage["prompt_tokens"] - 1) // 16 * 16
    d = explain_until(route, lambda o: o[b] == float(n))
    assert d["overlaps"] == {a: float(n), b: float(n)}  # now on B's device too
