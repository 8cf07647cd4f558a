"""A Ray Serve replica that runs one kvreuse executor: ``kvreuse serve``'s app and engine.

The replica parses ``kvreuse serve``'s flags (``serve_argv``) and builds exactly what
``kvreuse serve`` builds (``kvreuse.serve_build.build_executor``), but opens no HTTP port:
the ingress calls ``call`` through a ``DeploymentHandle`` and the request runs through the
app in this process (``asgi_call``), so every route, error and stream is ``kvreuse serve``'s.

KV events: unless ``--kv-events-endpoint`` is given, the replica publishes them on a ZMQ PUB
socket bound to its node's address and a free port, which its ``/v1/kvreuse/info``
advertises; the ingress subscribes there (the router's ``ZmqFeed``). With the events on ZMQ,
no event stream holds one of the replica's ``max_ongoing_requests`` slots.

``call`` yields ``ACCEPTED`` first, as soon as the replica has the request (the transport
bounds the wait for it: a replica that is gone never sends it), then the response start and
the body's chunks. Ray's health check calls ``check_health``: a replica whose engine thread
died is restarted by Ray.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import AsyncGenerator, Sequence

from kvreuse.ray_serve.asgi_call import ResponseStart, asgi_call
from kvreuse.serve_args import add_serve_arguments
from kvreuse.serve_build import BuiltExecutor, build_executor

logger = logging.getLogger(__name__)

ACCEPTED = b"kvreuse:accepted"  # the first item of every ``call``: the replica has the request


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvreuse serve (ray replica)", add_help=False)
    add_serve_arguments(p)
    return p


def parse_serve_argv(argv: Sequence[str]) -> argparse.Namespace:
    """``kvreuse serve``'s flags; ``ValueError`` for a bad one (argparse would exit)."""
    try:
        return serve_parser().parse_args(list(argv))
    except SystemExit:
        raise ValueError(f"bad kvreuse serve flags for the replicas: {' '.join(argv)}") from None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_address() -> str:
    """This Ray node's address (what other nodes reach it at)."""
    import ray.util

    return str(ray.util.get_node_ip_address())


class KVReuseReplica:
    """One executor. Ray builds it with the flags ``serve_argv`` (a list of strings)."""

    def __init__(self, serve_argv: Sequence[str]) -> None:
        args = parse_serve_argv(serve_argv)
        if not args.kv_events_endpoint:
            host = node_address()
            args.kv_events_endpoint = f"tcp://{host}:{free_port(host)}"
        self.built: BuiltExecutor | None = build_executor(args)
        self.built.start()
        e = self.built.engine
        logger.info(
            "kvreuse replica: %s, %d KV blocks, events on %s",
            self.built.loaded.model_id,
            e.engine.pool.num_blocks,
            self.built.publisher.endpoint if self.built.publisher else None,
        )

    async def call(
        self, method: str, path: str, query: str, headers: Sequence[tuple[str, str]], body: bytes, **routing: object
    ) -> AsyncGenerator[bytes | ResponseStart, None]:
        """``ACCEPTED``, then the app's response to the request (``asgi_call``). ``routing``:
        what the request router read (``kvreuse.ray_serve.request_router``); unused here."""
        assert self.built is not None, "the replica was shut down"
        yield ACCEPTED
        async for item in asgi_call(self.built.app, method, path, query, headers, body):
            yield item

    def check_health(self) -> None:
        """Ray's health check: raises when the engine cannot serve (Ray then restarts us)."""
        if self.built is None or not self.built.engine.is_running:
            raise RuntimeError("the kvreuse engine is not running")

    def shutdown(self) -> None:
        if self.built is not None:
            self.built.close()
            self.built = None

    def __del__(self) -> None:
        self.shutdown()
