"""The replicas Ray runs, mirrored as the ingress router's executors (``ReplicaTracker``).

One tracker per ingress process, ``TRACKER``, found through this module: Ray builds the
request router itself from a class path and ships it pickled *by value* with its whole
module (``RequestRouterConfig`` registers the module for it), so state kept in
``kvreuse.ray_serve.request_router`` would be a copy in the ingress process. The request
routers and the ingress import this module by name at run time instead
(``kvreuse.ray_serve.request_router.tracker``), and so share one tracker, as Ray Serve LLM's
KV-aware router shares its token tracker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.router.router import Router

logger = logging.getLogger(__name__)

REPLICA_HOST_SUFFIX = ".replica"  # an executor's URL is http://<replica id>.replica


def replica_url(replica_id: str) -> str:
    return f"http://{replica_id}{REPLICA_HOST_SUFFIX}"


def replica_of_host(host: str) -> str | None:
    """The replica id in an executor URL's host, ``None`` for any other host."""
    return host[: -len(REPLICA_HOST_SUFFIX)] if host.endswith(REPLICA_HOST_SUFFIX) else None


class ReplicaTracker:
    """Ray's request router calls ``replicas_changed`` / ``replica_died`` from its own event
    loop; the changes are applied on the ingress's loop, the only one that touches the router."""

    def __init__(self) -> None:
        self.router: Router | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.replica_ids: set[str] = set()  # the last set Ray reported (any thread may read it)
        self._pending: set[str] | None = None  # a set reported before a router was attached
        self._adding: dict[str, asyncio.Task] = {}

    def attach(self, router: Router, loop: asyncio.AbstractEventLoop) -> None:
        self.router, self.loop = router, loop
        if self._pending is not None:
            loop.call_soon_threadsafe(self._sync, self._pending)

    def knows(self, replica_id: str) -> bool:
        return replica_id in self.replica_ids

    def replicas_changed(self, replica_ids: set[str]) -> None:
        self.replica_ids = set(replica_ids)
        if self.loop is None:
            self._pending = set(replica_ids)
            return
        self.loop.call_soon_threadsafe(self._sync, set(replica_ids))

    def replica_died(self, replica_id: str) -> None:
        self.replicas_changed(self.replica_ids - {replica_id})

    def _sync(self, replica_ids: set[str]) -> None:
        router = self.router
        assert router is not None  # attached before the loop is known
        current = {name for name in router.executors if name not in router.retired}
        wanted = {replica_url(r) for r in replica_ids}
        for url in wanted - current:
            if url not in self._adding:
                self._adding[url] = asyncio.get_running_loop().create_task(self._add(url))
        for url in current - wanted:
            logger.info("replica %s left: its executor is retired", url)
            asyncio.get_running_loop().create_task(router.retire_executor(url))

    async def _add(self, url: str) -> None:
        """Ask the new replica for its info (until it answers, or Ray drops it), then route to it."""
        from kvreuse.router.executors import Executor
        from kvreuse.router.router import fetch_info

        router = self.router
        assert router is not None
        try:
            while replica_of_host(url.removeprefix("http://")) in self.replica_ids:
                try:
                    info = await fetch_info(router.client, url, router.control_headers)
                except Exception as exc:  # noqa: BLE001 - not up yet: ask again
                    logger.debug("replica %s: no info yet (%r)", url, exc)
                    await asyncio.sleep(1.0)
                    continue
                if info.settings != router.settings:
                    logger.error(
                        "replica %s serves %s, the ingress %s: not routed to", url, info.settings, router.settings
                    )
                    return
                router.add_executor(Executor(url, info, healthy=True))
                logger.info("replica %s joined (instance %s)", url, info.instance_id)
                return
        finally:
            self._adding.pop(url, None)


TRACKER = ReplicaTracker()
