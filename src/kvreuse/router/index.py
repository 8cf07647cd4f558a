"""The router's index: block key -> executors holding it, fed by each executor's KV events.

Keys are the low 64 bits of a ``kvreuse.cache.hashing`` block hash (``index_key``), the form
vLLM-compatible ZMQ events carry, so events from ZMQ (int hashes) and HTTP (hex of the
full hash) land in one index. A 64-bit collision can only make the router prefer an
executor that then misses; the executor checks stored tokens on every hit, so the answer
is never wrong.

Each executor has a ``Mirror`` (its keys with their cache level, and the id of the last
event applied). ``holders`` maps each key to a bitmask of executors, so the overlap of a
request with every executor is one pass over its leading keys::

    alive = all executors
    for i, key in enumerate(keys):           # stops at the first key nobody holds
        gone = alive & ~holders[key]          # these executors' prefixes end at block i
        ...

Events change the index through one path, ``apply_record``, whatever brings them: the SSE
feed's numbered JSON events (through ``apply``, which checks ids), the ZMQ feed's wire
messages (as ``kvreuse.events.decoder`` records; the feed checks sequence numbers), and the
simulator's pools (in order by construction).

Consistency: events are applied in id order; an event whose id is not ``last + 1`` is
refused (``apply`` returns ``False``), and the owner reloads a snapshot (``load``). Until
then the index is stale, which can cost a miss, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvreuse.events.records import DEVICE_LEVEL, AllBlocksCleared, BlocksRemoved, BlocksStored, BlockUpdated
from kvreuse.events.records import CacheCreated, Event, KVEvent, KVSnapshot

IndexKey = int  # low 64 bits of a BlockHash, big-endian (as events.wire.wire_hash "int")


def index_key(block_hash: bytes) -> IndexKey:
    """The index form of a block hash (its last 8 bytes as a big-endian integer)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(slots=True)
class Mirror:
    """One executor's blocks as the router knows them."""

    bit: int  # this executor's bit in ``KVIndex.holders`` masks
    levels: dict[IndexKey, str] = field(default_factory=dict)  # key -> cache level
    last_event_id: int = -1  # id of the last event applied (-1: none, or a ZMQ feed)
    num_resyncs: int = 0  # snapshots loaded after a gap


class KVIndex:
    """Block key -> executors, per executor mirror. Not thread-safe: the router's event
    loop (or the simulator) is its only caller."""

    def __init__(self) -> None:
        self.holders: dict[IndexKey, int] = {}  # key -> bitmask of executors holding it
        self._mirrors: dict[str, Mirror] = {}
        self._handlers = {
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
    def executors(self) -> list[str]:
        return list(self._mirrors)

    @property
    def num_keys(self) -> int:
        """Distinct keys held by at least one executor."""
        return len(self.holders)

    # ------------------------------------------------------------------ queries
    def overlaps(self, keys: Sequence[IndexKey], names: Sequence[str],
                 tier_weights: Mapping[str, float] | None = None) -> dict[str, float]:
        """For each executor in ``names``: how many leading ``keys`` it holds (any cache
        level); with ``tier_weights`` (cache level -> weight, 1.0 for a level not listed),
        each held block counts its level's weight instead of 1 (a host-tier block saves less
        than a device one). O(length of the longest match). Does not modify the index."""
        counts = self._overlap_counts(keys, names)
        if tier_weights is None:
            return counts  # type: ignore[return-value]
        out: dict[str, float] = {}
        for name, n in counts.items():
            levels = self._mirrors[name].levels
            out[name] = float(sum(tier_weights.get(levels.get(key, DEVICE_LEVEL), 1.0) for key in keys[:n]))
        return out

    def _overlap_counts(self, keys: Sequence[IndexKey], names: Sequence[str]) -> dict[str, int]:
        bits = {name: self._mirrors[name].bit for name in names}
        ended: dict[int, int] = {}  # bit -> overlap
        alive = 0
        for b in bits.values():
            alive |= b
        holders = self.holders
        i = 0
        for key in keys:
            held = holders.get(key, 0) & alive
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
        return self._mirrors[name].levels.get(key)

    # ------------------------------------------------------------------ updates
    def store(self, name: str, keys: Iterable[IndexKey], level: str = DEVICE_LEVEL) -> None:
        """Note ``keys`` as held by ``name`` at ``level`` (one it held at another level moves)."""
        mirror = self._mirrors[name]
        for key in keys:
            self._hold(mirror, key, level)

    def remove(self, name: str, keys: Iterable[IndexKey], level: str | None = None) -> None:
        """Forget ``keys`` on ``name``; with ``level``, only where held at that level (a
        block that already moved to another tier stays)."""
        mirror = self._mirrors[name]
        for key in keys:
            held = mirror.levels.get(key)
            if held is not None and (level is None or held == level):
                del mirror.levels[key]
                self._drop_bit(key, mirror.bit)

    def clear(self, name: str) -> None:
        """Forget every block of ``name`` (it restarted, cleared, or is resyncing)."""
        mirror = self._mirrors[name]
        for key in mirror.levels:
            self._drop_bit(key, mirror.bit)
        mirror.levels = {}

    def apply_record(self, name: str, record: KVEvent) -> None:
        """Apply one event record to ``name``'s mirror, with no id check: the one path by
        which events change the index (``apply``, the ZMQ feed and the simulator call it).

        stored: each block held at its level; removed: dropped where held at the record's
        level (at any level when it is ``None``); cleared: ``clear``; updated: a held block
        follows a level move (priorities are not indexed); created: nothing. Raises
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
        if record.new_cache_level is not None and key in mirror.levels:
            mirror.levels[key] = record.new_cache_level

    def _hold(self, mirror: Mirror, key: IndexKey, level: str) -> None:
        mirror.levels[key] = level
        self.holders[key] = self.holders.get(key, 0) | mirror.bit

    def _drop_bit(self, key: IndexKey, bit: int) -> None:
        mask = self.holders.get(key, 0) & ~bit
        if mask:
            self.holders[key] = mask
        else:
            self.holders.pop(key, None)
