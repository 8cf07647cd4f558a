"""``kvreuse route``: the KV-aware router in front of running executors.

    kvreuse route --port P --executor URL [--executor URL ...]
                  [--routing-policy kv|round_robin|least_loaded] [--overlap-weight W]
                  [--executor-api-key KEY] [--api-key KEY[:TENANT] ...] [--max-body-bytes N]
                  [--tenant-limits FILE] [--tenant-max-in-flight N] [--tenant-tokens-per-minute N]
                  [--metrics-tenant-labels] [--metrics-executor-urls]
                  [--migration-limit N] [--upstream-progress-timeout S] [--upstream-first-byte-timeout S]
                  [--stream-keepalive-interval S]

At start it asks every executor for ``/v1/kvreuse/info`` (waiting up to
``--startup-timeout`` for them), refuses executors whose model identity or hash settings
differ, loads the executors' tokenizer (not the model) and checks it tokenizes as they do.
Executors that are down at start are probed in later.

``--executor-api-key`` (default: ``$KVREUSE_EXECUTOR_API_KEY``) is sent with the router's
own calls (info, health, metrics, KV state and events) to executors started with
``--api-key``; an executor answering 401 at start stops the router with a message saying
whether the key is missing or wrong.

``--api-key`` (repeatable, ``KEY`` or ``KEY:TENANT``, ``kvreuse.api.tenants``) is the key
clients must send the router (``/v1/*``, explain included, and ``/openapi.json``), checked
before the body is read; it defaults to ``--executor-api-key``, so when executors require a
key the router requires one too, before it tokenizes anything. A tenant's requests are
hashed, explained and forwarded with the tenant's salt in ``cache_salt``.
With a router key, proxied requests carry the executor key (the router has checked the
client); without one, they carry the client's own ``Authorization`` header.
``--max-body-bytes`` (the executor's default, 8 MiB) gives larger bodies the executor's 413
before they are read past the limit.

``--tenant-limits FILE`` / ``--tenant-max-in-flight N`` / ``--tenant-tokens-per-minute N``
are the executor's (``kvreuse.api.tenant_limits``), enforced on the router's tenant keys
before a request is sent anywhere; proxied requests carry the executor key (an admin
key), so the executors' own tenant limits do not see them. ``/metrics`` names tenants
(``kvreuse:router_tenant_*``) only to an admin key, unless ``--metrics-tenant-labels``.
Its ``executor`` label is the executor's id (its place in ``--executor`` order, listed with
its URL on the admin route ``/v1/route/executors``), or its URL with ``--metrics-executor-urls``.

``--migration-limit`` (default 3, 0: off) bounds the executors a stream is continued on
when its executor fails mid-response (``kvreuse.router.migration``).

``--upstream-progress-timeout`` (default 10 s) and ``--upstream-first-byte-timeout``
(default 300 s), 0: none, bound how long the router waits on an executor
(``kvreuse.router.deadline``): a stream silent that long moves to another executor.
``--stream-keepalive-interval`` (default 5 s, 0: none): while a stream waits for a first
byte, its client gets an SSE comment that often (``kvreuse.router.keepalive``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence

import httpx

from kvreuse.api.middleware import DEFAULT_MAX_BODY_BYTES
from kvreuse.api.tenant_limits import add_arguments as add_tenant_limit_arguments, limits_from_args
from kvreuse.api.tenants import APIKeys
from kvreuse.router.deadline import DEFAULT_FIRST_BYTE_TIMEOUT_S, DEFAULT_PROGRESS_TIMEOUT_S, Deadlines
from kvreuse.router.executors import Executor, ExecutorInfo, check_compatible
from kvreuse.router.keepalive import DEFAULT_KEEPALIVE_S
from kvreuse.router.policy import DEFAULT_OVERLAP_WEIGHT, POLICIES, make_policy, parse_tier_weights
from kvreuse.router.router import DEFAULT_MIGRATION_LIMIT

logger = logging.getLogger("kvreuse.router")

EXECUTOR_API_KEY_ENV = "KVREUSE_EXECUTOR_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvreuse route", description="KV-aware router in front of kvreuse executors")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--executor",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a kvreuse serve process (repeat for each)",
    )
    p.add_argument("--routing-policy", default="kv", choices=sorted(POLICIES))
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=DEFAULT_OVERLAP_WEIGHT,
        help="cost of one uncached prompt block, in blocks of load (kv policy)",
    )
    p.add_argument(
        "--tier-weights",
        default=None,
        metavar="LEVEL=W,...",
        help="how much a block cached in each tier counts in the overlap, e.g. "
        "device=1,host=0.5 (default: measured by bench/tiers.py: 1, 0.997, 0.992, 0.970)",
    )
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S", help="seconds between health probes")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="wait this long for at least one executor to answer",
    )
    p.add_argument(
        "--executor-api-key",
        default=os.environ.get(EXECUTOR_API_KEY_ENV) or None,
        metavar="KEY",
        help="API key of executors started with --api-key, for the router's own calls (health, "
        f"info, KV events); default ${EXECUTOR_API_KEY_ENV}. Clients' requests keep their own key",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY[:TENANT]",
        help="require 'Authorization: Bearer KEY' from clients on /v1/* and /openapi.json (repeat for "
        "more keys; KEY:TENANT keys get the tenant's cache salt; default: the --executor-api-key)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get a 413 (as on the executor)",
    )
    add_tenant_limit_arguments(p)  # --tenant-limits, --tenant-max-in-flight, --tenant-tokens-per-minute
    p.add_argument(
        "--metrics-tenant-labels",
        action="store_true",
        help="show tenant names and usage on /metrics to every scraper (default: only with an admin "
        "key; others see sums over tenants, tenant=\"(all)\")",
    )
    p.add_argument(
        "--metrics-executor-urls",
        action="store_true",
        help="label executors on /metrics with their URLs (default: their ids, 0, 1, ... in --executor "
        "order; the URLs are on the admin route /v1/route/executors)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=DEFAULT_MIGRATION_LIMIT,
        metavar="N",
        help="executors a stream may be continued on when its executor fails mid-response "
        f"(default {DEFAULT_MIGRATION_LIMIT}; 0: off, the stream ends with an error event)",
    )
    p.add_argument(
        "--upstream-progress-timeout",
        type=float,
        default=DEFAULT_PROGRESS_TIMEOUT_S,
        metavar="S",
        help="a stream that gets no byte from its executor for S seconds after its first one is "
        "continued on another executor (or ended with an error event); the executor is marked "
        f"down (default {DEFAULT_PROGRESS_TIMEOUT_S:g}; 0: no limit)",
    )
    p.add_argument(
        "--upstream-first-byte-timeout",
        type=float,
        default=DEFAULT_FIRST_BYTE_TIMEOUT_S,
        metavar="S",
        help="a streamed request whose executor sends no byte for S seconds (queueing and prefill "
        "included) is retried on another executor (default "
        f"{DEFAULT_FIRST_BYTE_TIMEOUT_S:g}; 0: no limit; non-streamed replies have none)",
    )
    p.add_argument(
        "--stream-keepalive-interval",
        type=float,
        default=DEFAULT_KEEPALIVE_S,
        metavar="S",
        help="while a stream waits for an executor's first byte (queueing, prefill, a continuation "
        "on another executor), send the client an SSE comment every S seconds so its read timeout "
        f"does not fire (default {DEFAULT_KEEPALIVE_S:g}; 0: none)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for random tie-breaking")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


async def discover(urls: Sequence[str], timeout_s: float, api_key: str | None = None) -> dict[str, ExecutorInfo]:
    """Info of every executor that answers within ``timeout_s`` (waiting for the first
    one, then a few more seconds for the rest), asked with ``api_key``. Raises
    ``ValueError`` at once for an executor that answers but cannot be used (no info route,
    or a 401: ``ExecutorAuthError``)."""
    from kvreuse.router.router import auth_headers, fetch_info

    headers = auth_headers(api_key)
    infos: dict[str, ExecutorInfo] = {}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            for url in urls:
                if url not in infos:
                    try:
                        infos[url] = await fetch_info(client, url, headers)
                    except httpx.HTTPError:
                        pass
            if len(infos) == len(urls) or time.monotonic() > deadline:
                return infos
            if infos:
                deadline = min(deadline, time.monotonic() + 5.0)
            await asyncio.sleep(0.5)


def route_main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns 2 for incompatible executors or none reachable."""
    from kvreuse.api.access_log import uvicorn_server
    from kvreuse.api.limiter import TenantLimiter
    from kvreuse.router.app import build_router_app
    from kvreuse.router.prompt_keys import PromptHasher
    from kvreuse.router.router import Router
    from kvreuse.router.tokenizer import load_tokenizer

    args = build_parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    urls = list(dict.fromkeys(u.rstrip("/") for u in args.executor))
    if args.migration_limit < 0:
        print(f"kvreuse route: --migration-limit must be >= 0 (0: off), got {args.migration_limit}", file=sys.stderr)
        return 2
    if args.max_body_bytes < 1024:
        print(f"kvreuse route: --max-body-bytes must be >= 1024, got {args.max_body_bytes}", file=sys.stderr)
        return 2
    try:
        # Executors that need a key: so does the router (their key, unless it has its own).
        api_key = args.api_key or ([args.executor_api_key] if args.executor_api_key else None)
        keys = APIKeys.parse(api_key) if api_key else None
        tenant_limits = limits_from_args(args)
        if tenant_limits is not None:
            tenant_limits.check_keys(keys)
        policy = make_policy(args.routing_policy, args.overlap_weight)  # a bad flag fails before any wait
        deadlines = Deadlines.of(
            args.upstream_first_byte_timeout, args.upstream_progress_timeout, args.stream_keepalive_interval
        )
        tier_weights = parse_tier_weights(args.tier_weights)
        infos = asyncio.run(discover(urls, args.startup_timeout, args.executor_api_key))
        settings = check_compatible(list(infos.values()))
        first = next(iter(infos.values()))
        tokenizer = load_tokenizer(first)
    except ValueError as exc:
        print(f"kvreuse route: {exc}", file=sys.stderr)
        return 2
    missing = [u for u in urls if u not in infos]
    if missing:
        logger.warning("executors not answering yet (probed in later): %s", ", ".join(missing))
    executors = [Executor(u, infos.get(u)) for u in urls]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10.0, read=None))
    router = Router(
        executors,
        PromptHasher(tokenizer, settings),
        policy,
        client=client,
        health_interval_s=args.health_interval,
        seed=args.seed,
        executor_api_key=args.executor_api_key,
        tier_weights=tier_weights,
        migration_limit=args.migration_limit,
        deadlines=deadlines,
        metrics_executor_urls=args.metrics_executor_urls,
    )
    print(
        f"kvreuse route: {len(urls)} executors, model {first.model_name} ({settings.model_id}), "
        f"block size {settings.block_size}, {settings.hash_algorithm}; policy {policy.name} "
        f"(overlap weight {args.overlap_weight}); listening on http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    limiter = None if tenant_limits is None else TenantLimiter(tenant_limits)
    app = build_router_app(
        router,
        api_key=keys,
        max_body_bytes=args.max_body_bytes,
        limiter=limiter,
        metrics_tenant_labels=args.metrics_tenant_labels,
    )
    uvicorn_server(app, host=args.host, port=args.port, log_level=args.log_level).run()
    return 0
