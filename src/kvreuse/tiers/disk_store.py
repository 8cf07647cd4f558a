"""The disk tier: encoded blocks as files, one per block key, under a size cap and an optional TTL.

Layout::

    <directory>/<namespace.tag>/<first 2 hex of key>/<key hex>.kvb

so stores of different models or hash settings can share a directory without seeing each
other's files (each caps only its own namespace). A file is written to a temporary name in
the same folder and renamed into place (``os.replace``), so a reader never sees half a
block; a crash leaves at most a ``*.tmp`` file, removed at the next start. No fsync: a block
torn by power loss fails its checksum and is refused.

Contracts:

- ``put`` returns True when the block is on disk, False otherwise (too large for the cap,
  full or read-only disk); it never raises for an IO failure, it counts and warns.
- ``get`` returns a ``BlockRecord`` that passed ``decode_block`` (checksum, namespace, key,
  shape, dtype, finite values) or None. A file that fails verification is deleted and
  counted (``corrupt`` / ``foreign``), never returned.
- The index is rebuilt at start by scanning the namespace folder (modification time = last
  use), so a restarted executor hits its own disk; files whose names are not block keys
  are deleted and counted as ``foreign``.
- Eviction is LRU by last use (put or hit) when the bytes exceed ``max_bytes``. The TTL is
  idle time: an entry not put or hit for ``ttl_s`` seconds is purged (lazily, on ``get`` /
  ``contains`` / ``put``, or by ``purge_expired``).
- Thread-safe: the index, renames and deletions are under one lock; reads and writes of file
  contents are not. A block evicted while another thread reads it is a miss, not an error.
- Changes are observable in order: ``put``'s ``on_stored`` and the ``listen`` callback run
  under the lock as an entry enters or leaves the index (cap, TTL, a refused or vanished
  file, ``delete``), so whoever mirrors the index (``PersistentTiers``, for KV events) sees
  every key's changes in the order they happened, whichever thread made them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.cache.hashing import BlockHash
from kvreuse.tiers.block_codec import (
    HEADER_PREFIX_BYTES,
    BlockHeader,
    BlockRecord,
    CorruptBlock,
    ForeignBlock,
    decode_block,
    decode_header,
    header_bytes,
)
from kvreuse.tiers.namespace import TierNamespace
from kvreuse.tiers.store_counters import FailureStreak, StoreCounters

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_BLOCK_FILE = re.compile(r"([0-9a-f]{2})+\.kvb")
COUNTERS = (
    "hits",
    "misses",
    "puts",
    "put_failures",
    "too_large",
    "read_errors",
    "evictions",
    "expired",
    "corrupt",
    "foreign",
)


@dataclass(slots=True)
class _Entry:
    size: int  # bytes of the file
    last_used: float  # clock() of the last put or hit; the file's mtime


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` (a seam for tests that simulate a full disk)."""
    with open(path, "xb") as f:
        f.write(data)


