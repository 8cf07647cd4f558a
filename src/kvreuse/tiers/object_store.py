"""The object tier: encoded blocks in an S3 bucket (any S3 API server), below disk and remote.

Objects::

    s3://<bucket>/<prefix>/kvreuse-v<FORMAT_VERSION>/<namespace.tag>/<block key hex>.kvb  ->  encode_block bytes

so executors share objects exactly when their ``TierNamespace`` is equal (model fingerprint,
hash algorithm, block size), as in the Redis store; the tenant salt is inside the chained key.
Where the server is and who we are come from the standard AWS settings, read by the AWS SDK
(boto3) itself: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (absent: AWS), ``AWS_ACCESS_KEY_ID``
/ ``AWS_SECRET_ACCESS_KEY`` (or any other credential source the SDK knows: profiles, roles),
``AWS_REGION`` / ``AWS_DEFAULT_REGION``. The bucket must exist: the store never creates one.

With ``ttl_s`` an object is purged once it is ``ttl_s`` old (its ``LastModified``: the time of
its last write, not of its last read; S3 cannot renew an object's age without rewriting it).
A read refuses an object past its age at once (a miss; it is deleted), and ``purge_expired``
lists the namespace and deletes every such object (``start_purging`` runs it periodically).

Contracts (a down, slow or emptied bucket never fails a request), as ``RemoteStore``'s:

- No call raises for a store failure. ``put`` returns False, ``fetch_many`` None (or a
  shorter answer); each failure is counted (``errors``, ``timeouts``) and warned once per streak.
- Every request is bounded by ``timeout_s`` (connect and each read), with no retries in the
  SDK: the breaker decides about retrying.
- A ``CircuitBreaker`` opens after ``failure_threshold`` consecutive failures: calls are then
  skipped without touching the network (``skipped``) for ``cooldown_s``; the next call probes.
- Only blocks that pass ``decode_block`` are returned; an object that fails is deleted and
  counted (``corrupt`` / ``foreign``).
- Thread-safe (a boto3 client is; the counters lock).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import boto3
import botocore.exceptions
import torch
from botocore.config import Config

from kvreuse.cache.hashing import BlockHash
from kvreuse.tiers.block_codec import BlockRecord, CorruptBlock, ForeignBlock, decode_block
from kvreuse.tiers.circuit_breaker import CircuitBreaker
from kvreuse.tiers.namespace import FORMAT_VERSION, TierNamespace
from kvreuse.tiers.store_calls import STORE_COUNTERS, GuardedCalls
from kvreuse.tiers.store_counters import FailureStreak, StoreCounters

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

COUNTERS = (*STORE_COUNTERS, "expired")
SUFFIX = ".kvb"
BLOCK_HASH_BYTES = (32, 8)  # sha256 and xxh3_64 digests (kvreuse.cache.hashing): a block's key length
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules (the common part)
_ABSENT_CODES = {"NoSuchKey", "404", "NotFound"}  # an answer: the object is not there
_TIMEOUTS = (botocore.exceptions.ConnectTimeoutError, botocore.exceptions.ReadTimeoutError, TimeoutError)
_STORE_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """Where ``--object-cache s3://BUCKET/PREFIX`` points."""

    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> ObjectLocation:
        """``s3://bucket`` or ``s3://bucket/some/prefix``; raises ``ValueError`` naming
        ``--object-cache`` for anything else."""
        scheme, sep, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme != "s3" or not sep or not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"--object-cache takes s3://BUCKET[/PREFIX] (bucket: 3-63 of a-z 0-9 . -), got {url!r}")
        prefix = prefix.strip("/")
        return cls(bucket, prefix + "/" if prefix else "")


