"""Ray Serve request routers for the replicas, and the tracker that keeps kvreuse's router
in step with the replicas Ray runs.

Every call the ingress makes to a replica names its target (``TARGET_KWARG``): a proxied
request goes where kvreuse's ``Router.decide`` sent it (the ``KVIndex`` overlap of the
prompt's block keys with each replica, fed by the replicas' KV events, scored by the
``KVPolicy``: the same code and flags as ``kvreuse route``); a health probe, snapshot or
event stream goes to the replica it is about. The decision is made in the ingress's
forward loop rather than in ``choose_replicas`` so that kvreuse's retries, mid-stream
migration and in-flight accounting know which executor has the request.

- ``KVReuseRequestRouter`` routes every call to its target. A target that is busy (at
  ``max_ongoing_requests``) gets the call when it has room; a gone one never does, and the
  transport's connect deadline fails the call so kvreuse retries it elsewhere.
- ``PowerOfTwoBaseline`` is Ray's default ``PowerOfTwoChoicesRequestRouter`` for proxied
  requests (``PROXIED_KWARG``), kvreuse's index unused: the comparison of bench/ray. Calls
  about one replica still go to it.

Both report the replicas Ray gives them (``update_replicas``, ``on_replica_actor_died``)
to ``TRACKER``, which adds and removes the ingress router's executors on the ingress's
event loop. Ray builds the request router itself, from a class path, in the ingress
process, with JSON arguments only: the tracker is therefore found through this module
(one per process), as Ray Serve LLM's own KV-aware router finds its token tracker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

if TYPE_CHECKING:
    from kvreuse.router.router import Router

logger = logging.getLogger(__name__)

TARGET_KWARG = "kvreuse_target"  # the replica (unique id) a call is for; None: any
PROXIED_KWARG = "kvreuse_proxied"  # True for a client's request (the baseline routes those itself)
REPLICA_HOST_SUFFIX = ".replica"  # an executor's URL is http://<replica id>.replica


def replica_url(replica_id: str) -> str:
    return f"http://{replica_id}{REPLICA_HOST_SUFFIX}"


def replica_of_host(host: str) -> str | None:
    """The replica id in an executor URL's host, ``None`` for any other host."""
    return host[: -len(REPLICA_HOST_SUFFIX)] if host.endswith(REPLICA_HOST_SUFFIX) else None


class ReplicaTracker:
    """The replicas Ray runs, mirrored as the ingress router's executors. Ray's request
    router calls ``replicas_changed`` / ``replica_died`` from its own event loop; the
    changes are applied on the ingress's loop, the only one that touches the router."""

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


def _target(pending_request: PendingRequest | None) -> str | None:
    """The call's target; marks the request to back off between tries (without it Ray asks
    again at once, and a busy target would spin the event loop)."""
    if pending_request is None:
        return None
    pending_request.routing_context.should_backoff = True
    return pending_request.kwargs.get(TARGET_KWARG)


def _targeted(candidates: list[RunningReplica], target: str) -> list[list[RunningReplica]]:
    return [[r] for r in candidates if r.replica_id.unique_id == target][:1]


class KVReuseRequestRouter(RequestRouter):
    """Sends each call to the replica kvreuse chose for it (``TARGET_KWARG``); a call without
    a target goes to the least busy candidate by Ray's queue-length probe."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        TRACKER.replicas_changed({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        TRACKER.replica_died(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = _target(pending_request)
        if target is None:
            return [candidate_replicas] if candidate_replicas else []
        return _targeted(candidate_replicas, target)


class PowerOfTwoBaseline(PowerOfTwoChoicesRequestRouter):
    """Ray's default router for clients' requests; calls about one replica go to it. Each
    replica found serves the request it was found for (``RequestRouter``'s matching, not the
    FIFO mixin's, which would hand a probe's replica to an older request)."""

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        TRACKER.replicas_changed({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        TRACKER.replica_died(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = _target(pending_request)
        if target is None or (pending_request is not None and pending_request.kwargs.get(PROXIED_KWARG)):
            return await super().choose_replicas(candidate_replicas, pending_request)
        return _targeted(candidate_replicas, target)


REQUEST_ROUTERS: dict[str, type[RequestRouter]] = {"kv": KVReuseRequestRouter, "pow2": PowerOfTwoBaseline}
