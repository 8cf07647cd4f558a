"""The remote tier against a real 3-master Redis Cluster (Debian's redis-server on loopback
ports, joined by ``redis-cli --cluster create``): keys spread over every master, batch reads
across slots, one identity whatever node seeds the client, a killed master never raises."""

import logging

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from kvreuse.tiers.circuit_breaker import BreakerState
from kvreuse.tiers.redis_connect import parse_target
from kvreuse.tiers.remote_store import RemoteStore, store_identity

from .conftest import NS, OTHER_MODEL, SHAPE, make_payload, make_record
from .redis_cluster import running_cluster
from .redis_server import free_port


@pytest.fixture
def redis_cluster(tmp_path):
    yield from running_cluster(tmp_path / "cluster")  # a real 3-master cluster per test


def _store(url, namespace=NS, **kwargs):
    kwargs = {"timeout_s": 0.3, "failure_threshold": 3, "cooldown_s": 5.0} | kwargs
    return RemoteStore(url, namespace=namespace, **kwargs)


def test_keys_spread_over_every_master_and_batches_read_across_slots(redis_cluster):
    store = _store(redis_cluster.url())
    assert isinstance(store.client(), RedisCluster)
    blocks = [make_payload(i) for i in range(24)]
    for key, payload in blocks[::2]:
        assert store.put(key, payload)
    keys = [key for key, _ in blocks]
    assert store.contains_many(keys) == [i % 2 == 0 for i in range(24)]
    records = store.get_many(keys, shape=SHAPE, dtype=torch.float32)
    assert [r is not None for r in records] == [i % 2 == 0 for i in range(24)]
    assert all(torch.equal(records[i].kv, make_record(i).kv) for i in range(0, 24, 2))
    sizes = {port: redis_cluster.node(port).dbsize() for port in redis_cluster.ports}
    assert sum(sizes.values()) == 12 and all(n > 0 for n in sizes.values()), sizes  # no hash tag: every master
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["errors"]) == (12, 12, 12, 0)


def test_any_node_seeds_the_same_store_and_identity(redis_cluster):
    stores = [_store(redis_cluster.url(port)) for port in redis_cluster.ports]
    assert len({s.identity for s in stores}) == 1
    assert _store(redis_cluster.url(), OTHER_MODEL).identity != stores[0].identity
    key, payload = make_payload(3)
    assert stores[2].put(key, payload)
    assert all(torch.equal(s.get(key).kv, make_record(3).kv) for s in stores)
    assert not _store(redis_cluster.url(), OTHER_MODEL).contains(key)  # namespaces stay apart


