"""The Ray Serve application: ``KVReuseIngress`` over ``KVReuseReplica`` × N.

``build_application(options)`` binds the two deployments; ``kvreuse ray`` runs it, and a
``serve deploy`` config names ``app_builder`` (``import_path:
kvreuse.ray_serve.app:app_builder``) with the same options as ``args`` (``docs/ray.md``).

Replicas: a fixed ``replicas`` count, or Ray's autoscaling on queue length when
``max_replicas`` is given (``min_replicas`` .. ``max_replicas``, scaled so each replica has
about ``target_ongoing_requests`` requests in flight or queued). ``max_ongoing_requests``
bounds what one replica takes at once (more wait in the ingress's queue); it should be at
least the engine's ``--max-num-seqs``, and it counts the ingress's own calls (health probes,
snapshots) too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ray import serve

from kvreuse.ray_serve.ingress import KVReuseIngress
from kvreuse.ray_serve.replica import KVReuseReplica
from kvreuse.ray_serve.request_router import REQUEST_ROUTERS

APP_NAME = "kvreuse"
REPLICA_DEPLOYMENT = "kvreuse-replica"
INGRESS_DEPLOYMENT = "kvreuse-ingress"


@dataclass(frozen=True)
class RayAppOptions:
    serve_args: list[str] = field(default_factory=list)  # kvreuse serve's flags, for every replica
    route_args: list[str] = field(default_factory=list)  # kvreuse route's flags, for the ingress
    replicas: int = 1  # fixed count (ignored with max_replicas)
    min_replicas: int = 1  # autoscaling, with max_replicas
    max_replicas: int | None = None
    target_ongoing_requests: float = 2.0  # autoscaling: requests per replica (in flight + queued)
    max_ongoing_requests: int = 64
    request_router: str = "kv"  # kv (kvreuse's index and policy) or pow2 (Ray's default, a baseline)
    replica_cpus: float = 1.0  # Ray CPUs per replica (Ray sets OMP_NUM_THREADS from it)

    def __post_init__(self) -> None:
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {sorted(REQUEST_ROUTERS)}, got {self.request_router!r}")
        if self.replicas < 1 or self.min_replicas < 0:
            raise ValueError("replicas must be >= 1 and min_replicas >= 0")
        if self.max_replicas is not None and self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas and >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RayAppOptions:
        """From a ``serve deploy`` config's ``args``; ``ValueError`` names an unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown kvreuse ray option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scaling(self) -> dict[str, Any]:
        """The replica deployment's ``num_replicas`` or ``autoscaling_config`` option."""
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        return {
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "initial_replicas": max(self.min_replicas, 1),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        }


def build_application(options: RayAppOptions) -> Any:
    """The bound application (``serve.run`` it, or return it from a builder)."""
    router_class = REQUEST_ROUTERS[options.request_router]
    replica = serve.deployment(
        name=REPLICA_DEPLOYMENT,
        max_ongoing_requests=options.max_ongoing_requests,
        request_router_config={"request_router_class": f"{router_class.__module__}.{router_class.__qualname__}"},
        ray_actor_options={"num_cpus": options.replica_cpus},
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
        **options.scaling(),
    )(KVReuseReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0},
    )(KVReuseIngress)
    return ingress.bind(replica.bind(list(options.serve_args)), list(options.route_args))


def app_builder(args: dict[str, Any]) -> Any:
    """``serve deploy`` / ``serve run`` entry: ``args`` are ``RayAppOptions``' fields."""
    return build_application(RayAppOptions.from_dict(dict(args)))
