"""A read on the engine thread and the writer thread changing the same key at the same time:
the changes ``PersistentTiers`` reports must still leave the ledger equal to the store. The
interleaving is forced through the real stores' own steps (the disk's block decoding, the
remote store's Redis round trip), with the real writer thread doing the write in between.
Real disk, real redis-server."""

import redis
import torch

from kvreuse.cache.store_ledger import StoreLedger
from kvreuse.tiers import disk_store
from kvreuse.tiers.disk_store import DiskStore
from kvreuse.tiers.persistent import PersistentTiers
from kvreuse.tiers.remote_store import RemoteStore

from .conftest import BLOCK_SIZE, NS, SHAPE, make_record
from .test_disk_store import BLOCK_BYTES

RECORDS = [make_record(i) for i in range(2)]  # one chain of 2 blocks


def spilled(i):
    r = RECORDS[i]
    return [(r.key, r.parent_key, r.token_ids, i)], r.kv.unsqueeze(3)  # [layers, 2, kv_heads, 1, bs, head_dim]


def test_a_disk_block_evicted_while_a_read_verifies_it_leaves_the_disk_ledger(tmp_path, monkeypatch):
    disk = DiskStore(tmp_path, BLOCK_BYTES, namespace=NS)  # room for one block
    t = PersistentTiers(NS, SHAPE, torch.float32, disk=disk)
    ledger = StoreLedger("DISK", BLOCK_SIZE)
    t.spill(*spilled(0))
    assert t.flush(30)
    ledger.apply(t.take_changes())
    real_decode = disk_store.decode_block

    def decode_while_the_writer_evicts(data, *args, **kwargs):
        t.spill(*spilled(1))  # the writer thread puts block 1 meanwhile: the cap evicts block 0
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
        t.spill(*spilled(0))  # then the writer thread's put of block 0 is acknowledged
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
