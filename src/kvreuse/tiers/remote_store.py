"""The shared remote tier: encoded blocks in Redis (or Valkey), shared by executors of one model:
one server (``redis://``) or a Redis Cluster / Valkey cluster (``redis+cluster://``, any node as
the seed; ``kvreuse.tiers.redis_connect``).

Keys::

    kvreuse:v<FORMAT_VERSION>:<namespace.tag>:<block key hex>   ->   encode_block bytes

so executors share entries exactly when their ``TierNamespace`` is equal (model fingerprint,
hash algorithm, block size); the tenant salt is already inside the chained key. In a cluster
the keys carry no hash tag: they spread over all 16,384 slots, hence over every master, and a
batch read is one cluster pipeline (one round trip per master, in parallel), never a MGET. With
``ttl_s`` every write sets it (``SET .. EX``) and every hit renews it (``GETEX .. EX``): the
TTL is idle time, as on disk. Without it entries live until Redis evicts them
(``maxmemory-policy``) or someone flushes the database; both are plain misses here.

Contracts (a down, slow or flushed Redis never fails a request):

- No call raises for a store failure. ``get`` returns None, ``put`` False, ``contains``
  False; each failure is counted (``errors``, ``timeouts``) and warned once per streak.
- Every socket operation is bounded by ``timeout_s`` (connect and each reply), with no
  retries inside the client: the worst case of one call is about ``2 x timeout_s`` (a
  cluster: plus the slot-map reload after a connection error, ``timeout_s`` per node tried).
- A ``CircuitBreaker`` opens after ``failure_threshold`` consecutive failures: calls are then
  skipped without touching the network (``skipped``) for ``cooldown_s``; the next call
  probes (the client reconnects on its own) and a success closes the breaker.
- ``get`` returns only blocks that pass ``decode_block``; a stored value that fails is
  deleted from Redis and counted (``corrupt`` / ``foreign``).
- A cluster master that dies, a slot that moves (``MOVED`` / ``ASK`` are followed), a cluster
  that is down (``CLUSTERDOWN``) or unreachable at start: each is a failed call as above, a
  miss. A batch that touches a dead master misses as a whole; the client reloads its slot
  map after the error, and the breaker's probe reloads it again first, so once the cluster
  has failed the master over to a replica the probe (and every call after it) hits again.
- A cluster that no node of answers at start gets a stand-in identity (its seed's address,
  ``provisional``) for as long as it does not answer; the first call that works derives the
  identity from the cluster's members, as at start, so executors seeded with different
  nodes agree again once it is up.
- Thread-safe (redis-py's connection pools; the cluster client is built once, under a lock).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import redis
import torch
from redis.cluster import RedisCluster

from kvreuse.cache.hashing import BlockHash
from kvreuse.tiers.block_codec import BlockRecord, CorruptBlock, ForeignBlock, decode_block
from kvreuse.tiers.circuit_breaker import CircuitBreaker
from kvreuse.tiers.namespace import FORMAT_VERSION, TierNamespace
from kvreuse.tiers.redis_connect import STORE_ERRORS, cluster_client, cluster_members, parse_target, single_client
from kvreuse.tiers.store_calls import STORE_COUNTERS, GuardedCalls
from kvreuse.tiers.store_counters import FailureStreak, StoreCounters

logger = logging.getLogger(__name__)
_T = TypeVar("_T")  # what a Redis operation returns

COUNTERS = STORE_COUNTERS


class RemoteStore:
    """Blocks of one namespace in the Redis database at ``url`` (``redis://HOST:PORT/DB``), or
    in the cluster one of whose nodes is at ``url`` (``redis+cluster://HOST:PORT``)."""

    def __init__(
        self,
        url: str,
        *,
        namespace: TierNamespace,
        timeout_s: float = 0.5,
        ttl_s: float | None = None,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 s or None, got {ttl_s} (Redis TTLs are whole seconds here)")
        self.namespace = namespace
        self.ttl_s = None if ttl_s is None else int(ttl_s)
        self.prefix = f"kvreuse:v{FORMAT_VERSION}:{namespace.tag}:"
        self.target = parse_target(url)  # raises ValueError for a URL that names no Redis
        self.timeout_s = timeout_s
        self.breaker = CircuitBreaker(failure_threshold, cooldown_s, clock)
        self._counters = StoreCounters(COUNTERS)
        kind = "remote cache cluster" if self.target.cluster else "remote cache"
        self._calls = GuardedCalls(
            "remote cache",
            breaker=self.breaker,
            counters=self._counters,
            streak=FailureStreak(logger, f"{kind} {self.target.where}"),
            errors=STORE_ERRORS,
            timeouts=(redis.TimeoutError, TimeoutError),
            logger=logger,
        )
        self._client: redis.Redis | RedisCluster | None = None
        self._connect_lock = threading.Lock()
        self._identity_lock = threading.Lock()
        self.provisional = False  # True while ``identity`` is the seed's stand-in (``_cluster_where``)
        if self.target.cluster:
            self.identity = store_identity(self._cluster_where(), self.prefix)
        else:
            self._client, where = single_client(self.target, timeout_s)
            self.identity = store_identity(where, self.prefix)

    def redis_key(self, key: BlockHash) -> str:
        """The Redis key of block ``key`` in this namespace."""
        return self.prefix + bytes(key).hex()

    # -- reads -----------------------------------------------------------------------------

    def get(
        self, key: BlockHash, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> BlockRecord | None:
        """The verified block under ``key``, or None (absent, refused, store down or skipped)."""
        return self.get_many([key], shape=shape, dtype=dtype)[0]

    def get_many(
        self, keys: Sequence[BlockHash], *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> list[BlockRecord | None]:
        """``get`` for each key, in one round trip (a pipeline). All None when the store fails."""
        found = self.fetch_many(keys, shape=shape, dtype=dtype)
        return [None] * len(keys) if found is None else found

    def fetch_many(
        self, keys: Sequence[BlockHash], *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> list[BlockRecord | None] | None:
        """``get_many``, telling a store that answered from one that did not: None when the
        call failed or the breaker skipped it (nothing is known of the keys); else, per key,
        the verified record or None (absent, or refused and deleted)."""
        if not keys:
            return []
        values = self._call(lambda: self._fetch(keys))
        if values is None:
            self._counters.add("misses", len(keys))
            return None
        return [self._decode(key, value, shape, dtype) for key, value in zip(keys, values, strict=True)]

    def contains(self, key: BlockHash) -> bool:
        """Whether Redis holds an entry for ``key`` (not verified; ``get`` verifies)."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        """``contains`` for each key in one round trip; all False when the store fails."""
        if not keys:
            return []

        def exists() -> list:
            pipe = self.client().pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            return pipe.execute()

        found = self._call(exists)
        return [False] * len(keys) if found is None else [bool(n) for n in found]

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: BlockHash, payload: bytes) -> bool:
        """Store ``payload`` (``encode_block`` bytes of block ``key``). False when it failed or
        was skipped."""
        ok = self._call(lambda: self.client().set(self.redis_key(key), payload, ex=self.ttl_s))
        self._counters.add("puts" if ok else "put_failures")
        return bool(ok)

    def delete(self, key: BlockHash) -> bool:
        """Delete the entry; True when one was deleted."""
        return bool(self._call(lambda: self.client().delete(self.redis_key(key))))

    def stats(self) -> dict[str, int]:
        """Counters since start, plus ``breaker_open`` (1 while calls are skipped)."""
        return self._counters.snapshot() | {"breaker_open": self._calls.breaker_open()}

    def close(self) -> None:
        """Close the connections (a later call would open new ones)."""
        if self._client is not None:
            self._client.close()

    def client(self) -> redis.Redis | RedisCluster:
        """The client; a cluster's is built on first use (it loads the slot map). Raises one
        of ``STORE_ERRORS`` when no node of the cluster answers."""
        if self._client is None:
            with self._connect_lock:
                if self._client is None:
                    self._client = cluster_client(self.target, self.timeout_s)
        return self._client

    # -- internals -------------------------------------------------------------------------

    def _cluster_where(self) -> str:
        """The cluster's members (``cluster_members``), asked now; the seed's address when
        no node answers (executors seeded alike still agree; the store stays usable), and
        ``provisional`` is set: the first call that works asks again (``_settle_identity``)."""
        try:
            return cluster_members(cast("RedisCluster", self.client()))
        except STORE_ERRORS as exc:
            logger.warning(
                "remote cache cluster %s unreachable at start (%s: %s): its reads miss until it answers",
                self.target.where,
                type(exc).__name__,
                exc,
            )
            self.provisional = True
            return f"cluster-seed:{self.target.where}"

    def _settle_identity(self) -> None:
        """A call worked, so the cluster answers: derive the identity from its members, as at
        start-up, in place of the seed's stand-in (``/v1/kvreuse/info`` and ``/health`` report
        it from now on, and a router counts the other executors' REMOTE blocks again). Stays
        provisional, to be asked again, when the cluster stops answering before it is asked."""
        with self._identity_lock:
            if not self.provisional:
                return
            try:
                where = cluster_members(cast("RedisCluster", self.client()))
            except STORE_ERRORS as exc:
                logger.debug("remote cache cluster %s: members not known yet (%r)", self.target.where, exc)
                return
            self.identity, self.provisional = store_identity(where, self.prefix), False
        logger.info("remote cache cluster %s reachable: store identity %s", self.target.where, self.identity)

    def _fetch(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        # the client does not decode responses: values are bytes (redis's types allow str)
        client = self.client()
        names = [self.redis_key(key) for key in keys]
        if self.ttl_s is None and not self.target.cluster:
            return cast("list[bytes | None]", client.mget(names))
        pipe = client.pipeline(transaction=False)  # a cluster's: one batch per master
        for name in names:
            if self.ttl_s is None:
                pipe.get(name)
            else:
                pipe.getex(name, ex=self.ttl_s)  # a hit renews the idle TTL
        return pipe.execute()

    def _decode(self, key, value, shape, dtype) -> BlockRecord | None:
        if value is None:
            self._counters.add("misses")
            return None
        try:
            record = decode_block(value, self.namespace, key=key, shape=shape, dtype=dtype)
        except CorruptBlock as exc:
            kind = "foreign" if isinstance(exc, ForeignBlock) else "corrupt"
            self._counters.add(kind)
            self._counters.add("misses")
            logger.warning("remote cache: refused %s entry %s (%s); deleted", kind, self.redis_key(key), exc)
            self.delete(key)
            return None
        self._counters.add("hits")
        return record

    def _call(self, operation: Callable[[], _T]) -> _T | None:
        """Run one Redis operation under the breaker (``GuardedCalls``); None when skipped or failed."""
        ok, result = self._calls.run(operation, before_probe=self._reload_slots if self.target.cluster else None)
        if ok and self.provisional:
            self._settle_identity()
        return result

    def _reload_slots(self) -> None:
        # the slot map was last loaded when a call failed, maybe before the cluster failed
        # the master over: reload it, or the probe asks the dead master again
        cast("RedisCluster", self.client()).nodes_manager.initialize()


def store_identity(where: str, prefix: str) -> str:
    """16 hex of a SHA-256 over where the store is (one server: host and port, or socket
    path, and database; a cluster: its members, ``cluster_members``) and the namespace
    prefix: executors that report the same identity share entries, so a router counts one's
    remote blocks as reachable from the others. No user name or password goes in, and the
    hash reveals neither the address nor the model."""
    return hashlib.sha256(f"kvreuse-remote-store|{where}|{prefix}".encode()).hexdigest()[:16]
