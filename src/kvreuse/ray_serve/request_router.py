"""Ray Serve request routers for the replicas.

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
to the process's ``ReplicaTracker`` (``kvreuse.ray_serve.tracker``, which says why it lives
in a module of its own), which adds and retires the ingress router's executors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

if TYPE_CHECKING:
    from kvreuse.ray_serve.tracker import ReplicaTracker

logger = logging.getLogger(__name__)

TARGET_KWARG = "kvreuse_target"  # the replica (unique id) a call is for; None: any
PROXIED_KWARG = "kvreuse_proxied"  # True for a client's request (the baseline routes those itself)


def tracker() -> ReplicaTracker:
    """The process's tracker, imported when called (see ``kvreuse.ray_serve.tracker``: a
    module-level reference here would be pickled with this module, by value)."""
    from kvreuse.ray_serve.tracker import TRACKER

    return TRACKER


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
        tracker().replicas_changed({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        tracker().replica_died(replica_id.unique_id)

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
        tracker().replicas_changed({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        tracker().replica_died(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = _target(pending_request)
        if target is None or (pending_request is not None and pending_request.kwargs.get(PROXIED_KWARG)):
            return await super().choose_replicas(candidate_replicas, pending_request)
        return _targeted(candidate_replicas, target)


REQUEST_ROUTERS: dict[str, type[RequestRouter]] = {"kv": KVReuseRequestRouter, "pow2": PowerOfTwoBaseline}
