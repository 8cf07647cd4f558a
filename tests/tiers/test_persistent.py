"""``PersistentTiers`` reports what the stores hold as ``StoreChange``s, from the writer thread
and from reads, never emitting events itself: a write each store acknowledged, the disk's
blocks at start (with their chain depths), a removal the disk made, a remote key a read
found missing; nothing when the store did not answer. Then the races between a read on the
engine thread and the writer thread changing the same key. Real disk, real redis-server."""

import threading

import redis
import torch

from kvreuse.cache.store_ledger import StoreChange, StoreLedger
from kvreuse.tiers import disk_store
from kvreuse.tiers.disk_store import DiskStore
from kvreuse.tiers.persistent import PersistentTiers
from kvreuse.tiers.remote_store import RemoteStore

from .conftest import BLOCK_SIZE, NS, SHAPE, make_record
from .test_disk_store import BLOCK_BYTES

RECORDS = [make_record(i) for i in range(3)]  # one chain of 3 blocks


def spilled(indices):
    blocks = [(RECORDS[i].key, RECORDS[i].parent_key, RECORDS[i].token_ids, i) for i in indices]
    return blocks, torch.stack([RECORDS[i].kv for i in indices], dim=3)  # [layers, 2, kv_heads, n, bs, head_dim]


def held(level, i):
    r = RECORDS[i]
    return StoreChange(level, r.key, True, r.parent_key, r.token_ids, i)


def tiers(disk=None, remote=None):
    return PersistentTiers(NS, SHAPE, torch.float32, disk=disk, remote=remote)


def test_each_acknowledged_write_is_reported_per_store_in_order(tmp_path, redis_server):
    t = tiers(DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS), RemoteStore(redis_server.url, namespace=NS))
    woken = threading.Event()
    t.on_change = woken.set
    assert t.levels == ("DISK", "REMOTE") and t.take_changes() == []
    t.spill(*spilled([0, 1, 2]))
    assert t.flush(30) and t.pending_writes == 0 and woken.is_set()
    assert t.take_changes() == [held(lvl, i) for i in range(3) for lvl in ("DISK", "REMOTE")]
    assert t.take_changes() == []  # taken once
    t.close()


def test_restart_reports_the_disk_blocks_with_depths_and_the_disk_removals(tmp_path):
    first = tiers(DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS))
    first.spill(*spilled([0, 1, 2]))
    assert first.flush(30)
    first.close()
    again = tiers(DiskStore(tmp_path, 10 * BLOCK_BYTES, namespace=NS))
    assert sorted(again.take_changes(), key=lambda c: c.depth) == [held("DISK", i) for i in range(3)]
    again.disk._path(RECORDS[0].key).unlink()  # the chain's first block goes missing
    assert again.match([r.key for r in RECORDS], [r.token_ids for r in RECORDS], None) == []
    assert again.take_changes() == [StoreChange("DISK", RECORDS[0].key, False)]
    again.close()
    third = tiers(DiskStore(tmp_path, 2 * BLOCK_BYTES, namespace=NS))  # parent gone: depths count from the rest
    found = sorted(third.take_changes(), key=lambda c: c.depth)
    assert [(c.key, c.depth) for c in found] == [(RECORDS[1].key, 0), (RECORDS[2].key, 1)]
    # a read that uses blocks reports them held, at their depth in the request
    hits = third.match([r.key for r in RECORDS[1:]], [r.token_ids for r in RECORDS[1:]], RECORDS[0].key, depth=1)
    assert [s.key for s in hits] == [RECORDS[1].key, RECORDS[2].key]
    assert third.take_changes() == [held("DISK", 1), held("DISK", 2)]
    third.close()


