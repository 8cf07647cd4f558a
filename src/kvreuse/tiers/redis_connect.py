"""Redis clients for the remote tier, from its URL: one server, or a Redis Cluster.

    redis://HOST:PORT/DB, rediss://..., unix://PATH?db=N   one server (a connection pool)
    redis+cluster://HOST:PORT, rediss+cluster://HOST:PORT   a Redis Cluster or Valkey cluster:
                                                            any node is the seed (TLS: rediss)

Both clients time out every socket operation after ``timeout_s`` and retry nothing on their
own (the store's circuit breaker decides). The cluster client still follows ``MOVED`` and
``ASK`` redirections (a slot that moved is answered by its new owner) and refreshes its slot
map after a connection error, so a failover is picked up by the next call. It is built lazily:
a cluster that is down when the executor starts is a miss, not a failed start.

Where a store is (``StoreTarget.where``) feeds the store's identity: host and port (or the
socket path) and the database of one server; for a cluster, the sorted node ids of its
members as the cluster itself lists them (``CLUSTER NODES``), so executors seeded with
different nodes of one cluster report the same identity.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # ours -> redis-py's scheme
# what a failed call can raise: redis-py's errors (a cluster's topology errors are not
# RedisError), and OSError for socket errors it does not wrap
STORE_ERRORS = (redis.RedisError, RedisClusterException, OSError)


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """A parsed ``--remote-cache`` URL."""

    url: str  # what redis-py parses: ``+cluster`` removed from the scheme
    cluster: bool
    where: str  # host:port or socket path of the seed (logs; the identity of one server)


def redacted(url: str) -> str:
    """``url`` with its user and password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


def parse_target(url: str) -> StoreTarget:
    """Raises ``ValueError`` (the URL's credentials redacted) for a URL that names no Redis,
    or a cluster URL with a database other than 0 (a cluster has only database 0)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    cluster = scheme in CLUSTER_SCHEMES
    if cluster:
        if parts.path.strip("/") not in ("", "0") or parse_qs(parts.query).get("db", ["0"]) != ["0"]:
            raise ValueError(f"a Redis Cluster has only database 0: {redacted(url)!r}")
        if not parts.hostname:
            raise ValueError(f"a cluster URL names one node as the seed (HOST:PORT): {redacted(url)!r}")
        url = urlunsplit((CLUSTER_SCHEMES[scheme], parts.netloc, "", parts.query, ""))
    elif scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            "--remote-cache takes redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://, "
            f"got {redacted(url)!r}"
        )
    where = parts.path if scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
    return StoreTarget(url, cluster, where)


def single_client(target: StoreTarget, timeout_s: float) -> tuple[redis.Redis, str]:
    """A client of one server (it connects on first use) and where it is, with its database."""
    pool = redis.ConnectionPool.from_url(  # raises ValueError for a malformed URL: a config error
        target.url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # the breaker decides about retrying, not the client
        health_check_interval=0,
    )
    kwargs = pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
    return redis.Redis(connection_pool=pool), f"{where}|db={kwargs.get('db', 0)}"


def cluster_client(target: StoreTarget, timeout_s: float) -> RedisCluster:
    """A cluster client: asks the seed (or, failing it, nothing else) for the slot map now.
    Raises one of ``STORE_ERRORS`` when no node answers."""
    return RedisCluster.from_url(
        target.url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # no retry loop over errors; redirections are still followed
        require_full_coverage=False,  # a master down without a replica: its slots miss, the map still loads
        health_check_interval=0,
    )


def cluster_members(client: RedisCluster) -> str:
    """The cluster's identity: a SHA-256 over its members' node ids, sorted, as the node the
    client asks lists them. Stable across failovers, restarts and slot moves; it changes when
    a node joins or is forgotten. Raises one of ``STORE_ERRORS``."""
    nodes = client.cluster_nodes()  # {"host:port": {"node_id": ..., ...}} from one node
    ids = sorted(str(info["node_id"]) for info in nodes.values())
    return "cluster:" + hashlib.sha256(",".join(ids).encode()).hexdigest()
