"""``kvreuse ray``: kvreuse's replicas on Ray Serve, with one command.

    kvreuse ray --replicas N [--address ADDR] [--request-router kv|pow2]
                [--min-replicas A --max-replicas B [--target-ongoing-requests T]]
                [--routing-policy ...] [--overlap-weight W] [--migration-limit N] ...
                [kvreuse serve's flags: --model, tiers, --host, --port, --api-key, ...]

Without ``--address`` a local Ray cluster is started, and stopped again on SIGTERM or
Ctrl-C; with one (``auto``, ``ray://HOST:10001``, ``HOST:6379``) the application is deployed
to that cluster and deleted from it on exit. Ray Serve's HTTP proxy listens on ``--host`` /
``--port`` and speaks ``kvreuse serve``'s API (the ingress is ``kvreuse route``'s app).

Flags are split: this command's own and ``kvreuse route``'s routing flags go to the
ingress, every other flag to each replica's ``kvreuse serve`` (checked before Ray starts).
API keys (``--api-key``), tenant limits, ``--max-body-bytes`` and ``--metrics-tenant-labels``
are checked at the ingress; replicas given keys also get an internal admin key, the one the
ingress calls them with.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger("kvreuse.ray")

DEFAULT_STARTUP_TIMEOUT_S = 600

_ROUTE_FLAGS = (  # kvreuse route's flags this command takes for the ingress
    "--routing-policy",
    "--overlap-weight",
    "--tier-weights",
    "--health-interval",
    "--migration-limit",
    "--upstream-progress-timeout",
    "--upstream-first-byte-timeout",
    "--startup-timeout",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvreuse ray",
        description="kvreuse replicas on Ray Serve behind the KV-aware router; other flags are kvreuse serve's",
        epilog="Every other flag is kvreuse serve's (see kvreuse serve --help), given to each replica; "
        "--host / --port are where Ray Serve's HTTP proxy listens. docs/ray.md",
        allow_abbrev=False,  # a kvreuse serve flag must never be taken for a prefix of ours
    )
    p.add_argument("--replicas", type=int, default=1, help="replicas (each one engine); fixed unless --max-replicas")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local cluster (default: Ray's count)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (its torch threads)")
    p.add_argument("--request-router", default="kv", choices=["kv", "pow2"], help="pow2: Ray's default (baseline)")
    p.add_argument("--min-replicas", type=int, default=1, help="autoscaling (with --max-replicas)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale on queue length up to this many")
    p.add_argument("--target-ongoing-requests", type=float, default=2.0, help="autoscaling: requests per replica")
    p.add_argument("--max-ongoing-requests", type=int, default=64, help="requests one replica takes at once")
    p.add_argument("--router-seed", type=int, default=None, help="seed of the router's random tie-breaks")
    for flag in _ROUTE_FLAGS:
        p.add_argument(flag, default=None, help="as kvreuse route's")
    # the ingress waits for a replica's model to load (kvreuse route's default is 60 s)
    p.set_defaults(startup_timeout=str(DEFAULT_STARTUP_TIMEOUT_S))
    return p


def split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(this command's flags, the replicas' kvreuse serve flags)``."""
    return build_parser().parse_known_args(list(argv))


def route_argv(ray_args: argparse.Namespace, serve: argparse.Namespace, executor_key: str | None) -> list[str]:
    """The ingress's ``kvreuse route`` flags."""
    out: list[str] = []
    for flag in _ROUTE_FLAGS:
        value = getattr(ray_args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    if ray_args.router_seed is not None:
        out += ["--seed", str(ray_args.router_seed)]
    for key in serve.api_key or []:
        out += ["--api-key", key]
    if executor_key:
        out += ["--executor-api-key", executor_key]
    out += ["--max-body-bytes", str(serve.max_body_bytes)]
    if serve.metrics_tenant_labels:
        out.append("--metrics-tenant-labels")
    for name in ("tenant_limits", "tenant_max_in_flight", "tenant_tokens_per_minute"):
        value = getattr(serve, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def options_from_argv(argv: Sequence[str]):
    """``(RayAppOptions, the parsed serve flags)``; ``ValueError`` for a bad flag."""
    from kvreuse.ray_serve.app import RayAppOptions
    from kvreuse.ray_serve.replica import parse_serve_argv

    ray_args, serve_argv = split_argv(argv)
    serve = parse_serve_argv(serve_argv)
    executor_key = None
    if serve.api_key:  # the ingress calls replicas with an admin key of its own
        executor_key = secrets.token_urlsafe(24)
        serve_argv = [*serve_argv, "--api-key", executor_key]
    options = RayAppOptions(
        serve_args=serve_argv,
        route_args=route_argv(ray_args, serve, executor_key),
        replicas=ray_args.replicas,
        min_replicas=ray_args.min_replicas,
        max_replicas=ray_args.max_replicas,
        target_ongoing_requests=ray_args.target_ongoing_requests,
        max_ongoing_requests=ray_args.max_ongoing_requests,
        request_router=ray_args.request_router,
        replica_cpus=ray_args.replica_cpus,
    )
    return options, serve, ray_args


def ray_main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns 2 for a bad flag or a missing ``ray`` package."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError:
        print("kvreuse ray: needs Ray Serve: pip install 'kvreuse[ray]'", file=sys.stderr)
        return 2
    from kvreuse.ray_serve.app import APP_NAME, build_application

    try:
        options, serve_flags, ray_args = options_from_argv(argv)
        app = build_application(options)
    except ValueError as exc:
        print(f"kvreuse ray: {exc}", file=sys.stderr)
        return 2
    local = ray_args.address is None
    got_sigterm: list[int] = []
    status = 0
    try:
        if local:
            ray.init(address="local", num_cpus=ray_args.num_cpus, include_dashboard=False)
        else:
            ray.init(address=ray_args.address)
        # after ray.init, which installs a SIGTERM handler of its own (it aborts the driver)
        signal.signal(signal.SIGTERM, lambda signum, _frame: got_sigterm.append(signum))
        serve.start(http_options={"host": serve_flags.host, "port": serve_flags.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(
            f"kvreuse ray: {options.scaling()} of {serve_flags.model}, request router {options.request_router}; "
            f"listening on http://{serve_flags.host}:{serve_flags.port} (OpenAI API under /v1)",
            file=sys.stderr,
        )
        while not got_sigterm:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:  # serve.run: the application failed to deploy (replica logs say why)
        print(f"kvreuse ray: {exc}", file=sys.stderr)
        status = 1
    finally:
        print("kvreuse ray: stopping", file=sys.stderr)
        if not ray.is_initialized():
            pass  # Ray never started (serve.shutdown would start a cluster just to stop it)
        elif local:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
            ray.shutdown()
    return status
