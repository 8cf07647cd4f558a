"""Tiers through real ``kvreuse serve`` processes (tiny random-weight Llama, a real
redis-server on a free loopback port): two executors share a prefix through Redis; Redis
killed in the middle of a 40-request load fails no request and sharing resumes once it is
back; a restarted executor hits its own disk; a corrupted block file is refused (log line,
/metrics counter) and the answer stays right; different cache salts share nothing in any
tier, across executors. Every figure comes from the HTTP API (usage, /metrics)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve_client import block_file, block_keys, complete, flip_byte, metric, store_events, wait_for_puts
from tests.serve_process import free_port, running_server, running_servers
from tests.tiers.redis_server import RedisServer

BLOCK = 16
NEW = 6  # 250 prompt + 6 new tokens: KV for 255, so decoding completes no block (exact write counts)
COOLDOWN_S = 5.0  # RemoteStore's breaker cool-down: after it, the next call probes the store
TINY = [
    "--model",
    "tiny:llama",
    "--served-model-name",
    "tiny",
    "--kv-cache-memory",
    "0.002",
    "--host-cache-memory",
    "0.004",
    "--max-model-len",
    "1024",
    "--log-level",
    "info",
]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 49000) for _ in range(n)]


def full_blocks(n: int) -> int:
    """Blocks written through for an ``n``-token prompt: its full blocks."""
    return n // BLOCK


def reusable(n: int) -> int:
    """Cached tokens a repeat of an ``n``-token prompt reports: its full blocks, less the last
    one when the prompt ends on a block boundary (the last token is always computed)."""
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    if server.binary is None:
        pytest.skip("redis-server not on PATH (apt-get install redis-server; .ci/run installs it)")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(redis, tmp_path_factory):
    """Executors A and B of the same model on one Redis (A also has a disk tier)."""
    logs = tmp_path_factory.mktemp("pair")
    a_args = [*TINY, "--remote-cache", redis.url, "--disk-cache-dir", str(logs / "disk-a")]
    b_args = [*TINY, "--remote-cache", redis.url]
    with running_servers([(free_port(), a_args, logs / "a.log"), (free_port(), b_args, logs / "b.log")]) as urls:
        yield tuple(urls)


def remote_puts(url: str) -> float:
    events = store_events(url, "remote")
    return events.get("puts", 0) + events.get("put_failures", 0)


def test_a_prefix_computed_on_a_is_a_remote_hit_on_b_with_the_same_greedy_text(pair):
    a, b = pair
    p = prompt(250, 1)
    before = remote_puts(a)
    on_a = complete(a, p, max_tokens=NEW)
    assert on_a.cached_tokens == 0 and on_a.completion_tokens == NEW
    assert wait_for_puts(a, "remote", before + full_blocks(250))["put_failures"] == 0
    own = complete(b, p, max_tokens=NEW, salt="b-computes-it")  # B computing it itself
    assert own.cached_tokens == 0
    shared = complete(b, p, max_tokens=NEW)
    assert shared.cached_tokens == reusable(250) == 240
    assert shared.by_tier == {"device": 0, "host": 0, "disk": 0, "remote": 240, "object": 0}
    assert shared.text == own.text == on_a.text
    assert metric(b, "kvreuse:prefix_cache_hits_by_tier_total", tier="remote") >= 240


def test_salts_share_nothing_in_any_tier_across_executors(pair, redis):
    import redis as redis_client

    a, b = pair
    p = prompt(200, 2)
    keys = {salt: block_keys(a, p, salt) for salt in ("tenant-1", "tenant-2", None)}
    assert not set(keys["tenant-1"]) & set(keys["tenant-2"]) and not set(keys["tenant-1"]) & set(keys[None])
    before = remote_puts(a)
    assert complete(a, p, salt="tenant-1").cached_tokens == 0
    wait_for_puts(a, "remote", before + full_blocks(200))
    # A holds tenant-1's chain on its device and its disk: tenant-2 and no salt see none of it
    for salt in ("tenant-2", None):
        other = complete(a, p, salt=salt)
        assert other.cached_tokens == 0 and set(other.by_tier.values()) == {0}, salt
    wait_for_puts(a, "remote", before + 3 * full_blocks(200))
    # B: Redis holds all three chains; each salt finds only its own
    for salt in ("tenant-1", "tenant-2", None):
        hit = complete(b, p, salt=salt)
        assert hit.cached_tokens == reusable(200) and hit.by_tier["remote"] == reusable(200), salt
    third = complete(b, p, salt="tenant-3")
    assert third.cached_tokens == 0 and set(third.by_tier.values()) == {0}
    stored = redis_client.Redis.from_url(redis.url)
    for salt, chain in keys.items():  # three chains, each under its own keys in the one database
        assert sum(len(list(stored.scan_iter(f"kvreuse:v1:*:{bytes(key).hex()}"))) for key in chain) == full_blocks(
            200
        ), salt


def test_redis_killed_mid_load_fails_no_request_and_sharing_resumes(pair, redis, tiny_llama):
    from kvreuse import LLM, SamplingParams

    a, b = pair
    system = prompt(48, 3)  # a shared system prompt: device hits on each executor
    prompts = [system + prompt(40 + i, 100 + i) for i in range(40)]
    reference = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.002, enable_prefix_caching=False)
    expected = [
        o.text for o in reference.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ]
    killed = threading.Event()
    finished = []
    lock = threading.Lock()

    def one(i: int):
        out = complete(a if i % 2 else b, prompts[i], max_tokens=6)
        with lock:
            finished.append(i)
            if len(finished) == 20 and not killed.is_set():
                redis.stop()  # SIGKILL, as a crash: the other requests are running or waiting
                killed.set()
        return out

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(40)))
    assert killed.is_set() and len(outs) == 40
    assert [o.finish_reason for o in outs] == ["length"] * 40
    assert [o.text for o in outs] == expected  # every answer right, with or without the store
    failures = {u: store_events(u, "remote") for u in (a, b)}
    assert sum(f.get("errors", 0) + f.get("timeouts", 0) + f.get("skipped", 0) for f in failures.values()) > 0
    assert metric(a, "kvreuse:remote_tier_breaker_open") + metric(b, "kvreuse:remote_tier_breaker_open") >= 1

    redis.start()  # the same port, empty (no persistence)
    time.sleep(COOLDOWN_S + 0.5)  # the breakers' cool-down: each executor's next call probes
    p = prompt(250, 4)
    before = remote_puts(a)
    assert complete(a, p).cached_tokens == 0
    assert wait_for_puts(a, "remote", before + full_blocks(250), timeout_s=30)
    hit = complete(b, p)
    assert hit.cached_tokens == 240 and hit.by_tier["remote"] == 240
    assert metric(a, "kvreuse:remote_tier_breaker_open") == metric(b, "kvreuse:remote_tier_breaker_open") == 0


def test_a_restarted_executor_hits_its_disk_and_refuses_a_corrupted_file(tmp_path):
    disk = tmp_path / "disk"
    args = [*TINY, "--disk-cache-dir", str(disk)]
    p, q = prompt(250, 5), prompt(250, 6)
    with running_server(free_port(), args, tmp_path / "first.log") as url:
        first = [complete(url, x, max_tokens=NEW) for x in (p, q)]
        keys = block_keys(url, q)
        assert [f.cached_tokens for f in first] == [0, 0] and len(keys) == 15
    # stopped right after the answers: the graceful stop finishes the queued writes
    assert len(list(disk.rglob("*.kvb"))) == 30
    victim = block_file(disk, keys[6])
    flip_byte(victim)
    damaged_bytes = victim.read_bytes()
    log = tmp_path / "second.log"
    with running_server(free_port(), args, log) as url:
        again = complete(url, p, max_tokens=NEW)  # the first repeat after the restart
        assert again.cached_tokens == 240 and again.by_tier == {
            "device": 0,
            "host": 0,
            "disk": 240,
            "remote": 0,
            "object": 0,
        }
        assert again.text == first[0].text
        assert store_events(url, "disk")["puts"] == 0  # hits are not written again
        damaged = complete(url, q, max_tokens=NEW)
        assert damaged.cached_tokens == 6 * BLOCK and damaged.by_tier["disk"] == 6 * BLOCK  # blocks 0-5
        assert damaged.text == first[1].text
        assert metric(url, "kvreuse:disk_tier_events_total", event="corrupt") == 1
        events = wait_for_puts(url, "disk", 9)  # blocks 6..14 recomputed and written through again
        assert events["puts"] == 9 and events["hits"] == 15 + 6
    assert f"refused corrupt block file {victim}" in log.read_text()
    assert victim.read_bytes() != damaged_bytes  # the refused file was replaced by the recomputed block