class DiskStore:
    """Encoded blocks of one namespace in ``directory``, at most ``max_bytes`` of them."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int,
        *,
        namespace: TierNamespace,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes} (--disk-cache-size)")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s} (--disk-cache-ttl)")
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.root = Path(directory) / namespace.tag
        self._clock = clock  # wall-clock seconds: compared with file mtimes across restarts
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._counters = StoreCounters(COUNTERS)
        self._streak = FailureStreak(logger, f"disk cache {self.root}")
        self._on_removed: Callable[[BlockHash], None] | None = None
        self._rebuild()

    def listen(self, on_removed: Callable[[BlockHash], None]) -> None:
        """Call ``on_removed(key)`` whenever an entry leaves the index, from whichever thread
        removes it, under the store's lock: it must be quick, must not raise and must not
        call back into the store (e.g. put on a thread-safe queue)."""
        self._on_removed = on_removed

    # -- queries ---------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        """Whether a live entry exists (not verified; ``get`` verifies). Does not touch LRU order."""
        with self._lock:
            return self._live_entry(key, self._clock()) is not None

    def keys(self) -> list[BlockHash]:
        """The keys of the index now, least recently used first (expired ones included until
        purged)."""
        with self._lock:
            return list(self._index)

    def header(self, key: BlockHash) -> BlockHeader | None:
        """What the file of ``key`` says it is (key, parent, tokens), from its header only:
        not verified, ``get`` verifies. None when there is no such file or its header does not
        parse (``get`` will refuse it). Reads a few hundred bytes; never raises for IO."""
        try:
            with open(self._path(key), "rb") as f:
                prefix = f.read(HEADER_PREFIX_BYTES)
                head = prefix + f.read(header_bytes(prefix) - len(prefix))
            found = decode_header(head, self.namespace)
        except (OSError, CorruptBlock):
            return None
        return found if found.key == key else None

    def get(
        self,
        key: BlockHash,
        *,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        on_hit: Callable[[BlockRecord], None] | None = None,
    ) -> BlockRecord | None:
        """The verified block stored under ``key``, or None (absent, expired, unreadable, refused).
        ``on_hit(record)`` runs under the lock once the block is verified, if its entry is still in
        the index then (same rules as ``listen``'s callback): a hit whose entry another thread
        removed while this one read it returns the block it read, and reports no hold after
        that removal was reported."""
        now = self._clock()
        with self._lock:
            entry = self._live_entry(key, now)
            if entry is not None:
                entry.last_used = now
                self._index.move_to_end(key)
        if entry is None:
            self._counters.add("misses")
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted or deleted behind our back
            self._forget(key)
            self._counters.add("misses")
            return None
        except OSError as exc:
            self._counters.add("read_errors")
            self._counters.add("misses")
            self._streak.failed("cannot read %s: %s", path, exc)
            return None
        try:
            record = decode_block(data, self.namespace, key=key, shape=shape, dtype=dtype)
        except CorruptBlock as exc:
            kind = "foreign" if isinstance(exc, ForeignBlock) else "corrupt"
            self._counters.add(kind)
            self._counters.add("misses")
            logger.warning("disk cache: refused %s block file %s (%s); deleted", kind, path, exc)
            self.delete(key)
            return None
        with self._lock:
            if on_hit is not None and self._index.get(key) is not None:
                on_hit(record)
        try:
            os.utime(path, (now, now))  # last use survives a restart
        except OSError:
            pass  # read-only disk: LRU order after a restart is only a little worse
        self._counters.add("hits")
        return record

    def stats(self) -> dict[str, int]:
        """Counters since start, plus ``entries`` and ``bytes`` now."""
        with self._lock:
            gauges = {"entries": len(self._index), "bytes": self._bytes}
        return self._counters.snapshot() | gauges

    # -- changes ---------------------------------------------------------------------------

    def put(self, key: BlockHash, payload: bytes, *, on_stored: Callable[[], None] | None = None) -> bool:
        """Store ``payload`` (``encode_block`` bytes of the block keyed ``key``; a mismatch is
        refused on read) and make it the most recently used. Evicts LRU entries to stay under
        ``max_bytes``. False when it could not be stored. ``on_stored()`` runs under the lock
        once the entry is in the index, before any removal of it can be reported (same rules
        as ``listen``'s callback)."""
        size = len(payload)
        if size > self.max_bytes:
            self._counters.add("too_large")
            self._counters.add("put_failures")
            return False
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_file(tmp, payload)
        except OSError as exc:
            self._remove_quietly(tmp)
            self._counters.add("put_failures")
            self._streak.failed("cannot write %s: %s", path, exc)
            return False
        now = self._clock()
        with self._lock:
            try:
                os.replace(tmp, path)
                os.utime(path, (now, now))
            except OSError as exc:
                self._remove_quietly(tmp)
                self._counters.add("put_failures")
                self._streak.failed("cannot rename into %s: %s", path, exc)
                return False
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._index[key] = _Entry(size, now)
            self._bytes += size
            if on_stored is not None:
                on_stored()
            self._purge_expired_locked(now)
            self._evict_to_cap_locked()
        self._streak.succeeded()
        self._counters.add("puts")
        return True

    def delete(self, key: BlockHash) -> bool:
        """Remove the entry and its file; True when there was an entry."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes -= entry.size
                self._removed_locked(key)
            self._remove_quietly(self._path(key))
        return entry is not None

    def purge_expired(self) -> int:
        """Delete every entry idle for ``ttl_s`` or more; the number deleted."""
        with self._lock:
            return self._purge_expired_locked(self._clock())

    # -- internals -------------------------------------------------------------------------

    def _path(self, key: BlockHash) -> Path:
        hex_key = bytes(key).hex()
        return self.root / hex_key[:2] / f"{hex_key}{SUFFIX}"

    def _expired(self, entry: _Entry, now: float) -> bool:
        return self.ttl_s is not None and now - entry.last_used >= self.ttl_s

    def _live_entry(self, key: BlockHash, now: float) -> _Entry | None:
        """The entry for ``key``, purging it first when expired. Lock held."""
        entry = self._index.get(key)
        if entry is not None and self._expired(entry, now):
            self._drop_locked(key)
            self._counters.add("expired")
            return None
        return entry

    def _purge_expired_locked(self, now: float) -> int:
        purged = 0
        while self._index:  # LRU order is last-use order: the expired ones are at the front
            key, entry = next(iter(self._index.items()))
            if not self._expired(entry, now):
                break
            self._drop_locked(key)
            purged += 1
        self._counters.add("expired", purged)
        return purged

    def _evict_to_cap_locked(self) -> None:
        while self._bytes > self.max_bytes and len(self._index) > 1:
            self._drop_locked(next(iter(self._index)))
            self._counters.add("evictions")

    def _drop_locked(self, key: BlockHash) -> None:
        self._bytes -= self._index.pop(key).size
        self._removed_locked(key)
        self._remove_quietly(self._path(key))

    def _forget(self, key: BlockHash) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes -= entry.size
                self._removed_locked(key)

    def _removed_locked(self, key: BlockHash) -> None:
        if self._on_removed is not None:
            self._on_removed(key)

    def _remove_quietly(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._streak.failed("cannot delete %s: %s", path, exc)

    def _rebuild(self) -> None:
        """Index the files already in the namespace folder, oldest use first."""
        found: list[tuple[float, BlockHash, int]] = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for sub in self.root.iterdir():
                for path in sub.iterdir() if sub.is_dir() else (sub,):
                    self._index_file(path, found)
        except OSError as exc:
            self._streak.failed("cannot use cache directory: %s", exc)
        found.sort(key=lambda item: item[0])
        with self._lock:
            for mtime, key, size in found:
                self._index[key] = _Entry(size, mtime)
                self._bytes += size
            self._purge_expired_locked(self._clock())
            self._evict_to_cap_locked()
        if found:
            logger.info("disk cache %s: %d blocks, %d bytes found at start", self.root, len(found), self._bytes)

    def _index_file(self, path: Path, found: list[tuple[float, BlockHash, int]]) -> None:
        if path.name.endswith(".tmp"):  # a write interrupted by a crash
            self._remove_quietly(path)
            return
        if not _BLOCK_FILE.fullmatch(path.name) or path.parent.name != path.name[:2]:
            self._counters.add("foreign")
            if path.is_dir():  # never delete folders we did not make
                logger.warning("disk cache: ignoring folder %s, not made by this store", path)
                return
            logger.warning("disk cache: %s is not a block file of this store; deleted", path)
            self._remove_quietly(path)
            return
        st = path.stat()
        found.append((st.st_mtime, BlockHash(bytes.fromhex(path.name[: -len(SUFFIX)])), st.st_size))
