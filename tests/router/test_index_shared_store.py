"""Executors sharing a remote store reach each other's REMOTE blocks: the index keeps every
level an executor holds a key at, and a key held at REMOTE by one executor of a store counts
(at the REMOTE weight) for every executor of that store, and for no other. Last, the same end
to end: two ``kvreuse serve`` executors sharing a real redis-server behind ``kvreuse route``."""

from __future__ import annotations

import time

import httpx
import pytest

from kvreuse.events.records import BlocksRemoved, BlocksStored, BlockUpdated, StoredBlock
from kvreuse.router.index import KVIndex
from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS
from tests.tiers.redis_server import RedisServer

from .cluster import Proc, free_port, router, wait_healthy

W = DEFAULT_TIER_WEIGHTS  # GPU 1.0, CPU 0.997, DISK 0.992, REMOTE 0.970
KEYS = [1, 2, 3, 4, 5]


def cluster():
    index = KVIndex()
    for name in "abcd":
        index.add_executor(name)
    index.set_store("a", "store-s")
    index.set_store("b", "store-s")
    index.set_store("d", "store-t")  # another Redis (or namespace): shares nothing with a, b
    index.store("a", [1, 2, 3], "GPU")
    index.store("a", [1, 2, 3, 4], "REMOTE")  # written through; 4 only in Redis now
    index.store("b", [1], "GPU")
    index.check_integrity()
    return index


def test_remote_blocks_count_for_every_executor_of_the_store_at_the_remote_weight():
    index = cluster()
    assert index.overlaps(KEYS, list("abcd")) == {"a": 4, "b": 4, "c": 0, "d": 0}
    assert index.overlaps(KEYS, list("abcd"), W) == {
        "a": float(sum([W["GPU"], W["GPU"], W["GPU"], W["REMOTE"]])),  # its own best level per block
        "b": float(sum([W["GPU"], W["REMOTE"], W["REMOTE"], W["REMOTE"]])),  # 1 on its device, 2-4 through the store
        "c": 0.0,
        "d": 0.0,
    }
    assert index.reach(2) == index.mirror("a").bit | index.mirror("b").bit
    assert index.reachable_levels("b", 1) == {"GPU", "REMOTE"} and index.reachable_levels("c", 1) == frozenset()
    assert index.level_of("a", 1) == "GPU" and index.level_of("b", 2) is None  # its own levels only


def test_a_remote_removal_ends_the_reach_and_the_device_copy_stays():
    index = cluster()
    index.apply_record("a", BlocksRemoved((b"\x00" * 24 + (2).to_bytes(8, "big"),), "REMOTE"))
    index.check_integrity()
    assert index.mirror("a").levels[2] == {"GPU"}  # still on a's device
    assert index.overlaps(KEYS, ["a", "b"], W) == {"a": float(sum([W["GPU"]] * 3 + [W["REMOTE"]])), "b": W["GPU"]}
    index.remove("a", [1, 2, 3], "GPU")  # a's device evicts: what a holds in Redis is still a's too
    index.check_integrity()
    assert index.overlaps(KEYS, ["a", "b"], W) == {"a": W["REMOTE"], "b": W["GPU"]}


def test_store_membership_follows_set_store_and_clear_forgets_the_remote_holders():
    index = cluster()
    index.set_store("c", "store-s")  # c now shares the store
    index.set_store("b", None)  # b no longer does
    index.check_integrity()
    assert index.overlaps(KEYS, list("abc")) == {"a": 4, "b": 1, "c": 4}
    index.clear("a")  # a restarted: its announcements are gone, the store's blocks unknown
    index.check_integrity()
    assert index.remote_holders == {} and index.overlaps(KEYS, list("abc")) == {"a": 0, "b": 1, "c": 0}


