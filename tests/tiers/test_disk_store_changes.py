"""The disk store reports every entry entering (``put``'s ``on_stored``) and leaving its index
(``listen``): size cap, idle TTL, a refused file, a vanished file, ``delete``; and lists its
blocks from their headers alone (``keys``, ``header``)."""

import pytest

from kvreuse.tiers.block_codec import BlockHeader
from kvreuse.tiers.disk_store import DiskStore

from .conftest import NS, OTHER_MODEL, make_payload, make_record
from .test_disk_store import BLOCK_BYTES, Clock


@pytest.fixture
def logged(tmp_path):
    clock = Clock()
    store = DiskStore(tmp_path, 3 * BLOCK_BYTES, namespace=NS, ttl_s=10, clock=clock)
    log = []
    store.listen(lambda key: log.append(("removed", key)))
    return store, log, clock


def put(store, log, i):
    key, payload = make_payload(i)
    assert store.put(key, payload, on_stored=lambda: log.append(("stored", key)))
    return key


def test_cap_eviction_is_reported_after_the_write_that_caused_it(logged):
    store, log, _ = logged
    keys = [put(store, log, i) for i in (1, 2, 3, 4)]
    assert log == [("stored", keys[0]), ("stored", keys[1]), ("stored", keys[2]), ("stored", keys[3]),
                   ("removed", keys[0])]
    assert store.keys() == keys[1:]


def test_ttl_purge_refused_vanished_and_deleted_entries_are_reported(logged):
    store, log, clock = logged
    keys = [put(store, log, i) for i in (1, 2, 3)]
    log.clear()
    store._path(keys[1]).write_bytes(b"not a block")  # refused on read, deleted
    assert store.get(keys[1]) is None
    store._path(keys[2]).unlink()  # gone behind the store's back
    assert store.get(keys[2]) is None
    assert log == [("removed", keys[1]), ("removed", keys[2])]
    assert store.stats()["corrupt"] == 1
    clock.now += 10
    assert store.purge_expired() == 1
    assert log[-1] == ("removed", keys[0]) and store.keys() == []
    k = put(store, log, 5)
    assert store.delete(k) and not store.delete(k)
    assert log[-2:] == [("stored", k), ("removed", k)]


def test_header_lists_a_block_without_reading_its_kv(tmp_path):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS)
    key, payload = make_payload(2)
    assert store.put(key, payload)
    record = make_record(2)
    assert store.header(key) == BlockHeader(record.key, record.parent_key, record.token_ids)
    assert store.header(make_payload(3)[0]) is None  # no such file
    path = store._path(key)
    path.write_bytes(payload[:20])  # truncated inside the header
    assert store.header(key) is None
    foreign_key, foreign = make_payload(2, OTHER_MODEL)
    path.write_bytes(foreign)
    assert store.header(key) is None  # another namespace: get() refuses it too
    restarted = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS)
    assert restarted.keys() == [key]  # indexed by name; verified on use
