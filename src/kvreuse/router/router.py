"""The router's core: executors, index, hasher and policy; decisions and health.

``Router.decide`` is the whole routing decision::

    body --PromptHasher--> block keys --KVIndex.overlaps--> Candidates --policy--> Decision

Only healthy executors that have not already failed this request are candidates, so a
request is never sent back to a dead executor. ``health_loop`` probes every executor's
``/health`` (and ``/metrics`` for load); one that fails is taken out, one that answers
again is re-checked (``/v1/kvreuse/info`` must still match the router's hash settings)
and put back. The proxy (``kvreuse.router.proxy``) marks an executor down at once when it
refuses a connection.

Restarts: every executor process has an instance id (``/health``'s ``x-kvreuse-instance-id``
header and ``/v1/kvreuse/info``'s ``instance_id``). When a probe sees a new one, or the
executor comes back from being down, its mirror is cleared and its feed replaced by a new
one starting from a fresh snapshot (``resync``): the old process's blocks are gone, and a
feed cannot always tell (a ZMQ feed takes the new process's first batch as the next one).

The router's own calls to executors (info, health, metrics, snapshots, event streams)
carry ``control_headers`` (``--executor-api-key``); proxied requests carry the client's.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection
from dataclasses import dataclass

import httpx

from kvreuse.cache.kv_block import cdiv
from kvreuse.events.records import OBJECT_LEVEL
from kvreuse.router.affinity import Affinity
from kvreuse.router.deadline import DEFAULT_DEADLINES, Deadlines
from kvreuse.router.executors import (
    Executor,
    ExecutorAuthError,
    ExecutorInfo,
    IncompatibleExecutors,
    parse_load_metrics,
)
from kvreuse.router.feeds import SSEFeed, ZmqFeed, http_snapshot, reachable_endpoint
from kvreuse.router.index import KVIndex
from kvreuse.router.metrics import RouterMetrics
from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS, Candidate, Decision, RoutingPolicy, choose
from kvreuse.router.prompt_keys import HashSettings, PromptHasher, RequestKeys

logger = logging.getLogger(__name__)

INSTANCE_HEADER = "x-kvreuse-instance-id"  # on an executor's /health: its process's instance id
REMOTE_STORE_HEADER = "x-kvreuse-remote-store"  # on an executor's /health: its remote store's identity
DEFAULT_MIGRATION_LIMIT = 3  # --migration-limit


@dataclass(frozen=True)
class RoutedRequest:
    keys: RequestKeys
    candidates: list[Candidate]
    decision: Decision


class Router:
    def __init__(
        self,
        executors: list[Executor],
        hasher: PromptHasher,
        policy: RoutingPolicy,
        *,
        client: httpx.AsyncClient,
        health_interval_s: float = 1.0,
        seed: int | None = None,
        executor_api_key: str | None = None,
        tier_weights: dict[str, float] | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        deadlines: Deadlines = DEFAULT_DEADLINES,
        metrics_executor_urls: bool = False,
    ) -> None:
        self.executors = {e.name: e for e in executors}
        for i, e in enumerate(executors):
            e.id = i  # in --executor order: the name clients and scrapers see (Executor.label)
        # how long an upstream read may wait (kvreuse.router.deadline)
        self.deadlines = deadlines
        # executors a stream may be continued on after its executor fails (kvreuse.router.migration)
        self.migration_limit = migration_limit
        # cache level -> how much a block held there counts in the overlap (--tier-weights)
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS) if tier_weights is None else tier_weights
        self.hasher = hasher
        self.settings: HashSettings = hasher.settings
        self.policy = policy
        self.client = client
        self.health_interval_s = health_interval_s
        self.index = KVIndex()
        for e in executors:
            self.index.add_executor(e.name)
        self.rng = random.Random(seed)
        self.control_headers = auth_headers(executor_api_key)
        self.feeds: dict[str, SSEFeed | ZmqFeed] = {}
        self._feed_tasks: dict[str, asyncio.Task] = {}
        self.retired: set[str] = set()  # executors gone for good (retire_executor): never probed
        self._tasks: list[asyncio.Task] = []
        self.num_retries = 0
        self.affinity = Affinity()  # prompt_cache_key -> its executor (kvreuse.router.affinity)
        # /metrics labels executors by id unless --metrics-executor-urls (kvreuse.router.metrics)
        self.metrics = RouterMetrics(policy.name, self.executors, self.index, executor_urls=metrics_executor_urls)

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    def default_max_tokens(self, chat: bool, prompt_tokens: int) -> int:
        """The largest ``max_tokens`` any known executor would give a body without one
        (``kvreuse.api.protocol.default_max_tokens``; a pool not reported does not bound it),
        at least 1: what a tenant's reservation counts before the executor is chosen."""
        from kvreuse.api.protocol import default_max_tokens

        infos = [e.info for e in self.executors.values() if e.info is not None]
        return max(
            [1]
            + [
                default_max_tokens(chat, prompt_tokens, i.max_model_len, i.pool_tokens or i.max_model_len)
                for i in infos
            ]
        )

    def fits_context(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        """Whether the longest context of a known executor holds a prompt of ``prompt_tokens``
        and ``max_tokens`` more (None: the default, which fits whatever room is left); else
        every executor answers the request with its 400 (``check_prompt_length``), which a
        tenant's limiter must not turn into a 429. True while no executor reported its context."""
        lengths = [e.info.max_model_len for e in self.executors.values() if e.info and e.info.max_model_len > 0]
        if not lengths:
            return True
        longest = max(lengths)
        return prompt_tokens < longest and prompt_tokens + (max_tokens or 0) <= longest

    # ------------------------------------------------------------------ decisions
    def candidates(self, keys: RequestKeys, exclude: Collection[str] = ()) -> list[Candidate]:
        names = [n for n, e in self.executors.items() if e.healthy and n not in exclude]
        overlaps = self.index.overlaps(keys.keys, names, self.tier_weights)
        return [
            Candidate(n, overlaps[n], len(keys.keys), self.executors[n].load_blocks, self.executors[n].in_flight)
            for n in names
        ]

    def decide(
        self,
        keys: RequestKeys,
        exclude: Collection[str] = (),
        *,
        dry_run: bool = False,
        affinity_key: str | None = None,
    ) -> RoutedRequest | None:
        """The policy's choice among healthy executors not in ``exclude``; ``None`` if none.
        ``dry_run`` (``/v1/route/explain``) leaves the policy and the tie-break random state
        as they were, so it does not change what the next request gets. ``affinity_key`` (the
        body's ``prompt_cache_key``) keeps to the key's executor within the load slack."""
        cands = self.candidates(keys, exclude)
        if not cands:
            return None
        decision = choose(self.policy, cands, self.rng, dry_run=dry_run)
        if affinity_key is not None:
            decision = self.affinity.apply(affinity_key, cands, decision, dry_run=dry_run)
        return RoutedRequest(keys, cands, decision)

    def count_retry(self, executor: Executor, blocks: int) -> None:
        """A try on ``executor`` failed before its first byte and the request moves on: its
        in-flight blocks are released and the failure and the retry counted (shared by the
        OpenAI and Messages proxies)."""
        executor.end(blocks)
        executor.failures += 1
        self.num_retries += 1
        self.metrics.retries.inc()

    def labels(self, names: Collection[str]) -> str:
        """``names`` (executors' names) as a client may read them ("executor 0, executor 1";
        "none"): ``Executor.label``, never an address."""
        return ", ".join(self.executors[n].label for n in names) or "none"

    def prompt_blocks(self, keys: RequestKeys) -> int:
        return cdiv(keys.num_tokens, self.block_size)

    # ------------------------------------------------------------------ membership
    def add_executor(self, e: Executor) -> None:
        """Route to ``e`` from now on (an executor that joins after start: a Ray Serve replica,
        ``kvreuse.ray_serve``); its id is the next one, and its feed starts at once when the router
        runs. Event-loop only."""
        e.id = len(self.executors)  # executors are never deleted (retired ones stay): ids stay unique
        self.executors[e.name] = e
        self.index.add_executor(e.name)
        if self._tasks:  # started: follow its events like the others'
            self._start_feed(e)

    async def retire_executor(self, name: str) -> None:
        """Stop routing to ``name`` for good (a replica that Ray replaced): marked down, its
        feed stopped, its blocks forgotten, never probed again. It stays listed (down), so a
        request that already tried it can still name it. No-op if unknown."""
        e = self.executors.get(name)
        if e is None or name in self.retired:
            return
        self.retired.add(name)
        e.mark_down("retired")
        task = self._feed_tasks.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.index.clear(name)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the health loop and one event feed per executor (call inside the loop)."""
        self._tasks.append(asyncio.create_task(self.health_loop(), name="router-health"))
        for e in self.executors.values():
            self._start_feed(e)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._feed_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._feed_tasks.clear()

    async def resync(self, e: Executor) -> None:
        """Forget ``e``'s blocks and follow it with a new feed (from ``e.info``'s transports)
        that starts from a fresh snapshot. For an executor that restarted or came back: the
        old mirror and the old feed's position mean nothing now. No-op before ``start``."""
        task = self._feed_tasks.pop(e.name, None)
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the old feed writes nothing after this
        self.index.clear(e.name)
        self._start_feed(e)

    def _start_feed(self, e: Executor) -> None:
        # executors of one remote store (bucket) reach each other's REMOTE (OBJECT) blocks (KVIndex.set_store)
        self.index.set_store(e.name, e.info.remote_store if e.info else None)
        self.index.set_store(e.name, e.info.object_store if e.info else None, OBJECT_LEVEL)
        feed = self._feed_for(e)
        self.feeds[e.name] = feed
        self._feed_tasks[e.name] = asyncio.create_task(feed.run(), name=f"router-feed-{e.name}")

    def _feed_for(self, e: Executor) -> SSEFeed | ZmqFeed:
        """ZMQ where ``e`` advertises a PUB socket the router can reach (``reachable_endpoint``:
        not another machine's loopback), else the HTTP (SSE) feed."""
        info = e.info
        endpoint = info.zmq_endpoint if info else None
        endpoint = reachable_endpoint(endpoint, e.url) if endpoint else None
        if endpoint and info:  # an endpoint implies info
            return ZmqFeed(
                self.index,
                e.name,
                endpoint,
                http_snapshot(self.client, e.url, self.control_headers),
                topic=info.events.get("zmq_topic") or "",
            )
        return SSEFeed(self.index, e.name, e.url, self.client, headers=self.control_headers)

    # ------------------------------------------------------------------ health
    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(e) for e in self.executors.values() if e.name not in self.retired))
            await asyncio.sleep(self.health_interval_s)

    async def probe(self, e: Executor) -> None:
        """One health check: ``/health`` 200; for an executor that comes back or reports a
        new instance id (it restarted), a matching ``/v1/kvreuse/info`` and a ``resync``; for
        one whose remote store identity changed (``x-kvreuse-remote-store``), its info again
        (``_store_changed``); then its load gauges from ``/metrics``."""
        headers = self.control_headers
        try:
            resp = await self.client.get(f"{e.url}/health", headers=headers, timeout=2.0)
            if resp.status_code != 200:
                e.mark_down(f"/health answered {resp.status_code}")
                return
            instance = resp.headers.get(INSTANCE_HEADER)  # absent from older executors: no check
            restarted = instance is not None and instance != (e.info.instance_id if e.info else None)
            if not e.healthy or restarted:
                came_back = not e.healthy
                info = await fetch_info(self.client, e.url, headers)
                if info.settings != self.settings:
                    raise IncompatibleExecutors(
                        f"{e.url} came back with {info.settings}, the router serves {self.settings}"
                    )
                e.info = info
                e.healthy = True
                e.last_error = None
                if came_back:
                    logger.info("executor %s is up", e.url)
                else:
                    logger.warning("executor %s restarted (instance %s): reloading its blocks", e.url, instance)
                await self.resync(e)
            elif (
                (store := resp.headers.get(REMOTE_STORE_HEADER)) is not None and e.info and store != e.info.remote_store
            ):
                await self._store_changed(e, store)
            metrics = await self.client.get(f"{e.url}/metrics", headers=headers, timeout=2.0)
            if metrics.status_code == 200:
                e.remote = parse_load_metrics(metrics.text)
        except (httpx.HTTPError, ValueError) as exc:
            if e.healthy:
                logger.warning("executor %s is down: %r", e.url, exc)
            e.mark_down(repr(exc))

    async def _store_changed(self, e: Executor, store: str) -> None:
        """``e`` reports another remote store identity than its info said (a Redis Cluster
        down when it started, up since): read its info again and count the REMOTE blocks of
        the store it now names as reachable from it. Its own blocks stay as they are."""
        info = await fetch_info(self.client, e.url, self.control_headers)
        if info.settings != self.settings:
            raise IncompatibleExecutors(f"{e.url} now reports {info.settings}, the router serves {self.settings}")
        e.info = info
        self.index.set_store(e.name, info.remote_store)
        logger.info("executor %s: remote store %s (was reported as another one)", e.url, store)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers of the router's own calls to executors started with ``--api-key``."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_info(client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None) -> ExecutorInfo:
    """``GET url/v1/kvreuse/info`` with ``headers`` (``auth_headers``). Raises
    ``httpx.HTTPError`` or ``ValueError`` (``ExecutorAuthError`` for a 401, saying whether
    the key is missing or wrong)."""
    resp = await client.get(f"{url}/v1/kvreuse/info", headers=headers, timeout=5.0)
    if resp.status_code == 404:
        raise ValueError(f"{url} has no /v1/kvreuse/info: is it a kvreuse executor of this version?")
    if resp.status_code == 401:
        if headers and "authorization" in headers:
            raise ExecutorAuthError(
                f"{url} refused the router's API key (401): the key given with "
                "--executor-api-key (or KVREUSE_EXECUTOR_API_KEY) is wrong"
            )
        raise ExecutorAuthError(
            f"{url} requires an API key (401): start the router with --executor-api-key KEY "
            "(or KVREUSE_EXECUTOR_API_KEY), the key the executor was started with (--api-key)"
        )
    resp.raise_for_status()
    return ExecutorInfo.from_json(url, resp.json())
