"""Test-side consumers and snapshot functions of KV events: ``CacheMirror``, a full copy of
one pool's cache rebuilt from a snapshot and the numbered events after it; ``LevelMirror``,
one block set per cache level (a store copy is held at two levels), compared with
``snapshot_levels``; ``locked_snapshot``
and ``engine_thread_snapshot``, consistent snapshot functions for tests that drive a pool or
an engine; and ``CATCH_UP``, the replay-socket catch-up shared by the plain-pyzmq subscriber
scripts.

The router's own consumer is ``kvreuse.router.index.KVIndex`` (keys and levels only); this
mirror also keeps parents and priorities, so tests can compare it with the pool exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvreuse.cache.hashing import BlockHash
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    BlockUpdated,
    Event,
    KVSnapshot,
)


@dataclass(slots=True)
class MirroredBlock:
    parent_hash: BlockHash | None
    priority: int
    cache_level: str


@dataclass
class CacheMirror:
    """A consumer's copy of one executor's cache, rebuilt from a snapshot and events.

    ``apply`` returns ``False`` (and changes nothing) when the event is not the next
    one (``event_id != last_event_id + 1``): the consumer missed events and must
    ``load`` a fresh snapshot, then apply only events after its ``last_event_id``.
    """

    blocks: dict[BlockHash, MirroredBlock] = field(default_factory=dict)
    last_event_id: int = -1

    def load(self, snapshot: KVSnapshot) -> None:
        self.blocks = {b.block_hash: MirroredBlock(b.parent_hash, b.priority, b.cache_level) for b in snapshot.blocks}
        self.last_event_id = snapshot.last_event_id

    def apply_all(self, events: Iterable[Event]) -> bool:
        """Apply events in order, skipping ones already reflected; ``False`` at a gap."""
        for event in events:
            if event.event_id <= self.last_event_id:
                continue
            if not self.apply(event):
                return False
        return True

    def apply(self, event: Event) -> bool:
        if event.event_id != self.last_event_id + 1:
            return False
        data = event.data
        if isinstance(data, BlocksStored):
            parent = data.parent_hash
            for b in data.blocks:
                self.blocks[b.block_hash] = MirroredBlock(parent, b.priority, b.cache_level)
                parent = b.block_hash
        elif isinstance(data, BlocksRemoved):
            for h in data.block_hashes:
                self.blocks.pop(h, None)
        elif isinstance(data, BlockUpdated):
            block = self.blocks.get(data.block_hash)
            if block is not None:
                if data.new_priority is not None:
                    block.priority = data.new_priority
                if data.new_cache_level is not None:
                    block.cache_level = data.new_cache_level
        elif isinstance(data, AllBlocksCleared):
            self.blocks.clear()
        self.last_event_id = event.event_id
        return True


@dataclass
class LevelMirror:
    """A consumer's per-level copy of an executor's blocks (level -> block hash -> parent),
    from numbered events: a key may be held at several levels at once (a disk or remote copy
    of a device block). ``AllBlocksCleared`` empties every level; a removal naming no level
    removes the key everywhere. Compare with ``snapshot_levels``."""

    levels: dict[str, dict[BlockHash, BlockHash | None]] = field(default_factory=dict)
    last_event_id: int = -1

    def apply_all(self, events: Iterable[Event]) -> None:
        for event in events:
            assert event.event_id == self.last_event_id + 1, "events lost: enlarge the test's buffer"
            data = event.data
            if isinstance(data, BlocksStored):
                parent = data.parent_hash
                for b in data.blocks:
                    self.levels.setdefault(b.cache_level, {})[b.block_hash] = parent
                    parent = b.block_hash
            elif isinstance(data, BlocksRemoved):
                for level, held in self.levels.items():
                    if data.cache_level in (None, level):
                        for h in data.block_hashes:
                            held.pop(h, None)
            elif isinstance(data, AllBlocksCleared):
                self.levels.clear()
            self.last_event_id = event.event_id

    def nonempty(self) -> dict[str, dict[BlockHash, BlockHash | None]]:
        return {level: held for level, held in self.levels.items() if held}


def snapshot_levels(snapshot: KVSnapshot) -> dict[str, dict[BlockHash, BlockHash | None]]:
    """A snapshot as ``LevelMirror.nonempty()`` shows it."""
    out: dict[str, dict[BlockHash, BlockHash | None]] = {}
    for b in snapshot.blocks:
        out.setdefault(b.cache_level, {})[b.block_hash] = b.parent_hash
    return out


def locked_snapshot(pool: Any, buffer: EventBuffer, engine_lock: threading.Lock) -> Callable[[], KVSnapshot]:
    """A snapshot function that takes ``engine_lock`` (which the test's "engine" holds while
    it mutates the pool, i.e. around each step), so the snapshot and its ``last_event_id``
    describe the same instant."""

    def snapshot() -> KVSnapshot:
        with engine_lock:
            return buffer.snapshot(pool)

    return snapshot


def engine_thread_snapshot(async_engine: Any, buffer: EventBuffer, timeout: float = 30.0) -> Callable[[], KVSnapshot]:
    """A blocking snapshot function for plain threads (the ZMQ publisher's resync) when the
    pool belongs to an ``AsyncEngine``: runs ``buffer.snapshot(engine.pool)`` on the engine
    thread between steps (``AsyncEngine.call_blocking``) and waits up to ``timeout``, as
    ``kvreuse serve`` does. Never call it on the engine thread itself."""

    def snapshot() -> KVSnapshot:
        return async_engine.call_blocking(lambda engine: buffer.snapshot(engine.pool), timeout=timeout)

    return snapshot


# Source for the subscriber scripts (plain pyzmq + msgpack, no kvreuse): ask the replay
# socket for every batch from ``expected`` on, apply those in order, stop at seq -1. The
# script defines ``replay`` (a DEALER), ``apply(payload)`` and the global ``expected``.
CATCH_UP = r"""
def catch_up():
    global expected
    replay.send_multipart([b"", expected.to_bytes(8, "big")])
    while True:
        _, seq, payload = replay.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            return
        if seq == expected:
            apply(payload); expected += 1
"""


_DUMPING_HEAD = r"""
import json, sys, msgpack, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(sys.argv[1])
replay = ctx.socket(zmq.DEALER); replay.connect(sys.argv[2])
poller = zmq.Poller(); poller.register(sub, zmq.POLLIN); poller.register(sys.stdin, zmq.POLLIN)
expected = 0
"""

_DUMPING_LOOP = r"""
print("ready", flush=True)
while True:
    ready = dict(poller.poll())
    if sub in ready:
        _, seq, payload = sub.recv_multipart(); seq = int.from_bytes(seq, "big")
        if seq == expected: apply(payload); expected += 1
        elif seq > expected: catch_up()
    elif ready:
        if not sys.stdin.readline(): break
        catch_up()  # anything missed at the start (slow joiner)
        print(json.dumps(DUMP), flush=True)
"""


def dumping_subscriber(apply_source: str, dump: str) -> str:
    """Source of a subscriber process (plain pyzmq + msgpack, no kvreuse): SUB on
    ``argv[1]``, the replay DEALER on ``argv[2]``; prints ``ready``, then applies every
    batch in order (catching up from the replay socket on a gap); each line on its stdin
    makes it catch up and print ``json.dumps(<dump>)``; stdin closed ends it.
    ``apply_source`` defines its state and ``apply(payload)``."""
    return _DUMPING_HEAD + apply_source + CATCH_UP + _DUMPING_LOOP.replace("DUMP", dump)
