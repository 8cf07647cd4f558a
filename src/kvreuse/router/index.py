"""The router's index: block key -> executors holding it, fed by each executor's KV events.

Keys are the low 64 bits of a ``kvreuse.cache.hashing`` block hash (``index_key``), the form
vLLM-compatible ZMQ events carry, so events from ZMQ (int hashes) and HTTP (hex of the
full hash) land in one index. A 64-bit collision can only make the router prefer an
executor that then misses; the executor checks stored tokens on every hit, so the answer
is never wrong.

Each executor has a ``Mirror`` (its keys with every cache level it holds them at: a disk or
remote copy of a device block is held at two levels at once; and the id of the last event
applied). ``holders`` maps each key to a bitmask of executors, so the overlap of a request
with every executor is one pass over its leading keys::

    alive = all executors
    for i, key in enumerate(keys):           # stops at the first key nobody holds
        gone = alive & ~reach(key)            # these executors' prefixes end at block i
        ...

Shared remote stores: executors that report the same remote store identity (``set_store``;
``/v1/kvreuse/info``'s ``remote_store``: same Redis and namespace) read each other's
``REMOTE`` blocks, so a key one of them holds at ``REMOTE`` is reachable from all of them, at
the ``REMOTE`` level: ``reach(key) = holders[key] | every store group with a REMOTE holder``.
The same holds for ``OBJECT`` among executors reporting the same ``object_store`` (one S3
bucket and prefix): each shared level has its own holders and store groups (``SHARED_LEVELS``).

Events change the index through one path, ``apply_record``, whatever brings them: the SSE
feed's numbered JSON events (through ``apply``, which checks ids), the ZMQ feed's wire
messages (as ``kvreuse.events.decoder`` records; the feed checks sequence numbers), and the
simulator's pools (in order by construction).

Consistency: events are applied in id order; an event whose id is not ``last + 1`` is
refused (``apply`` returns ``False``), and the owner reloads a snapshot (``load``). Until
then the index is stale, which can cost a miss, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreuse.events.records import (
    DEVICE_LEVEL,
    DISK_LEVEL,
    HOST_LEVEL,
    OBJECT_LEVEL,
    REMOTE_LEVEL,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    BlockUpdated,
    CacheCreated,
    Event,
    KVEvent,
    KVSnapshot,
)

IndexKey = int  # low 64 bits of a BlockHash, big-endian (as events.wire.wire_hash "int")


def index_key(block_hash: bytes) -> IndexKey:
    """The index form of a block hash (its last 8 bytes as a big-endian integer)."""
    return int.from_bytes(block_hash[-8:], "big")


_LEVEL_ORDER = (DEVICE_LEVEL, HOST_LEVEL, DISK_LEVEL, REMOTE_LEVEL, OBJECT_LEVEL)  # nearest first (``level_of``)
SHARED_LEVELS = (REMOTE_LEVEL, OBJECT_LEVEL)  # levels whose store executors may share (Redis, a bucket)
_NO_LEVELS: frozenset[str] = frozenset()


@dataclass(slots=True)
class _SharedLevel:
    """One shared level's bookkeeping: who holds each key there, and who shares which store."""

    holders: dict[IndexKey, int] = field(default_factory=dict)  # key -> executors holding it at this level
    groups: dict[str, int] = field(default_factory=dict)  # store identity -> executors sharing that store


@dataclass(slots=True)
class Mirror:
    """One executor's blocks as the router knows them."""

    bit: int  # this executor's bit in ``KVIndex.holders`` masks
    levels: dict[IndexKey, frozenset[str]] = field(default_factory=dict)  # key -> every level it is held at
    last_event_id: int = -1  # id of the last event applied (-1: none, or a ZMQ feed)
    num_resyncs: int = 0  # snapshots loaded after a gap
    stores: dict[str, str] = field(default_factory=dict)  # shared level -> its store's identity (``set_store``)


