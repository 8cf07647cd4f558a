"""Event feeds: keep one executor's mirror in the ``KVIndex`` current.

``SSEFeed`` (the HTTP transport, always available) loops::

    GET /v1/kv_cache_state              -> index.load(snapshot)       cold start / resync
    GET /v1/kv_cache_events/stream?after=<snapshot's last_event_id>
        each event -> index.apply(...)  -> False at a gap: back to the snapshot

``ZmqFeed`` (when the executor publishes vLLM-format ZMQ events on a PUB socket it bound)
subscribes to the PUB socket, applies each batch's records
(``kvreuse.events.decoder.decode_records``) with ``index.apply_record``, the same path
``index.apply`` takes for SSE events, and resynchronises from the HTTP snapshot at start and
whenever a sequence number is skipped. ZMQ batches carry no event ids, so a batch that overlaps the snapshot is
applied again; stores and removals are idempotent, so at worst a block is briefly listed
where it was just evicted (a miss, never a wrong answer).

Any error (executor down, restart, bad data) clears the executor's mirror and retries
after ``retry_s``: a restarted executor starts empty, and stale keys would only cost
misses anyway. A feed cannot always tell a restart on its own (a ZMQ subscriber that just
loaded a snapshot takes the new process's sequence 0 as the next batch), so the router
also replaces the feed when the executor's instance id changes (``Router.resync``).

``headers`` go with every HTTP call (the router's ``--executor-api-key``).

Which transport: ZMQ when the executor advertises a bound, unencrypted PUB socket the router
can reach (``reachable_endpoint``), else SSE. Executors bind events to loopback by default,
so an executor on another machine advertises ``tcp://127.0.0.1:5557``: that is the router's
own machine, not the executor's, and the router follows such an executor over HTTP.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from kvreuse.events.records import KVSnapshot, event_from_json
from kvreuse.router.index import KVIndex

logger = logging.getLogger(__name__)

SnapshotFn = Callable[[], Awaitable[KVSnapshot]]

_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")  # a PUB socket bound to every interface


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not loopback unless it is localhost
        return False


def reachable_endpoint(endpoint: str, executor_url: str) -> str | None:
    """The ZMQ ``endpoint`` an executor at ``executor_url`` advertises, as the router can
    connect to it: a wildcard host (``*``, ``0.0.0.0``, ``::``) becomes the executor's host;
    ``None`` when it is a loopback address and the executor's host is not (the executor's
    loopback is not the router's: follow it over HTTP). Other transports (``ipc://``) as given."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    host, _, port = rest.rpartition(":")
    executor_host = httpx.URL(executor_url).host
    if host in _WILDCARDS:
        return f"tcp://{f'[{executor_host}]' if ':' in executor_host else executor_host}:{port}"
    if _is_loopback(host) and not _is_loopback(executor_host):
        return None
    return endpoint


def http_snapshot(client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None) -> SnapshotFn:
    async def fetch() -> KVSnapshot:
        resp = await client.get(f"{url}/v1/kv_cache_state", headers=headers, timeout=30.0)
        resp.raise_for_status()
        return KVSnapshot.from_json(resp.json())

    return fetch


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """Decode a ``text/event-stream`` into the JSON of each ``data:`` event."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif not line and data:
            yield json.loads("\n".join(data))
            data = []


class SSEFeed:
    """Follows ``url``'s SSE event stream into ``index`` under ``name``."""

    def __init__(
        self,
        index: KVIndex,
        name: str,
        url: str,
        client: httpx.AsyncClient,
        *,
        retry_s: float = 0.5,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.index, self.name, self.url, self.client, self.retry_s = index, name, url, client, retry_s
        self.headers = headers
        self.num_events = 0

    async def run(self) -> None:
        """Runs until cancelled."""
        snapshot = http_snapshot(self.client, self.url, self.headers)
        while True:
            try:
                self.index.load(self.name, await snapshot())
                await self._follow()
                self.index.mirror(self.name).num_resyncs += 1  # a gap: reload
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: forget, wait, start over
                logger.debug("event feed %s: %r", self.url, exc)
                self.index.clear(self.name)
                await asyncio.sleep(self.retry_s)

    async def _follow(self) -> None:
        after = self.index.mirror(self.name).last_event_id
        timeout = httpx.Timeout(10.0, read=None)
        async with self.client.stream(
            "GET",
            f"{self.url}/v1/kv_cache_events/stream",
            params={"after": after},
            headers=self.headers,
            timeout=timeout,
        ) as resp:
            resp.raise_for_status()
            async for event in sse_events(resp.aiter_lines()):
                if not self.index.apply(self.name, event_from_json(event)):
                    return
                self.num_events += 1
        raise ConnectionError("event stream ended")


class ZmqFeed:
    """Follows a vLLM-format ZMQ PUB socket into ``index``; snapshots come from ``snapshot``."""

    def __init__(
        self, index: KVIndex, name: str, endpoint: str, snapshot: SnapshotFn, *, topic: str = "", retry_s: float = 0.5
    ) -> None:
        self.index, self.name, self.endpoint, self.snapshot = index, name, endpoint, snapshot
        self.topic, self.retry_s = topic, retry_s
        self.num_batches = 0

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        from kvreuse.events.decoder import decode_records

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            while True:
                try:
                    await asyncio.sleep(0.05)  # let the subscription reach the publisher first
                    self.index.load(self.name, await self.snapshot())
                    last_seq = None
                    while True:
                        _, seq_bytes, payload = await sock.recv_multipart()
                        seq = int.from_bytes(seq_bytes, "big")
                        if last_seq is not None and seq != last_seq + 1:
                            self.index.mirror(self.name).num_resyncs += 1
                            break
                        last_seq = seq
                        for record in decode_records(payload):
                            self.index.apply_record(self.name, record)
                        self.num_batches += 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure: forget this executor's blocks, retry
                    logger.debug("zmq feed %s: %r", self.endpoint, exc)
                    self.index.clear(self.name)
                    await asyncio.sleep(self.retry_s)
        finally:
            sock.close(0)