class ObjectStore:
    """Blocks of one namespace under ``url`` (``s3://bucket/prefix``) on an S3 API server."""

    def __init__(
        self,
        url: str,
        *,
        namespace: TierNamespace,
        ttl_s: float | None = None,
        timeout_s: float = 2.0,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        parallel_reads: int = 8,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"--object-cache-ttl must be > 0 seconds, got {ttl_s}")
        if timeout_s <= 0 or parallel_reads < 1:
            raise ValueError(f"timeout_s must be > 0 and parallel_reads >= 1, got {timeout_s}, {parallel_reads}")
        self.location = ObjectLocation.parse(url)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.key_prefix = f"{self.location.prefix}kvreuse-v{FORMAT_VERSION}/{namespace.tag}/"
        self._client: Any = boto3.session.Session().client(  # endpoint, credentials, region: AWS_* settings
            "s3",
            config=Config(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"total_max_attempts": 1},  # the breaker decides about retrying
                max_pool_connections=parallel_reads + 2,  # the reads, the writer, the purger
            ),
        )
        self.identity = store_identity(self._client.meta.endpoint_url, self.location, self.key_prefix)
        self.parallel_reads = parallel_reads
        self._reads = ThreadPoolExecutor(parallel_reads, thread_name_prefix="kv-object-read")
        self._clock = clock  # wall-clock seconds: compared with the server's LastModified
        self.breaker = CircuitBreaker(failure_threshold, cooldown_s)
        self._counters = StoreCounters(COUNTERS)
        self._calls = GuardedCalls(
            "object cache",
            breaker=self.breaker,
            counters=self._counters,
            streak=FailureStreak(logger, f"object cache s3://{self.location.bucket}/{self.key_prefix}"),
            errors=_STORE_ERRORS,
            timeouts=_TIMEOUTS,
            logger=logger,
        )
        self._on_removed: Callable[[BlockHash], None] | None = None
        self._stop_purging = threading.Event()
        self._purger: threading.Thread | None = None

    def object_key(self, key: BlockHash) -> str:
        """The object key of block ``key`` in this namespace."""
        return f"{self.key_prefix}{bytes(key).hex()}{SUFFIX}"

    def listen(self, on_removed: Callable[[BlockHash], None]) -> None:
        """Call ``on_removed(key)`` for every object this store deletes (refused, past its age,
        purged), from the thread that deleted it: quick, never raising (a queue put)."""
        self._on_removed = on_removed

    # -- reads -----------------------------------------------------------------------------

    def fetch_many(
        self, keys: Sequence[BlockHash], *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> list[BlockRecord | None] | None:
        """The leading run of ``keys`` the bucket holds: per key, the verified record, or None
        for a key the store answered it does not hold (absent, past its age, or refused and
        deleted), which ends the run. Reads ``parallel_reads`` keys at a time and stops at
        the first window with a miss, so the answer may be shorter than ``keys`` (after the
        first None, or where a read failed: nothing is known of the rest). None: the first
        read failed or the breaker skipped it."""
        out: list[BlockRecord | None] = []
        for start in range(0, len(keys), self.parallel_reads):
            window = keys[start : start + self.parallel_reads]
            for answered, record in self._reads.map(lambda key: self._read(key, shape, dtype), window):
                if not answered:
                    return self._answer(out, len(keys)) or None
                out.append(record)
                if record is None:
                    return self._answer(out, len(keys))
        return self._answer(out, len(keys))

    def _answer(self, out: list[BlockRecord | None], asked: int) -> list[BlockRecord | None]:
        hits = sum(record is not None for record in out)
        self._counters.add("hits", hits)
        self._counters.add("misses", asked - hits)
        return out

    def _read(self, key: BlockHash, shape, dtype) -> tuple[bool, BlockRecord | None]:
        """(answered, record): (False, None) when the read failed or was skipped."""
        answered, found = self._call(lambda: self._get(self.object_key(key)))
        if not answered:
            return False, None
        if found is None:
            return True, None
        data, written_at = found
        if self.ttl_s is not None and self._clock() - written_at >= self.ttl_s:
            self._counters.add("expired")
            self.delete(key)
            return True, None
        try:
            record = decode_block(data, self.namespace, key=key, shape=shape, dtype=dtype)
        except CorruptBlock as exc:
            kind = "foreign" if isinstance(exc, ForeignBlock) else "corrupt"
            self._counters.add(kind)
            logger.warning("object cache: refused %s object %s (%s); deleted", kind, self.object_key(key), exc)
            self.delete(key)
            return True, None
        return True, record

    def _get(self, object_key: str) -> tuple[bytes, float] | None:
        """The object's bytes and write time (seconds since the epoch), None when absent.
        Raises for a failure."""
        try:
            response = self._client.get_object(Bucket=self.location.bucket, Key=object_key)
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _ABSENT_CODES:
                return None
            raise
        with response["Body"] as body:
            data = body.read()
        return data, response["LastModified"].timestamp()

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: BlockHash, payload: bytes) -> bool:
        """Store ``payload`` (``encode_block`` bytes of block ``key``); its age starts now.
        False when it failed or was skipped."""
        ok, _ = self._call(
            lambda: self._client.put_object(Bucket=self.location.bucket, Key=self.object_key(key), Body=payload)
        )
        self._counters.add("puts" if ok else "put_failures")
        return ok

    def delete(self, key: BlockHash) -> bool:
        """Delete the object (absent is fine); True when the store answered."""
        ok, _ = self._call(lambda: self._client.delete_object(Bucket=self.location.bucket, Key=self.object_key(key)))
        if ok:
            self._removed(key)
        return ok

    def purge_expired(self) -> int:
        """Delete every object of this namespace ``ttl_s`` old or older (by ``LastModified``);
        the number deleted. 0 without a TTL or when the store does not answer."""
        if self.ttl_s is None:
            return 0
        _, old = self._call(self._list_expired)
        purged = 0
        for start in range(0, len(old or ()), 1000):  # DeleteObjects takes 1,000 keys at most
            batch = (old or [])[start : start + 1000]
            deleted = self._delete_many(batch)
            if deleted is None:
                break
            purged += deleted
        self._counters.add("expired", purged)
        return purged

    def _delete_many(self, keys: list[BlockHash]) -> int | None:
        """Delete ``keys``' objects; the number deleted (those the store reported no error
        for: only they are announced as removed), ``None`` when the call failed."""
        objects = [{"Key": self.object_key(key)} for key in keys]
        done, answer = self._call(
            lambda: self._client.delete_objects(Bucket=self.location.bucket, Delete={"Objects": objects, "Quiet": True})
        )
        if not done:
            return None
        failed = {e.get("Key") for e in (answer or {}).get("Errors", ())}
        deleted = [key for key in keys if self.object_key(key) not in failed]
        for key in deleted:
            self._removed(key)
        return len(deleted)

    def _list_expired(self) -> list[BlockHash]:
        now, ttl = self._clock(), self.ttl_s or 0.0
        old: list[BlockHash] = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=self.key_prefix
        )
        for page in pages:
            for item in page.get("Contents", ()):
                name = item["Key"][len(self.key_prefix) :]
                if name.endswith(SUFFIX) and now - item["LastModified"].timestamp() >= ttl:
                    try:
                        key = BlockHash(bytes.fromhex(name[: -len(SUFFIX)]))
                    except ValueError:  # not a block of this store: not ours to delete
                        continue
                    # only a name this store writes (lowercase hex of a block hash's length)
                    if len(key) in BLOCK_HASH_BYTES and self.object_key(key) == item["Key"]:
                        old.append(key)
        return old

    def start_purging(self, interval_s: float | None = None) -> None:
        """Run ``purge_expired`` every ``interval_s`` seconds (default: a quarter of the TTL,
        between 1 s and 10 minutes) on a daemon thread until ``close``."""
        if interval_s is None:
            interval_s = min(max((self.ttl_s or 600.0) / 4, 1.0), 600.0)

        def loop() -> None:
            while not self._stop_purging.wait(interval_s):
                try:
                    self.purge_expired()
                except Exception:  # never raises by contract; a bug must not end the purges
                    logger.exception("object cache: purge failed")

        self._purger = threading.Thread(target=loop, name="kv-object-purge", daemon=True)
        self._purger.start()

    def check_bucket(self) -> bool:
        """Whether the bucket answers now (``HeadBucket``); warns naming it when not. A store
        that does not answer is a miss on every read until it does, never an error."""
        ok, _ = self._call(lambda: self._client.head_bucket(Bucket=self.location.bucket))
        if not ok:
            logger.warning(
                "object cache: bucket %r at %s does not answer now (missing, no access, or the server is "
                "down); reads are misses and writes are dropped until it does",
                self.location.bucket,
                self._client.meta.endpoint_url,
            )
        return ok

    def stats(self) -> dict[str, int]:
        """Counters since start, plus ``breaker_open`` (1 while calls are skipped)."""
        return self._counters.snapshot() | {"breaker_open": self._calls.breaker_open()}

    def close(self) -> None:
        """Stop the purges and the read threads, close the connections."""
        self._stop_purging.set()
        self._reads.shutdown(wait=True)
        self._client.close()

    # -- internals -------------------------------------------------------------------------

    def _removed(self, key: BlockHash) -> None:
        if self._on_removed is not None:
            self._on_removed(key)

    def _call(self, operation: Callable[[], _T]) -> tuple[bool, _T | None]:
        """Run one S3 operation under the breaker (``GuardedCalls``): (True, result), or
        (False, None) when it was skipped or failed."""
        return self._calls.run(operation)


def store_identity(endpoint_url: str, location: ObjectLocation, key_prefix: str) -> str:
    """16 hex of a SHA-256 over the endpoint, bucket and key prefix (namespace included):
    executors reporting the same identity share objects. No credentials go in."""
    text = f"kvreuse-object-store|{endpoint_url}|{location.bucket}|{key_prefix}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