def test_ttl_renewal_and_a_moved_slot_is_followed(redis_cluster):
    store = _store(redis_cluster.url(), ttl_s=100)
    key, payload = make_payload(0)
    assert store.put(key, payload)
    name = store.redis_key(key)
    client = store.client()
    slot = client.keyslot(name)
    source = client.nodes_manager.get_node_from_slot(slot)
    target = next(p for p in redis_cluster.ports if p != source.port)
    src, dst = redis_cluster.node(source.port), redis_cluster.node(target)
    dst_id = dst.execute_command("CLUSTER", "MYID").decode()
    src_id = src.execute_command("CLUSTER", "MYID").decode()
    # move the key's slot to another master behind the client's back (as a resharding does)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", name)
    for port in redis_cluster.ports:
        redis_cluster.node(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    redis_cluster.node(target).expire(name, 7)
    assert torch.equal(store.get(key).kv, make_record(0).kv)  # MOVED followed to the new owner
    assert 99 <= redis_cluster.node(target).ttl(name) <= 100 and store.stats()["errors"] == 0
    assert client.nodes_manager.get_node_from_slot(slot).port == target


def test_a_killed_master_never_raises_and_opens_the_breaker(redis_cluster, caplog):
    store = _store(redis_cluster.url())
    blocks = [make_payload(i) for i in range(12)]
    for key, payload in blocks:
        assert store.put(key, payload)
    keys = [key for key, _ in blocks]
    redis_cluster.kill(redis_cluster.ports[1])  # a master with a third of the slots, no replica
    with caplog.at_level(logging.WARNING, logger="kvreuse.tiers.remote_store"):
        assert store.get_many(keys) == [None] * 12  # the batch touches the dead master: a miss
        assert store.contains_many(keys) == [False] * 12
        dead = next(k for k in keys if store.client().keyslot(store.redis_key(k)) in range(5461, 10923))
        assert store.put(dead, b"x") is False  # third consecutive failure: the breaker opens
    assert store.breaker.state is BreakerState.OPEN
    assert store.get(keys[0]) is None and store.stats()["skipped"] == 1
    stats = store.stats()
    assert (stats["errors"] + stats["timeouts"], stats["breaker_opened"], stats["hits"]) == (3, 1, 0)
    assert "circuit breaker open" in caplog.text


def test_unreachable_cluster_at_start_is_a_miss_not_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="kvreuse.tiers.remote_store"):
        store = RemoteStore(f"redis+cluster://127.0.0.1:{free_port()}", namespace=NS, timeout_s=0.3)
    assert "unreachable at start" in caplog.text
    key, payload = make_payload(0)
    assert store.get(key) is None and store.put(key, payload) is False
    assert store.stats()["errors"] == 2


def test_cluster_urls():
    target = parse_target("rediss+cluster://user:secret@node-1.example:7000")
    assert (target.url, target.cluster, target.where) == (
        "rediss://user:secret@node-1.example:7000",
        True,
        "node-1.example:7000",
    )
    assert parse_target("redis+cluster://10.0.0.5:6379/0").url == "redis://10.0.0.5:6379"
    assert (
        not parse_target("redis://h:1/2").cluster and parse_target("unix:///run/redis.sock").where == "/run/redis.sock"
    )
    for bad in ("redis+cluster://h:1/3", "redis+cluster://h:1?db=2", "redis+cluster:///x", "http://nowhere"):
        with pytest.raises(ValueError):
            parse_target(bad)
    # database 0 named in the query is database 0; a query value merely containing "db=" is no database
    assert parse_target("redis+cluster://h:1?db=0").cluster
    assert parse_target("redis+cluster://h:1?ssl_ca_path=/etc/db=certs").cluster


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://default:s3cretpw@127.0.0.1:7000/2",
        "redis+cluster://default:s3cretpw@:7000",
        "http://default:s3cretpw@node1:7000",
    ],
)
def test_a_refused_url_never_shows_its_password(url):
    with pytest.raises(ValueError) as refused:
        parse_target(url)
    assert "s3cretpw" not in str(refused.value) and "default" not in str(refused.value)
    assert "***@" in str(refused.value)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_failed_over_master_is_found_again_after_the_cool_down(tmp_path):
    clock = Clock()
    for cluster in running_cluster(tmp_path / "cluster", replicas=1):  # 3 masters, 3 replicas
        store = _store(cluster.url(), clock=clock, failure_threshold=1)
        blocks = [make_payload(i) for i in range(12)]
        for key, payload in blocks:
            assert store.put(key, payload)
        keys = [key for key, _ in blocks]
        masters = cluster.masters()
        assert len(masters) == 3
        cluster.wait_replicated()  # every write on a replica before the crash
        victim = next(p for p in masters if cluster.node(p).dbsize() > 0)
        cluster.kill(victim)
        assert store.get_many(keys) == [None] * 12  # the old slot map points at the dead master
        assert store.breaker.state is BreakerState.OPEN
        cluster.wait_failed_over(victim)  # a replica took over the dead master's slots
        clock.now = 5.0  # the cool-down: the next call probes, with the refreshed slot map
        records = store.get_many(keys, shape=SHAPE, dtype=torch.float32)
        assert all(torch.equal(r.kv, make_record(i).kv) for i, r in enumerate(records))
        assert store.breaker.state is BreakerState.CLOSED and store.stats()["hits"] == 12


