"""A Redis Cluster as the shared tier, through real ``kvreuse serve`` processes (tiny
random-weight Llama, a real 3-master cluster from Debian's redis-server on loopback ports):
executors seeded with different nodes report one store identity; a 2,048-token prompt
computed on A is a remote hit on B, its blocks on all three masters; behind ``kvreuse route``
a prompt A wrote counts as reachable from B at the REMOTE weight, as with one redis-server; a
master SIGKILLed in the middle of a 40-request load fails no request, and sharing resumes once
it is back. Every figure comes from the HTTP API (usage, /metrics, /v1/kvreuse/info,
/v1/route/explain) and from the nodes."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS
from tests.router.cluster import router, wait_healthy
from tests.router.test_index_shared_store import complete as complete_text, explain_until
from tests.serve_client import complete, metric, store_events, wait_for_puts
from tests.serve_process import free_port, running_servers
from tests.tiers.redis_cluster import running_cluster

BLOCK = 16
COOLDOWN_S = 5.0  # RemoteStore's breaker cool-down: after it, the next call probes the store
TINY = [
    "--model",
    "tiny:llama",
    "--served-model-name",
    "tiny",
    "--kv-cache-memory",
    "0.004",  # ~8k tokens of the tiny model's KV
    "--host-cache-memory",
    "0.004",
    "--max-model-len",
    "4096",
    "--event-buffer-max-size",
    "10000",  # the router follows each executor's events
    "--log-level",
    "info",
]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 49000) for _ in range(n)]


def remote_puts(url: str) -> float:
    events = store_events(url, "remote")
    return events.get("puts", 0) + events.get("put_failures", 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """Executors A and B of the same model on one cluster, seeded with different nodes, and
    ``kvreuse route`` in front of them: ((A, B), router URL)."""
    logs = tmp_path_factory.mktemp("pair")
    a_args = [*TINY, "--remote-cache", cluster.url(cluster.ports[0])]
    b_args = [*TINY, "--remote-cache", cluster.url(cluster.ports[1])]
    with running_servers([(free_port(), a_args, logs / "a.log"), (free_port(), b_args, logs / "b.log")]) as urls:
        route_port = free_port()
        proc = router(route_port, urls, str(logs), "--seed", "0").start()
        try:
            wait_healthy(f"http://127.0.0.1:{route_port}", [proc], timeout=120, all_of=2)
            yield tuple(urls), f"http://127.0.0.1:{route_port}"
        finally:
            proc.stop()


@pytest.fixture(scope="module")
def pair(served):
    return served[0]


def test_a_2048_token_prompt_computed_on_a_is_a_remote_hit_on_b(pair, cluster):
    a, b = pair
    ids = {httpx.get(f"{u}/v1/kvreuse/info", timeout=30).json()["remote_store"] for u in pair}
    assert len(ids) == 1 and None not in ids  # one store: a router counts A's remote blocks as B's
    p = prompt(2048, 1)
    before = remote_puts(a)
    on_a = complete(a, p, max_tokens=6)
    assert on_a.cached_tokens == 0 and on_a.completion_tokens == 6
    assert wait_for_puts(a, "remote", before + 2048 // BLOCK)["put_failures"] == 0
    own = complete(b, p, max_tokens=6, salt="b-computes-it")
    shared = complete(b, p, max_tokens=6)
    assert shared.cached_tokens == 2048 - BLOCK  # >= prompt - one block: the last token is computed
    assert shared.by_tier["remote"] == sum(shared.by_tier.values()) == 2048 - BLOCK  # all of it from the cluster
    assert shared.text == own.text == on_a.text
    # A's 128 blocks plus B's salted chain: every key on some master, every master holds some
    assert wait_for_puts(b, "remote", 2 * 2048 // BLOCK - 2048 // BLOCK)["put_failures"] == 0
    sizes = {port: cluster.node(port).dbsize() for port in cluster.ports}
    assert sum(sizes.values()) == 2 * 2048 // BLOCK and min(sizes.values()) > 0, sizes


def test_the_router_counts_a_blocks_as_reachable_from_b_through_the_cluster(served):
    (a, b), route = served
    usage = complete_text(a)  # a text prompt computed on A only; written through to the cluster
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    n = usage["prompt_tokens"] // BLOCK
    d = explain_until(route, lambda o: o[b] > 0)
    assert d["prompt_blocks"] == n
    assert d["overlaps"] == {a: float(n), b: float(sum([DEFAULT_TIER_WEIGHTS["REMOTE"]] * n))}
    on_b = complete_text(b)  # B reads them back from the cluster
    assert on_b["prompt_tokens_details"]["cached_tokens_by_tier"]["remote"] == (usage["prompt_tokens"] - 1) // 16 * 16
    d = explain_until(route, lambda o: o[b] == float(n))
    assert d["overlaps"] == {a: float(n), b: float(n)}  # now on B's device too


def test_a_master_killed_mid_load_fails_no_request_and_sharing_resumes(pair, cluster, tiny_llama):
    from kvreuse import LLM, SamplingParams

    a, b = pair
    system = prompt(64, 3)  # a shared system prompt: device hits on each executor
    prompts = [system + prompt(40 + i, 100 + i) for i in range(40)]
    reference = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.004, enable_prefix_caching=False)
    expected = [
        o.text for o in reference.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ]
    victim = cluster.ports[2]
    killed = threading.Event()
    finished = []
    lock = threading.Lock()

    def one(i: int):
        out = complete(a if i % 2 else b, prompts[i], max_tokens=6)
        with lock:
            finished.append(i)
            if len(finished) == 20 and not killed.is_set():
                cluster.kill(victim)  # SIGKILL, as a crash: the other requests are running or waiting
                killed.set()
        return out

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(40)))
    assert killed.is_set() and len(outs) == 40
    assert [o.finish_reason for o in outs] == ["length"] * 40  # 0 failed
    assert [o.text for o in outs] == expected  # every answer right, with or without the store
    failures = {u: store_events(u, "remote") for u in pair}
    assert sum(f.get("errors", 0) + f.get("timeouts", 0) + f.get("skipped", 0) for f in failures.values()) > 0

    cluster.restart(victim)  # it rejoins as the master of its slots, empty (no persistence)
    time.sleep(COOLDOWN_S + 0.5)  # the breakers' cool-down: each executor's next call probes
    p = prompt(2048, 4)
    for url in pair:  # wake each breaker with a probe that succeeds
        complete(url, prompt(40, 7), max_tokens=1)
    before = remote_puts(a)
    assert complete(a, p).cached_tokens == 0
    assert wait_for_puts(a, "remote", before + 2048 // BLOCK, timeout_s=30)["put_failures"] == failures[a].get(
        "put_failures", 0
    )
    hit = complete(b, p)
    assert hit.cached_tokens == 2048 - BLOCK and hit.by_tier["remote"] == 2048 - BLOCK
    assert metric(a, "kvreuse:remote_tier_breaker_open") == metric(b, "kvreuse:remote_tier_breaker_open") == 0