def test_object_blocks_count_for_every_executor_of_the_bucket_apart_from_redis():
    index = cluster()  # a and b share Redis store-s
    index.set_store("b", "bucket-x", "OBJECT")
    index.set_store("c", "bucket-x", "OBJECT")  # c shares the bucket, not Redis
    index.store("b", [1, 2, 3, 4, 5], "OBJECT")  # b wrote the whole chain to the bucket
    index.check_integrity()
    assert index.overlaps(KEYS, list("abcd")) == {"a": 4, "b": 5, "c": 5, "d": 0}
    assert index.overlaps(KEYS, ["c"], W) == {"c": 5 * W["OBJECT"]}
    assert index.reachable_levels("c", 2) == {"OBJECT"} and index.reachable_levels("a", 5) == frozenset()
    assert index.reachable_levels("b", 2) == {"REMOTE", "OBJECT"}  # through a's Redis and its own bucket
    index.remove("b", [3, 4, 5], "OBJECT")  # the bucket lost them (a read found them absent)
    index.check_integrity()
    assert index.overlaps(KEYS, list("bc")) == {"b": 4, "c": 2}
    index.set_store("c", None, "OBJECT")
    index.clear("b")
    index.check_integrity()
    assert index.remote_holders == {k: index.mirror("a").bit for k in (1, 2, 3, 4)}  # a's Redis blocks stay
    assert index.overlaps(KEYS, list("bc")) == {"b": 4, "c": 0}  # b still reaches them through Redis


def test_a_block_held_at_two_levels_survives_a_move_of_one_of_them():
    index = KVIndex()
    index.add_executor("a")
    h = b"\x00" * 24 + (7).to_bytes(8, "big")
    index.apply_record("a", BlocksStored(None, (StoredBlock(h, (1, 2), 35, "GPU"),), 2))
    index.apply_record("a", BlocksStored(None, (StoredBlock(h, (1, 2), 35, "DISK"),), 2))  # a disk copy
    index.apply_record("a", BlockUpdated(h, old_cache_level="GPU", new_cache_level="CPU"))
    assert index.mirror("a").levels[7] == {"CPU", "DISK"}
    index.apply_record("a", BlocksRemoved((h,), "CPU"))
    assert index.mirror("a").levels[7] == {"DISK"} and index.overlaps([7], ["a"], W) == {"a": W["DISK"]}
    index.apply_record("a", BlocksRemoved((h,), None))  # no level named: gone everywhere
    index.check_integrity()
    assert index.mirror("a").levels == {} and index.holders == {}


def test_the_shared_store_sends_a_request_to_an_idle_executor_of_the_store():
    import random

    from kvreuse.router.policy import Candidate, KVPolicy, choose

    index = cluster()
    load = {"a": 6.0, "b": 0.0, "c": 0.0}  # a is busy; b and c idle
    overlaps = index.overlaps(KEYS, list("abc"), W)
    cands = [Candidate(n, overlaps[n], len(KEYS), load[n], 0) for n in "abc"]
    decision = choose(KVPolicy(overlap_weight=8.0), cands, random.Random(0))
    assert decision.scores == {"a": 8.0 * (5 - overlaps["a"]) + 6.0, "b": 8.0 * (5 - overlaps["b"]), "c": 40.0}
    assert decision.choice == "b"  # 4 blocks it can read back from Redis, and no queue
    index.set_store("b", None)  # without the shared store, b holds 1 block: busy a wins
    overlaps = index.overlaps(KEYS, list("abc"), W)
    cands = [Candidate(n, overlaps[n], len(KEYS), load[n], 0) for n in "abc"]
    assert overlaps["b"] == W["GPU"] and choose(KVPolicy(overlap_weight=8.0), cands, random.Random(0)).choice == "a"


# Two ``kvreuse serve`` executors sharing one real redis-server behind ``kvreuse route``: a
# prompt computed on A is written through to Redis, and the router counts its blocks as
# reachable from B at the REMOTE weight (from B's ``remote_store`` identity and A's REMOTE
# events), exactly; B then hits them (read back from Redis) and holds them on its device.
PROMPT = " ".join(f"clause number {i} of the shared system prompt;" for i in range(40))


def tiered_executor(port: int, log_dir: str, redis_url: str) -> Proc:
    return Proc(
        [
            "serve",
            "--model",
            "tiny:llama",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "0.01",
            "--host-cache-memory",
            "0.01",
            "--max-model-len",
            "1024",
            "--remote-cache",
            redis_url,
            "--event-buffer-max-size",
            "10000",
            "--log-level",
            "warning",
        ],
        f"{log_dir}/executor-{port}.log",
    )


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