def test_a_tls_cluster_through_rediss_cluster(tmp_path):
    for cluster in running_cluster(tmp_path / "cluster", tls=True):  # clients, replication and bus on TLS
        url = cluster.url(cluster.ports[1])
        assert url.startswith("rediss+cluster://") and "ssl_ca_certs=" in url
        store = _store(url)
        blocks = [make_payload(i) for i in range(12)]
        for key, payload in blocks:
            assert store.put(key, payload)
        records = store.get_many([key for key, _ in blocks], shape=SHAPE, dtype=torch.float32)
        assert all(torch.equal(r.kv, make_record(i).kv) for i, r in enumerate(records))
        assert all(cluster.node(port).dbsize() > 0 for port in cluster.ports)
        assert store.identity == _store(cluster.url(cluster.ports[2])).identity
        # no CA to verify the nodes' certificate, or no TLS at all: a miss, never an exception
        for wrong in (url.split("?")[0], url.replace("rediss+cluster", "redis+cluster").split("?")[0]):
            other = _store(wrong)
            assert other.get(blocks[0][0]) is None and other.stats()["errors"] + other.stats()["timeouts"] == 1


def test_clusterdown_is_a_miss_and_a_cluster_back_up_is_found_by_the_probe(redis_cluster):
    clock = Clock()
    store = _store(redis_cluster.url(), clock=clock, failure_threshold=1)
    victim = redis_cluster.ports[2]  # slots 10923-16383; the others keep theirs
    index = next(i for i in range(24) if store.client().keyslot(store.redis_key(make_payload(i)[0])) < 5461)
    live, payload = make_payload(index)  # a block on the first master, which stays up
    assert store.put(live, payload)
    redis_cluster.kill(victim)
    redis_cluster.wait_for_state("fail", [p for p in redis_cluster.ports if p != victim])
    raw = redis_cluster.node(redis_cluster.ports[0])
    with pytest.raises(redis.exceptions.ClusterDownError):
        raw.get(store.redis_key(live))  # the live master refuses: cluster-require-full-coverage yes
    assert store.get(live) is None  # its key sits on a live master, yet CLUSTERDOWN: a miss
    stats = store.stats()
    assert (stats["errors"], stats["breaker_opened"]) == (1, 1)
    redis_cluster.restart(victim)  # back (empty), the cluster ok again
    clock.now = 5.0
    assert torch.equal(store.get(live).kv, make_record(index).kv)  # the probe finds it: its master never left
    assert store.breaker.state is BreakerState.CLOSED


def test_a_seed_down_at_start_gives_the_clusters_identity_once_it_is_back(redis_cluster):
    clock = Clock()
    seed, other = redis_cluster.ports[0], redis_cluster.ports[1]
    shared = _store(redis_cluster.url(other)).identity  # what every executor of the cluster reports
    redis_cluster.kill(seed)
    store = _store(redis_cluster.url(seed), clock=clock, failure_threshold=1)
    assert store.provisional and store.identity == store_identity(f"cluster-seed:127.0.0.1:{seed}", store.prefix)
    assert store.identity != shared
    key, payload = make_payload(0)
    assert store.put(key, payload) is False  # still down: the breaker opens, the stand-in stays
    assert store.breaker.state is BreakerState.OPEN and store.provisional
    redis_cluster.restart(seed)  # back, the cluster ok again
    assert store.get(key) is None and store.stats()["skipped"] == 1 and store.provisional  # the cool-down
    clock.now = 5.0
    assert store.put(key, payload)  # the probe works: the identity is derived as at start
    assert store.breaker.state is BreakerState.CLOSED
    assert (store.identity, store.provisional) == (shared, False)
    assert torch.equal(_store(redis_cluster.url(other)).get(key).kv, make_record(0).kv)
