"""The store ledgers: changes applied in order become exactly the events a consumer needs,
and the snapshot (pools + ledgers) plus later events equals the ledgers at every point."""

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import BlockHash, hash_token_blocks
from kvreuse.cache.store_ledger import StoreChange, StoreLedger
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import DISK_LEVEL, REMOTE_LEVEL, BlocksRemoved, BlocksStored, StoredBlock, take_snapshot

BS = 4
TOKENS = list(range(16))
K = hash_token_blocks(TOKENS, BS, model_id="m")  # a chain of 4 keys


def held(i, level=DISK_LEVEL):
    return StoreChange(level, K[i], True, K[i - 1] if i else None, tuple(TOKENS[i * BS : (i + 1) * BS]), i)


def gone(i, level=DISK_LEVEL):
    return StoreChange(level, K[i], False)


def stored_event(i, level=DISK_LEVEL):
    return BlocksStored(
        K[i - 1] if i else None, (StoredBlock(K[i], tuple(TOKENS[i * BS : (i + 1) * BS]), 35, level),), BS
    )


def test_changes_become_stored_and_removed_events_in_order():
    buffer = EventBuffer(100)
    ledger = StoreLedger(DISK_LEVEL, BS, events=buffer)
    ledger.apply([held(0), held(1), held(1), gone(3), held(2)])  # held twice: once; never held: nothing
    ledger.check_integrity()
    assert [e.data for e in buffer.get_events()] == [stored_event(0), stored_event(1), stored_event(2)]
    assert len(ledger) == 3 and K[1] in ledger and K[3] not in ledger
    ledger.apply([gone(1), gone(2), held(1), gone(0)])  # a run of removals is one event; a re-store splits runs
    ledger.check_integrity()
    assert [e.data for e in buffer.get_events(after_id=2)] == [
        BlocksRemoved((K[1], K[2]), DISK_LEVEL),
        stored_event(1),
        BlocksRemoved((K[0],), DISK_LEVEL),
    ]
    assert [b.block_hash for b in ledger.cached_hashes()] == [K[1]]
    assert (ledger.num_stored, ledger.num_removed) == (4, 3)


def test_snapshot_lists_each_level_and_a_key_held_at_two_levels_twice():
    buffer = EventBuffer(100)
    pool = BlockPool(4, BS, events=buffer)
    blocks = pool.allocate(2)
    for i, block in enumerate(blocks):
        pool.register(block, K[i], K[i - 1] if i else None, TOKENS[i * BS : (i + 1) * BS], depth=i)
    pool.release(reversed(blocks))
    disk = StoreLedger(DISK_LEVEL, BS, events=buffer)
    remote = StoreLedger(REMOTE_LEVEL, BS, events=buffer)
    disk.apply([held(0), held(1), held(2)])
    remote.apply([held(1, REMOTE_LEVEL)])
    snap = take_snapshot([pool, disk, remote], buffer.last_event_id)
    by_level = sorted((b.cache_level, K.index(b.block_hash), b.depth, b.priority, b.in_use) for b in snap.blocks)
    assert by_level == [
        ("DISK", 0, 0, 35, False),
        ("DISK", 1, 1, 35, False),
        ("DISK", 2, 2, 35, False),
        ("GPU", 0, 0, 35, False),
        ("GPU", 1, 1, 35, False),
        ("REMOTE", 1, 1, 35, False),
    ]
    assert [b.depth for b in snap.blocks] == sorted(b.depth for b in snap.blocks)  # parents first
    pool.check_integrity()
    disk.check_integrity()
    remote.check_integrity()


def test_announce_all_restores_a_consumer_that_cleared_everything():
    buffer = EventBuffer(100)
    ledger = StoreLedger(REMOTE_LEVEL, BS, events=buffer)
    ledger.apply([held(2, REMOTE_LEVEL), held(0, REMOTE_LEVEL), held(1, REMOTE_LEVEL)])
    last = buffer.last_event_id
    ledger.announce_all()
    assert [e.data for e in buffer.get_events(after_id=last)] == [stored_event(i, REMOTE_LEVEL) for i in (0, 1, 2)]
    ledger.check_integrity()  # announcing again is not storing again
    assert (ledger.num_stored, len(ledger)) == (3, 3)


def test_integrity_catches_an_entry_under_another_key():
    ledger = StoreLedger(DISK_LEVEL, BS)
    ledger.apply([held(0)])
    ledger._blocks[BlockHash(b"\x00" * 32)] = ledger._blocks.pop(K[0])
    with pytest.raises(RuntimeError, match="DISK ledger entry 0000"):
        ledger.check_integrity()
