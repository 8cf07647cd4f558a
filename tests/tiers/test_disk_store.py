"""The disk tier: restart, LRU cap, idle TTL, refusal of bad files, failing disks, threads; and
every entry entering or leaving its index reported, its blocks listed from their headers."""

import errno
import logging
import os
import threading

import pytest
import torch

from kvreuse.tiers import disk_store
from kvreuse.tiers.block_codec import BlockHeader, encode_block
from kvreuse.tiers.disk_store import DiskStore

from .conftest import NS, OTHER_MODEL, SHAPE, make_payload, make_record


class Clock:
    """A settable wall clock."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def _payloads(n):
    """Blocks 1..n of one chain: each has a parent, so all encode to BLOCK_BYTES."""
    return [make_payload(i + 1) for i in range(n)]


BLOCK_BYTES = len(make_payload(1)[1])


def test_round_trip_and_layout(tmp_path, clock):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock)
    key, payload = make_payload(2)
    assert len(payload) == BLOCK_BYTES
    assert store.get(key) is None and not store.contains(key)
    assert store.put(key, payload)
    assert store.contains(key)
    record = store.get(key, shape=SHAPE, dtype=torch.float32)
    assert torch.equal(record.kv, make_record(2).kv) and record.parent_key == make_record(1).key
    path = tmp_path / NS.tag / key.hex()[:2] / f"{key.hex()}.kvb"
    assert path.read_bytes() == payload and os.stat(path).st_mtime == clock.now
    assert [p.name for p in (tmp_path / NS.tag).rglob("*")] == [key.hex()[:2], f"{key.hex()}.kvb"]
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["entries"], stats["bytes"]) == (
        1,
        1,
        1,
        1,
        BLOCK_BYTES,
    )
    assert store.delete(key) and not path.exists() and not store.delete(key)
    assert store.stats()["entries"] == 0


def test_restart_finds_blocks_in_lru_order(tmp_path, clock):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock)
    blocks = _payloads(3)
    for key, payload in blocks:
        clock.now += 1
        store.put(key, payload)
    clock.now += 1
    assert store.get(blocks[0][0]) is not None  # block 0 is now the most recently used
    (tmp_path / NS.tag / "ab").mkdir(exist_ok=True)
    (tmp_path / NS.tag / "ab" / ".abab.kvb.123.tmp").write_bytes(b"half")  # a crash mid-write

    restarted = DiskStore(tmp_path, 2 * BLOCK_BYTES, namespace=NS, clock=clock)  # smaller cap
    # the LRU block (1) was evicted to fit the new cap; 2 and 0 remain, with their contents
    assert not restarted.contains(blocks[1][0])
    assert torch.equal(restarted.get(blocks[2][0]).kv, make_record(3).kv)
    assert torch.equal(restarted.get(blocks[0][0]).kv, make_record(1).kv)
    assert (restarted.stats()["evictions"], restarted.stats()["entries"]) == (1, 2)
    assert not (tmp_path / NS.tag / "ab" / ".abab.kvb.123.tmp").exists()


def test_other_namespace_is_invisible(tmp_path, clock):
    key, payload = make_payload(0)
    DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock).put(key, payload)
    other = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=OTHER_MODEL, clock=clock)
    assert not other.contains(key) and other.get(key) is None and other.stats()["entries"] == 0


def test_lru_cap_evicts_least_recently_used(tmp_path, clock):
    store = DiskStore(tmp_path, 3 * BLOCK_BYTES, namespace=NS, clock=clock)
    blocks = _payloads(4)
    for key, payload in blocks[:3]:
        store.put(key, payload)
    store.get(blocks[0][0])  # 0 used: 1 is the LRU
    assert store.put(*blocks[3])
    assert [store.contains(k) for k, _ in blocks] == [True, False, True, True]
    assert store.stats()["evictions"] == 1 and store.stats()["bytes"] == 3 * BLOCK_BYTES
    assert len(list((tmp_path / NS.tag).rglob("*.kvb"))) == 3


def test_block_larger_than_cap_is_refused(tmp_path, clock):
    store = DiskStore(tmp_path, BLOCK_BYTES - 1, namespace=NS, clock=clock)
    assert not store.put(*make_payload(1))
    assert (store.stats()["too_large"], store.stats()["put_failures"], store.stats()["entries"]) == (1, 1, 0)


def test_ttl_is_idle_time(tmp_path, clock):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, ttl_s=60, clock=clock)
    (k0, p0), (k1, p1), (k2, p2) = _payloads(3)
    store.put(k0, p0)
    store.put(k1, p1)
    clock.now += 50
    assert store.get(k0) is not None  # a hit restarts k0's idle time
    clock.now += 10  # k1 idle for 60 s: expired; k0 for 10 s
    assert not store.contains(k1) and store.contains(k0)
    clock.now += 49
    store.put(k2, p2)
    assert store.contains(k0)
    clock.now += 1  # k0 idle 60 s
    assert store.purge_expired() == 1
    assert [store.contains(k) for k in (k0, k1, k2)] == [False, False, True]
    assert store.stats()["expired"] == 2 and len(list((tmp_path / NS.tag).rglob("*.kvb"))) == 1
    clock.now += 60  # expired while the executor was down: purged at start
    restarted = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, ttl_s=60, clock=clock)
    assert restarted.stats()["entries"] == 0 and restarted.stats()["expired"] == 1


def _file(tmp_path, key):
    return tmp_path / NS.tag / key.hex()[:2] / f"{key.hex()}.kvb"


@pytest.mark.parametrize(
    "damage, counter",
    [
        (lambda data: data[: len(data) // 2], "corrupt"),  # truncated
        (lambda data: data[:-40] + bytes([data[-40] ^ 0xFF]) + data[-39:], "corrupt"),  # one byte flipped
        (lambda data: b"", "corrupt"),  # empty file
        (lambda data: encode_block(make_record(0), OTHER_MODEL), "foreign"),  # another model's block
        (lambda data: make_payload(1)[1], "corrupt"),  # another key's block under this name
    ],
)
def test_bad_file_is_refused_deleted_and_counted(tmp_path, clock, caplog, damage, counter):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock)
    key, payload = make_payload(0)
    store.put(key, payload)
    path = _file(tmp_path, key)
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="kvreuse.tiers.disk_store"):
        assert store.get(key) is None
    assert f"refused {counter} block file" in caplog.text
    assert not path.exists() and not store.contains(key)
    stats = store.stats()
    assert (stats[counter], stats["hits"], stats["misses"], stats["entries"], stats["bytes"]) == (1, 0, 1, 0, 0)
    assert store.put(key, payload) and store.get(key) is not None  # the slot is usable again


def test_bad_file_found_at_restart_is_refused_on_read(tmp_path, clock):
    key, payload = make_payload(0)
    DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock).put(key, payload)
    _file(tmp_path, key).write_bytes(payload[:-1])
    (tmp_path / NS.tag / "stray.txt").write_text("not a block")
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock)
    assert store.stats()["foreign"] == 1 and not (tmp_path / NS.tag / "stray.txt").exists()
    assert store.contains(key) and store.get(key) is None and store.stats()["corrupt"] == 1


def test_unusable_directory_is_a_warning_not_an_error(tmp_path, clock, caplog):
    (tmp_path / "file").write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="kvreuse.tiers.disk_store"):
        store = DiskStore(tmp_path / "file" / "cache", 10 * BLOCK_BYTES, namespace=NS, clock=clock)
        key, payload = make_payload(0)
        assert store.put(key, payload) is False
        assert store.put(key, payload) is False
        assert store.get(key) is None
    # one warning for the whole failure streak; the later failures are counted, logged at DEBUG
    assert [r.getMessage().split(": ")[1] for r in caplog.records] == ["cannot use cache directory"]
    assert store.stats()["put_failures"] == 2


def test_full_disk_is_a_warning_and_leaves_no_temp_file(tmp_path, clock, caplog, monkeypatch):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock)
    real_write = disk_store._write_file

    def full_disk(path, data):
        real_write(path, data[:100])  # part of it made it before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store, "_write_file", full_disk)
    key, payload = make_payload(0)
    with caplog.at_level(logging.INFO, logger="kvreuse.tiers.disk_store"):
        assert store.put(key, payload) is False
        assert "No space left on device" in caplog.text
        assert list((tmp_path / NS.tag).rglob("*")) == [_file(tmp_path, key).parent]
        monkeypatch.setattr(disk_store, "_write_file", real_write)
        assert store.put(key, payload) is True
    assert "working again" in caplog.text
    assert (store.stats()["put_failures"], store.stats()["puts"]) == (1, 1)


def test_unreadable_file_is_a_miss(tmp_path, clock, monkeypatch):
    store = DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS, clock=clock)
    key, payload = make_payload(0)
    store.put(key, payload)

    def eio(self):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_store.Path, "read_bytes", eio)
    assert store.get(key) is None
    assert (store.stats()["read_errors"], store.stats()["misses"]) == (1, 1)


def test_threads_keep_the_index_consistent(tmp_path, clock):
    store = DiskStore(tmp_path, 6 * BLOCK_BYTES, namespace=NS, clock=clock)
    blocks = _payloads(12)
    errors = []

    def worker(offset):
        try:
            for round_ in range(5):
                for i in range(offset, len(blocks), 3):
                    store.put(*blocks[i])
                    record = store.get(blocks[(i + round_) % len(blocks)][0])
                    assert record is None or record.kv.shape == SHAPE
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    files = list((tmp_path / NS.tag).rglob("*.kvb"))
    stats = store.stats()
    assert stats["entries"] == len(files) == 6 and stats["bytes"] == 6 * BLOCK_BYTES
    assert stats["corrupt"] == stats["foreign"] == 0 and not list((tmp_path / NS.tag).rglob("*.tmp"))


def test_invalid_settings():
    with pytest.raises(ValueError, match="max_bytes"):
        DiskStore("/tmp/x", 0, namespace=NS)
    with pytest.raises(ValueError, match="ttl_s"):
        DiskStore("/tmp/x", 1, namespace=NS, ttl_s=0)


# The disk store reports every entry entering (``put``'s ``on_stored``) and leaving its index
# (``listen``): size cap, idle TTL, a refused file, a vanished file, ``delete``; and lists its
# blocks from their headers alone (``keys``, ``header``).
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
    assert log == [
        ("stored", keys[0]),
        ("stored", keys[1]),
        ("stored", keys[2]),
        ("stored", keys[3]),
        ("removed", keys[0]),
    ]
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
