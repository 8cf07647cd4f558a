"""The remote tier against a real redis-server: round trip, isolation, a crash and a restart."""

import logging
import threading
import time

import pytest
import redis
import torch

from kvreuse.tiers.block_codec import encode_block
from kvreuse.tiers.circuit_breaker import BreakerState
from kvreuse.tiers.namespace import TierNamespace
from kvreuse.tiers.remote_store import RemoteStore

from .conftest import BLOCK_SIZE, NS, OTHER_MODEL, SHAPE, make_payload, make_record


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _store(server, namespace=NS, **kwargs):
    kwargs = {"timeout_s": 0.3, "failure_threshold": 3, "cooldown_s": 5.0} | kwargs
    return RemoteStore(server.url, namespace=namespace, **kwargs)


def test_round_trip_and_key_layout(redis_server):
    store = _store(redis_server)
    key, payload = make_payload(1)
    assert store.get(key) is None and not store.contains(key)
    assert store.put(key, payload)
    assert store.contains(key)
    record = store.get(key, shape=SHAPE, dtype=torch.float32)
    assert torch.equal(record.kv, make_record(1).kv) and record.token_ids == (4, 5, 6, 7)
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.keys("*") == [f"kvreuse:v1:{NS.tag}:{key.hex()}".encode()]
    assert raw.get(store.redis_key(key)) == payload and raw.ttl(store.redis_key(key)) == -1
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["errors"], stats["breaker_open"]) == (1, 1, 1, 0, 0)


def test_batched_reads(redis_server):
    store = _store(redis_server)
    blocks = [make_payload(i) for i in range(3)]
    for key, payload in blocks[::2]:
        store.put(key, payload)
    keys = [key for key, _ in blocks]
    assert store.contains_many(keys) == [True, False, True]
    records = store.get_many(keys)
    assert [r is not None for r in records] == [True, False, True]
    assert torch.equal(records[2].kv, make_record(2).kv)
    assert store.get_many([]) == [] and store.contains_many([]) == []


def test_namespaces_are_isolated(redis_server):
    mine, theirs = _store(redis_server), _store(redis_server, OTHER_MODEL)
    xxh = _store(redis_server, TierNamespace(NS.model_fingerprint, "xxh3_64", BLOCK_SIZE))
    key, payload = make_payload(0)
    assert mine.put(key, payload)
    assert not theirs.contains(key) and theirs.get(key) is None
    assert not xxh.contains(key) and xxh.get(key) is None
    assert mine.get(key) is not None


def test_ttl_is_set_and_renewed_by_a_hit(redis_server):
    store = _store(redis_server, ttl_s=100)
    key, payload = make_payload(0)
    store.put(key, payload)
    raw = redis.Redis.from_url(redis_server.url)
    raw.expire(store.redis_key(key), 7)
    assert store.get(key) is not None
    assert 99 <= raw.ttl(store.redis_key(key)) <= 100


def test_bad_entries_are_refused_deleted_and_counted(redis_server, caplog):
    store = _store(redis_server)
    raw = redis.Redis.from_url(redis_server.url)
    k0, p0 = make_payload(0)
    k1, _ = make_payload(1)
    k2, _ = make_payload(2)
    raw.set(store.redis_key(k0), p0[:-3])  # truncated
    raw.set(store.redis_key(k1), encode_block(make_record(1), OTHER_MODEL))  # foreign under our key
    raw.set(store.redis_key(k2), p0)  # another block's bytes under this key
    with caplog.at_level(logging.WARNING, logger="kvreuse.tiers.remote_store"):
        assert store.get_many([k0, k1, k2]) == [None, None, None]
    assert caplog.text.count("refused") == 3
    assert raw.keys("*") == []
    stats = store.stats()
    assert (stats["corrupt"], stats["foreign"], stats["misses"], stats["hits"]) == (2, 1, 3, 0)


def test_flushed_store_is_a_miss(redis_server):
    store = _store(redis_server)
    key, payload = make_payload(0)
    store.put(key, payload)
    redis.Redis.from_url(redis_server.url).flushdb()
    assert store.get(key) is None and store.stats()["errors"] == 0


def test_killed_server_never_raises_breaker_opens_and_restart_reconnects(redis_server, caplog):
    clock = Clock()
    store = _store(redis_server, clock=clock)
    key, payload = make_payload(0)
    assert store.put(key, payload)
    redis_server.stop()  # crash mid-test; the pooled connection is now dead
    with caplog.at_level(logging.WARNING, logger="kvreuse.tiers.remote_store"):
        assert store.get(key) is None
        assert store.put(key, payload) is False
        assert store.contains(key) is False  # third consecutive failure: the breaker opens
        assert store.breaker.state is BreakerState.OPEN
        started = time.monotonic()
        assert store.get(key) is None and store.put(key, payload) is False  # skipped, no network
        assert time.monotonic() - started < 0.05
    stats = store.stats()
    assert (stats["errors"], stats["skipped"], stats["breaker_opened"], stats["breaker_open"]) == (3, 2, 1, 1)
    assert "circuit breaker open" in caplog.text
    assert caplog.text.count("ConnectionError") == 1  # one warning for the streak

    redis_server.start()  # same port, empty (no persistence)
    assert store.get(key) is None and store.stats()["skipped"] == 3  # still cooling down
    clock.now = 5.0
    assert store.put(key, payload)  # the probe reconnects and closes the breaker
    assert store.breaker.state is BreakerState.CLOSED
    assert torch.equal(store.get(key).kv, make_record(0).kv)
    assert store.stats()["breaker_open"] == 0


def test_unreachable_server_fails_fast():
    from .redis_server import free_port

    store = RemoteStore(f"redis://127.0.0.1:{free_port()}/0", namespace=NS, timeout_s=0.3, failure_threshold=2)
    key, payload = make_payload(0)
    assert store.get(key) is None and store.put(key, payload) is False
    assert store.get(key) is None  # breaker open: skipped
    assert (store.stats()["errors"], store.stats()["skipped"]) == (2, 1)


def test_slow_server_times_out(redis_server):
    store = _store(redis_server, timeout_s=0.2)
    key, payload = make_payload(0)
    store.put(key, payload)
    pauser = redis.Redis.from_url(redis_server.url)
    pauser.execute_command("CLIENT", "PAUSE", "1000", "ALL")  # every client's commands wait 1 s
    try:
        started = time.monotonic()
        assert store.get(key) is None
        elapsed = time.monotonic() - started
    finally:
        pauser.execute_command("CLIENT", "UNPAUSE")
    assert 0.15 <= elapsed < 0.6
    assert store.stats()["timeouts"] == 1
    assert store.get(key) is not None  # the next call uses a fresh connection


def test_threads_share_one_store(redis_server):
    store = _store(redis_server)
    blocks = [make_payload(i) for i in range(6)]
    errors = []

    def worker(i):
        try:
            key, payload = blocks[i]
            for _ in range(5):
                assert store.put(key, payload)
                assert torch.equal(store.get(key).kv, make_record(i).kv)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and store.stats()["hits"] == 30


def test_invalid_settings():
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteStore("redis://127.0.0.1:1/0", namespace=NS, timeout_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        RemoteStore("redis://127.0.0.1:1/0", namespace=NS, ttl_s=0.5)
    with pytest.raises(ValueError):
        RemoteStore("http://nowhere", namespace=NS)
