"""The router's core: executors, index, hasher and policy; decisions and health.

``Router.decide`` is the whole routing decision::

    body --PromptHasher--> block keys --KVIndex.overlaps--> Candidates --policy--> Decision

Only healthy executors that have not already failed this request are candidates, so a
request is never sent back to a dead executor. ``health_loop`` probes every executor's
``/health`` (and ``/metrics`` for load); one that fails is taken out, one that answers
again is re-checked (``/v1/kvreuse/info`` must still match the router's hash settings)
and put back. The proxy (``kvreuse.router.proxy``) marks an executor down at once when it
refuses a connection.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection
from dataclasses import dataclass

import httpx

from kvreuse.router.executors import Executor, ExecutorInfo, IncompatibleExecutors, parse_load_metrics
from kvreuse.router.feeds import SSEFeed, ZmqFeed, http_snapshot
from kvreuse.router.index import KVIndex
from kvreuse.router.policy import Candidate, Decision, RoutingPolicy, choose
from kvreuse.router.prompt_keys import HashSettings, PromptHasher, RequestKeys

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutedRequest:
    keys: RequestKeys
    candidates: list[Candidate]
    decision: Decision


class Router:
    def __init__(self, executors: list[Executor], hasher: PromptHasher, policy: RoutingPolicy, *,
                 client: httpx.AsyncClient, health_interval_s: float = 1.0, seed: int | None = None) -> None:
        self.executors = {e.name: e for e in executors}
        self.hasher = hasher
        self.settings: HashSettings = hasher.settings
        self.policy = policy
        self.client = client
        self.health_interval_s = health_interval_s
        self.index = KVIndex()
        for e in executors:
            self.index.add_executor(e.name)
        self.rng = random.Random(seed)
        self.feeds: dict[str, SSEFeed | ZmqFeed] = {}
        self._tasks: list[asyncio.Task] = []
        self.num_retries = 0
        from kvreuse.router.metrics import RouterMetrics  # it reads this object's state

        self.metrics = RouterMetrics(self)

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    # ------------------------------------------------------------------ decisions
    def candidates(self, keys: RequestKeys, exclude: Collection[str] = ()) -> list[Candidate]:
        names = [n for n, e in self.executors.items() if e.healthy and n not in exclude]
        overlaps = self.index.overlaps(keys.keys, names)
        return [Candidate(n, overlaps[n], len(keys.keys), self.executors[n].load_blocks, self.executors[n].in_flight)
                for n in names]

    def decide(self, keys: RequestKeys, exclude: Collection[str] = ()) -> RoutedRequest | None:
        """The policy's choice among healthy executors not in ``exclude``; ``None`` if none."""
        cands = self.candidates(keys, exclude)
        if not cands:
            return None
        return RoutedRequest(keys, cands, choose(self.policy, cands, self.rng))

    def prompt_blocks(self, keys: RequestKeys) -> int:
        return -(-keys.num_tokens // self.block_size)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the health loop and one event feed per executor (call inside the loop)."""
        self._tasks.append(asyncio.create_task(self.health_loop(), name="router-health"))
        for e in self.executors.values():
            feed = self._feed_for(e)
            self.feeds[e.name] = feed
            self._tasks.append(asyncio.create_task(feed.run(), name=f"router-feed-{e.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _feed_for(self, e: Executor) -> SSEFeed | ZmqFeed:
        endpoint = (e.info.events.get("zmq_endpoint") if e.info else None) or None
        if endpoint:
            host = httpx.URL(e.url).host
            endpoint = endpoint.replace("*", host).replace("0.0.0.0", host)
            return ZmqFeed(self.index, e.name, endpoint, http_snapshot(self.client, e.url),
                           topic=e.info.events.get("zmq_topic") or "")  # type: ignore[union-attr]
        return SSEFeed(self.index, e.name, e.url, self.client)

    # ------------------------------------------------------------------ health
    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(e) for e in self.executors.values()))
            await asyncio.sleep(self.health_interval_s)

    async def probe(self, e: Executor) -> None:
        """One health check: ``/health`` 200, and for a returning executor a matching
        ``/v1/kvreuse/info``; then its load gauges from ``/metrics``."""
        try:
            resp = await self.client.get(f"{e.url}/health", timeout=2.0)
            if resp.status_code != 200:
                e.mark_down(f"/health answered {resp.status_code}")
                return
            if not e.healthy:
                info = await fetch_info(self.client, e.url)
                if info.settings != self.settings:
                    raise IncompatibleExecutors(
                        f"{e.url} came back with {info.settings}, the router serves {self.settings}")
                e.info = info
                e.healthy = True
                e.last_error = None
                logger.info("executor %s is up", e.url)
            metrics = await self.client.get(f"{e.url}/metrics", timeout=2.0)
            if metrics.status_code == 200:
                e.remote = parse_load_metrics(metrics.text)
        except (httpx.HTTPError, ValueError) as exc:
            if e.healthy:
                logger.warning("executor %s is down: %r", e.url, exc)
            e.mark_down(repr(exc))


async def fetch_info(client: httpx.AsyncClient, url: str) -> ExecutorInfo:
    """``GET url/v1/kvreuse/info``. Raises ``httpx.HTTPError`` or ``ValueError``."""
    resp = await client.get(f"{url}/v1/kvreuse/info", timeout=5.0)
    if resp.status_code == 404:
        raise ValueError(f"{url} has no /v1/kvreuse/info: is it a kvreuse executor of this version?")
    resp.raise_for_status()
    return ExecutorInfo.from_json(url, resp.json())