class KVIndex:
    """Block key -> executors, per executor mirror. Not thread-safe: the router's event
    loop (or the simulator) is its only caller."""

    def __init__(self) -> None:
        self.holders: dict[IndexKey, int] = {}  # key -> bitmask of executors holding it (any level)
        self._shared = {level: _SharedLevel() for level in SHARED_LEVELS}
        self._level_sets: dict[frozenset[str], frozenset[str]] = {}  # one object per set of levels
        self._mirrors: dict[str, Mirror] = {}
        self._handlers: dict[type, Callable[[str, Any], None]] = {
            BlocksStored: self._on_stored,
            BlocksRemoved: self._on_removed,
            BlockUpdated: self._on_updated,
            AllBlocksCleared: lambda name, _: self.clear(name),
            CacheCreated: lambda name, _: None,
        }

    # ------------------------------------------------------------------ membership
    def add_executor(self, name: str) -> Mirror:
        """Register an executor (idempotent); its bit is stable for the index's life."""
        mirror = self._mirrors.get(name)
        if mirror is None:
            mirror = self._mirrors[name] = Mirror(bit=1 << len(self._mirrors))
        return mirror

    def mirror(self, name: str) -> Mirror:
        return self._mirrors[name]

    @property
    def remote_holders(self) -> dict[IndexKey, int]:
        """Key -> bitmask of the executors holding it at ``REMOTE``."""
        return self._shared[REMOTE_LEVEL].holders

    def set_store(self, name: str, store: str | None, level: str = REMOTE_LEVEL) -> None:
        """Note that ``name`` shares the store ``store`` of the shared ``level`` (its identity;
        ``None``: none): from now on a key any executor of that store holds at ``level`` is
        reachable from ``name`` too. Keeps every mirror as it is."""
        mirror, groups = self._mirrors[name], self._shared[level].groups
        old = mirror.stores.pop(level, None)
        if old is not None:
            self._drop_bit(groups, old, mirror.bit)
        if store is not None:
            mirror.stores[level] = store
            groups[store] = groups.get(store, 0) | mirror.bit

    @property
    def executors(self) -> list[str]:
        return list(self._mirrors)

    @property
    def num_keys(self) -> int:
        """Distinct keys held by at least one executor."""
        return len(self.holders)

    # ------------------------------------------------------------------ queries
    def overlaps(
        self, keys: Sequence[IndexKey], names: Sequence[str], tier_weights: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """For each executor in ``names``: how many leading ``keys`` it can reach (held at any
        cache level, or at ``REMOTE`` / ``OBJECT`` by an executor sharing that store); with
        ``tier_weights`` (cache level -> weight, 1.0 for a level not listed), each block
        counts the weight of the best level it is reachable at instead of 1 (a host-tier
        block saves less than a device one). O(length of the longest match). Does not modify
        the index."""
        counts = self._overlap_counts(keys, names)
        if tier_weights is None:
            return counts  # type: ignore[return-value]  # int counts are the scores without tier weights
        out: dict[str, float] = {}
        for name, n in counts.items():
            out[name] = float(
                sum(max(tier_weights.get(level, 1.0) for level in self.reachable_levels(name, key)) for key in keys[:n])
            )
        return out

    def reach(self, key: IndexKey) -> int:
        """Bitmask of the executors that can reach ``key``: its holders, and every executor
        sharing a remote store (or bucket) with one that holds it at ``REMOTE`` (``OBJECT``)."""
        held = self.holders.get(key, 0)
        for shared in self._shared.values():
            there = shared.holders.get(key, 0)
            if there:
                for members in shared.groups.values():
                    if there & members:
                        held |= members
        return held

    def reachable_levels(self, name: str, key: IndexKey) -> frozenset[str]:
        """The levels at which ``name`` reaches ``key``: its own, plus ``REMOTE`` (``OBJECT``)
        when an executor sharing its remote store (bucket) holds it there. Empty when
        unreachable."""
        mirror = self._mirrors[name]
        own = levels = mirror.levels.get(key, _NO_LEVELS)
        for level, store in mirror.stores.items():
            shared = self._shared[level]
            if level not in levels and shared.holders.get(key, 0) & shared.groups[store]:
                levels = levels | {level}
        return own if levels is own else self._interned(levels)

    def _overlap_counts(self, keys: Sequence[IndexKey], names: Sequence[str]) -> dict[str, int]:
        bits = {name: self._mirrors[name].bit for name in names}
        ended: dict[int, int] = {}  # bit -> overlap
        alive = 0
        for b in bits.values():
            alive |= b
        holders, reach = self.holders, self.reach
        shared = any(s.groups and s.holders for s in self._shared.values())  # else reach(key) is holders[key]
        i = 0
        for key in keys:
            held = (reach(key) if shared else holders.get(key, 0)) & alive
            if held != alive:
                gone = alive & ~held
                for b in bits.values():
                    if gone & b:
                        ended[b] = i
                alive = held
                if not alive:
                    break
            i += 1
        return {name: ended.get(b, i) for name, b in bits.items()}

    def level_of(self, name: str, key: IndexKey) -> str | None:
        """The nearest level ``name`` itself holds ``key`` at (device first), or None."""
        levels = self._mirrors[name].levels.get(key, _NO_LEVELS)
        return next((lv for lv in _LEVEL_ORDER if lv in levels), min(levels, default=None))

    # ------------------------------------------------------------------ updates
    def store(self, name: str, keys: Iterable[IndexKey], level: str = DEVICE_LEVEL) -> None:
        """Note ``keys`` as held by ``name`` at ``level`` too (the levels it held them at stay:
        a move between tiers is a removal at the old level and a store at the new one)."""
        mirror = self._mirrors[name]
        for key in keys:
            self._hold(mirror, key, level)

    def remove(self, name: str, keys: Iterable[IndexKey], level: str | None = None) -> None:
        """Forget ``keys`` on ``name`` at ``level`` (it stays held at its other levels), or at
        every level when ``level`` is None."""
        mirror = self._mirrors[name]
        for key in keys:
            self._unhold(mirror, key, level)

    def clear(self, name: str) -> None:
        """Forget every block of ``name`` (it restarted, cleared, or is resyncing)."""
        mirror = self._mirrors[name]
        for key, levels in mirror.levels.items():
            self._drop_bit(self.holders, key, mirror.bit)
            for level in levels & self._shared.keys():
                self._drop_bit(self._shared[level].holders, key, mirror.bit)
        mirror.levels = {}

    def apply_record(self, name: str, record: KVEvent) -> None:
        """Apply one event record to ``name``'s mirror, with no id check: the one path by
        which events change the index (``apply``, the ZMQ feed and the simulator call it).

        stored: each block held at its level (too); removed: dropped at the record's level (at
        every level when it is ``None``); cleared: ``clear`` (every level); updated: a block
        held at the old level moves to the new one (priorities are not indexed); created:
        nothing. Raises
        ``KeyError`` for anything that is not a ``KVEvent`` record."""
        self._handlers[type(record)](name, record)

    def apply(self, name: str, event: Event) -> bool:
        """Apply a numbered event. ``False`` (nothing changed) if it is not the next id:
        events were lost and the caller must ``load`` a snapshot. Old ids are skipped."""
        mirror = self._mirrors[name]
        if event.event_id <= mirror.last_event_id:
            return True
        if event.event_id != mirror.last_event_id + 1:
            return False
        self.apply_record(name, event.data)
        mirror.last_event_id = event.event_id
        return True

    def load(self, name: str, snapshot: KVSnapshot) -> None:
        """Replace ``name``'s blocks with a snapshot; events after its ``last_event_id`` follow."""
        self.clear(name)
        mirror = self._mirrors[name]
        for b in snapshot.blocks:
            self._hold(mirror, index_key(b.block_hash), b.cache_level)
        mirror.last_event_id = snapshot.last_event_id

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless ``holders``, each shared level's holders and the store
        groups are exactly what the mirrors say. O(keys held): for tests."""
        holders: dict[IndexKey, int] = {}
        shared = {level: _SharedLevel() for level in SHARED_LEVELS}
        for name, mirror in self._mirrors.items():
            for key, levels in mirror.levels.items():
                if not levels:
                    raise RuntimeError(f"{name} holds key {key:#x} at no level")
                holders[key] = holders.get(key, 0) | mirror.bit
                for level in levels & shared.keys():
                    shared[level].holders[key] = shared[level].holders.get(key, 0) | mirror.bit
            for level, store in mirror.stores.items():
                shared[level].groups[store] = shared[level].groups.get(store, 0) | mirror.bit
        checks: list[tuple[str, dict, dict]] = [("holders", self.holders, holders)]
        for level, wanted in shared.items():
            held = self._shared[level]
            checks += [
                (f"{level} holders", held.holders, wanted.holders),
                (f"{level} groups", held.groups, wanted.groups),
            ]
        for what, have, want in checks:
            if have != want:
                raise RuntimeError(
                    f"KVIndex {what} disagree with the mirrors: {len(have)} entries, {len(want)} expected"
                )

    # ------------------------------------------------------------------ internals
    def _on_stored(self, name: str, record: BlocksStored) -> None:
        mirror = self._mirrors[name]
        for b in record.blocks:
            self._hold(mirror, index_key(b.block_hash), b.cache_level)

    def _on_removed(self, name: str, record: BlocksRemoved) -> None:
        self.remove(name, (index_key(h) for h in record.block_hashes), record.cache_level)

    def _on_updated(self, name: str, record: BlockUpdated) -> None:
        mirror = self._mirrors[name]
        key = index_key(record.block_hash)
        new, old = record.new_cache_level, record.old_cache_level
        held = mirror.levels.get(key, _NO_LEVELS)
        if new is not None and held and (old is None or old in held):
            if old is not None:
                self._unhold(mirror, key, old)
            self._hold(mirror, key, new)

    def _interned(self, levels: frozenset[str]) -> frozenset[str]:
        return self._level_sets.setdefault(levels, levels)

    def _hold(self, mirror: Mirror, key: IndexKey, level: str) -> None:
        mirror.levels[key] = self._interned(mirror.levels.get(key, _NO_LEVELS) | {level})
        self.holders[key] = self.holders.get(key, 0) | mirror.bit
        shared = self._shared.get(level)
        if shared is not None:
            shared.holders[key] = shared.holders.get(key, 0) | mirror.bit

    def _unhold(self, mirror: Mirror, key: IndexKey, level: str | None) -> None:
        held = mirror.levels.get(key)
        if held is None or (level is not None and level not in held):
            return
        left = _NO_LEVELS if level is None else self._interned(held - {level})
        for gone in (held - left) & self._shared.keys():
            self._drop_bit(self._shared[gone].holders, key, mirror.bit)
        if left:
            mirror.levels[key] = left
        else:
            del mirror.levels[key]
            self._drop_bit(self.holders, key, mirror.bit)

    @staticmethod
    def _drop_bit(masks: dict[Any, int], key: Any, bit: int) -> None:
        mask = masks.get(key, 0) & ~bit
        if mask:
            masks[key] = mask
        else:
            masks.pop(key, None)