def test_a_remote_miss_is_reported_only_when_the_store_answered(redis_server):
    t = tiers(remote=RemoteStore(redis_server.url, namespace=NS, timeout_s=0.2))
    t.spill(*spilled([0, 1, 2]))
    assert t.flush(30)
    t.take_changes()
    redis.Redis.from_url(redis_server.url).delete(t.remote.redis_key(RECORDS[1].key))  # expired / evicted unseen
    keys, tokens = [r.key for r in RECORDS], [r.token_ids for r in RECORDS]
    hits = t.match(keys, tokens, None)
    assert [s.key for s in hits] == [RECORDS[0].key]
    assert t.take_changes() == [StoreChange("REMOTE", RECORDS[1].key, False), held("REMOTE", 0)]
    redis_server.stop()
    assert t.match(keys, tokens, None) == []
    assert t.take_changes() == []  # a store that did not answer says nothing about its keys
    t.close()


# A read on the engine thread and the writer thread changing the same key at the same time:
# the changes ``PersistentTiers`` reports must still leave the ledger equal to the store. The
# interleaving is forced through the real stores' own steps (the disk's block decoding, the
# remote store's Redis round trip), with the real writer thread doing the write in between.
# Real disk, real redis-server.
def spilled_one(i):
    r = RECORDS[i]
    return [(r.key, r.parent_key, r.token_ids, i)], r.kv.unsqueeze(3)  # [layers, 2, kv_heads, 1, bs, head_dim]


def test_a_disk_block_evicted_while_a_read_verifies_it_leaves_the_disk_ledger(tmp_path, monkeypatch):
    disk = DiskStore(tmp_path, BLOCK_BYTES, namespace=NS)  # room for one block
    t = PersistentTiers(NS, SHAPE, torch.float32, disk=disk)
    ledger = StoreLedger("DISK", BLOCK_SIZE)
    t.spill(*spilled_one(0))
    assert t.flush(30)
    ledger.apply(t.take_changes())
    real_decode = disk_store.decode_block

    def decode_while_the_writer_evicts(data, *args, **kwargs):
        t.spill(*spilled_one(1))  # the writer thread puts block 1 meanwhile: the cap evicts block 0
        assert t.flush(30)
        return real_decode(data, *args, **kwargs)

    monkeypatch.setattr(disk_store, "decode_block", decode_while_the_writer_evicts)
    hits = t.match([RECORDS[0].key], [RECORDS[0].token_ids], None)
    assert [s.key for s in hits] == [RECORDS[0].key]  # the bytes read were whole and verified
    ledger.apply(t.take_changes())
    ledger.check_integrity()
    assert disk.keys() == [RECORDS[1].key]
    assert [b.block_hash for b in ledger.cached_hashes()] == [RECORDS[1].key]
    assert (ledger.num_stored, ledger.num_removed) == (2, 1)
    t.close()


def test_a_remote_write_acknowledged_while_a_read_misses_it_stays_in_the_remote_ledger(redis_server, monkeypatch):
    t = PersistentTiers(NS, SHAPE, torch.float32, remote=RemoteStore(redis_server.url, namespace=NS))
    ledger = StoreLedger("REMOTE", BLOCK_SIZE)
    real_fetch = t.remote._fetch

    def fetch_then_the_writer_lands_it(keys):
        values = real_fetch(keys)  # Redis answers: block 0 absent
        t.spill(*spilled_one(0))  # then the writer thread's put of block 0 is acknowledged
        assert t.flush(30)
        return values

    monkeypatch.setattr(t.remote, "_fetch", fetch_then_the_writer_lands_it)
    assert t.match([RECORDS[0].key], [RECORDS[0].token_ids], None) == []
    ledger.apply(t.take_changes())
    ledger.check_integrity()
    assert redis.Redis.from_url(redis_server.url).exists(t.remote.redis_key(RECORDS[0].key)) == 1
    assert [b.block_hash for b in ledger.cached_hashes()] == [RECORDS[0].key]  # written by us, not seen missing since
    assert (ledger.num_stored, ledger.num_removed) == (1, 0)
    t.close()
