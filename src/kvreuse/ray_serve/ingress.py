"""The ingress deployment: ``kvreuse route``'s router app in front of the replicas.

``KVReuseIngress`` parses ``kvreuse route``'s flags (``route_argv``: policy, overlap and tier
weights, API keys, tenant limits, migration limit, upstream deadlines; no ``--executor``:
the executors are the replicas), asks any replica for its ``/v1/kvreuse/info`` (waiting up to
``--startup-timeout``), loads that model's tokenizer (never the weights) and serves
``build_router_app`` over a ``Router`` whose HTTP client reaches the replicas through their
``DeploymentHandle`` (``kvreuse.ray_serve.transport``). The router starts with no executor;
the ``ReplicaTracker`` adds each replica Ray reports and removes those it drops, so a
replica Ray restarts after a crash rejoins the index under its new id.

So everything ``kvreuse route`` does, the ingress does: the same routes and errors (the
replicas' own for anything they answer), tenants and limits checked here, retries before
the first byte, and mid-stream migration when a replica dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx
from ray import serve

from kvreuse.ray_serve.transport import ReplicaTransport

logger = logging.getLogger(__name__)

ANY_REPLICA = "http://any"  # an executor URL that is no replica's: Ray picks one


def parse_route_argv(argv: Sequence[str]) -> Any:
    """``kvreuse route``'s flags (``--executor`` is the replicas, given here); ``ValueError``
    for a bad one."""
    from kvreuse.router.cli import build_parser

    try:
        return build_parser().parse_args([*argv, "--executor", ANY_REPLICA])
    except SystemExit:
        raise ValueError(f"bad kvreuse route flags for the ingress: {' '.join(argv)}") from None


async def first_info(client: httpx.AsyncClient, timeout_s: float, headers: dict[str, str]) -> Any:
    """The ``/v1/kvreuse/info`` of whichever replica answers first, asked every second until
    ``timeout_s`` (replicas load their model meanwhile). Raises ``ValueError`` after that."""
    from kvreuse.router.router import fetch_info

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await fetch_info(client, ANY_REPLICA, headers)
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                raise ValueError(f"no replica answered /v1/kvreuse/info in {timeout_s:g} s: {exc!r}") from None
            await asyncio.sleep(1.0)


@serve.ingress()
class KVReuseIngress:
    """Ray builds it with the replicas' handle and ``kvreuse route``'s flags."""

    async def __init__(self, replicas: Any, route_argv: Sequence[str]) -> None:  # type: ignore[misc]  # Ray awaits it
        from kvreuse.api.limiter import TenantLimiter
        from kvreuse.api.tenant_limits import limits_from_args
        from kvreuse.api.tenants import APIKeys
        from kvreuse.router.deadline import Deadlines
        from kvreuse.router.executors import check_compatible
        from kvreuse.router.policy import make_policy, parse_tier_weights
        from kvreuse.router.prompt_keys import PromptHasher
        from kvreuse.router.router import Router, auth_headers
        from kvreuse.router.tokenizer import load_tokenizer

        args = parse_route_argv(route_argv)
        api_key = args.api_key or ([args.executor_api_key] if args.executor_api_key else None)
        self.keys = APIKeys.parse(api_key) if api_key else None
        tenant_limits = limits_from_args(args)
        if tenant_limits is not None:
            tenant_limits.check_keys(self.keys)
        self.limiter = None if tenant_limits is None else TenantLimiter(tenant_limits)
        self.args = args
        policy = make_policy(args.routing_policy, args.overlap_weight)
        client = httpx.AsyncClient(transport=ReplicaTransport(replicas), timeout=httpx.Timeout(10.0, read=None))
        info = await first_info(client, args.startup_timeout, auth_headers(args.executor_api_key))
        settings = check_compatible([info])
        tokenizer = await asyncio.to_thread(load_tokenizer, info)
        self.router = Router(
            [],
            PromptHasher(tokenizer, settings),
            policy,
            client=client,
            health_interval_s=args.health_interval,
            seed=args.seed,
            executor_api_key=args.executor_api_key,
            tier_weights=parse_tier_weights(args.tier_weights),
            migration_limit=args.migration_limit,
            deadlines=Deadlines.of(args.upstream_first_byte_timeout, args.upstream_progress_timeout),
        )
        logger.info(
            "kvreuse ingress: model %s (%s), block size %d, %s; policy %s",
            info.model_name,
            settings.model_id,
            settings.block_size,
            settings.hash_algorithm,
            policy.name,
        )

    def __serve_build_asgi_app__(self) -> Any:
        from kvreuse.router.app import build_router_app

        app = build_router_app(
            self.router,
            api_key=self.keys,
            max_body_bytes=self.args.max_body_bytes,
            limiter=self.limiter,
            metrics_tenant_labels=self.args.metrics_tenant_labels,
        )
        serve_router = app.router.lifespan_context
        router = self.router

        @contextlib.asynccontextmanager
        async def lifespan(app: Any):
            # Imported here, not at module level: Ray pickles this class by value (serve.ingress
            # wraps it in a local class), and a module-level TRACKER would arrive as a copy, not
            # the one the request routers report to (kvreuse.ray_serve.tracker).
            from kvreuse.ray_serve.tracker import TRACKER

            # the tracker changes the router on the loop that runs it (the app's, started here)
            TRACKER.attach(router, asyncio.get_running_loop())
            async with serve_router(app) as state:
                yield state

        app.router.lifespan_context = lifespan
        return app
