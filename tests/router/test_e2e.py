"""End to end: three ``kvreuse serve`` processes (tiny random Llama) behind two routers
(``kv`` and ``round_robin``), all separate processes on loopback.

The story: long shared prefixes land on the executor holding them through the kv router
(``cached_tokens`` > 0) and not through round robin; then one executor is killed in the
middle of a burst and every request still completes; once it is back, it is used again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .cluster import executor, free_port, router, wait_healthy

EXECUTOR_HEADER = "x-kvreuse-executor"


def _prefix(seed: int) -> str:
    """~300 tokens, distinct per seed."""
    return " ".join(f"clause{seed} number {i} of the shared system prompt;" for i in range(40))


def _complete(url: str, prompt: str, *, stream: bool = False, max_tokens: int = 2) -> tuple[str, int, str]:
    """(executor, cached tokens, text) of one completion through ``url``."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
            import json

            usage = json.loads(lines[-1][6:])["usage"]
            return r.headers[EXECUTOR_HEADER], usage["prompt_tokens_details"]["cached_tokens"], ""
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()
    return r.headers[EXECUTOR_HEADER], d["usage"]["prompt_tokens_details"]["cached_tokens"], d["choices"][0]["text"]


def _wait_indexed(router_url: str, prompt: str, timeout: float = 10.0) -> dict:
    """Explain until some executor is known to hold the prompt's blocks (events are async)."""
    deadline = time.monotonic() + timeout
    while True:
        d = httpx.post(f"{router_url}/v1/route/explain", json={"prompt": prompt}, timeout=10).json()
        if any(e["overlap_blocks"] > 0 for e in d["executors"]) or time.monotonic() > deadline:
            return d
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("cluster"))
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    execs = {url: executor(port, logs).start() for url, port in zip(urls, ports)}
    kv_port, rr_port = free_port(), free_port()
    state = {
        "urls": urls,
        "execs": execs,
        "ports": dict(zip(urls, ports)),
        "logs": logs,
        "kv": f"http://127.0.0.1:{kv_port}",
        "rr": f"http://127.0.0.1:{rr_port}",
    }
    routers = []
    try:
        for url in urls:  # before the routers, which wait only --startup-timeout for their executors
            wait_healthy(url, list(execs.values()), timeout=300)
        routers += [
            router(kv_port, urls, logs, "--seed", "0").start(),
            router(rr_port, urls, logs, "--routing-policy", "round_robin").start(),
        ]
        procs = [*execs.values(), *routers]
        wait_healthy(state["kv"], procs, all_of=3)
        wait_healthy(state["rr"], procs, all_of=3)
        yield state
    finally:
        for p in [*routers, *state["execs"].values()]:
            p.stop()


def test_shared_prefixes_land_on_their_holder_through_kv_routing(cluster):
    kv = cluster["kv"]
    for seed in range(3):
        prefix = _prefix(seed)
        first, cached, _ = _complete(kv, prefix + " user 0")
        assert cached == 0
        explain = _wait_indexed(kv, prefix + " user 1")
        assert explain["choice"] == first
        for user in range(1, 3):
            where, cached, _ = _complete(kv, f"{prefix} user {user}", stream=user == 2)
            assert where == first
            assert cached >= 256  # the shared prefix (16 full blocks or more) was reused


def test_round_robin_spreads_them_and_misses(cluster):
    rr = cluster["rr"]
    prefix = _prefix(100)
    results = [_complete(rr, f"{prefix} user {u}") for u in range(3)]
    assert len({where for where, _, _ in results}) == 3
    assert all(cached == 0 for _, cached, _ in results)


def test_killed_executor_costs_no_request_and_comes_back(cluster):
    kv, rr = cluster["kv"], cluster["rr"]
    prefix = _prefix(200)
    victim, _, _ = _complete(kv, prefix + " warm")
    _wait_indexed(kv, prefix + " x")

    def one(i: int):
        return _complete(kv if i % 2 else rr, f"{prefix} burst {i}", stream=i % 3 == 0, max_tokens=8)

    # Killed before the router's next health check: it still looks alive, so the burst's
    # requests for the shared prefix are routed to it, refused, and retried elsewhere. (A
    # stream already forwarding tokens when its executor dies: test_migration_e2e.py.)
    cluster["execs"][victim].kill()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        results = [f.result(timeout=60) for f in futures]  # raises if any request failed
    assert len(results) == 24
    after = [_complete(kv, f"{prefix} after {i}")[0] for i in range(6)]
    assert victim not in after  # never sent to a dead executor
    health = httpx.get(f"{kv}/v1/route/executors").json()  # /health names no executor
    assert not next(e for e in health["executors"] if e["url"] == victim)["healthy"]

    cluster["execs"][victim] = executor(cluster["ports"][victim], cluster["logs"]).start()
    wait_healthy(kv, list(cluster["execs"].values()), all_of=3)
    wait_healthy(rr, list(cluster["execs"].values()), all_of=3)
    assert victim in {_complete(rr, f"{prefix} back {i}")[0] for i in range(3)}
    used = set()
    for i in range(30):
        used.add(_complete(kv, f"fresh prompt {i} " + _prefix(300 + i))[0])
        if victim in used:
            break
    assert victim in used
