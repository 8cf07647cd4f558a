"""The ``kvreuse serve`` flags of the ZMQ event publisher, and the start-up warning when its
events leave the host unprotected while API keys seal the HTTP API.

    --kv-events-endpoint tcp://*:5557       PUB endpoint (a * host binds --kv-events-bind-host)
    --kv-events-replay-endpoint tcp://*:5558
    --kv-events-bind-host 127.0.0.1         where a * host binds; 0.0.0.0 for every interface
    --kv-events-curve-secret-key FILE       CURVE: the publisher's zmq.auth secret certificate
    --kv-events-curve-clients-dir DIR       CURVE: public keys of the subscribers allowed
    --kv-events-no-token-ids                BlockStored without token ids
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports zmq only when events are on
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.events.curve import CurveServer
    from kvreuse.events.publisher import ZmqEventPublisher
    from kvreuse.events.records import KVSnapshot


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="ZMQ PUB endpoint, e.g. tcp://*:5557 (a * host binds --kv-events-bind-host)",
    )
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER replay endpoint")
    p.add_argument(
        "--kv-events-bind-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the interface a * host in the event endpoints binds (default 127.0.0.1: events stay "
        "on this host; 0.0.0.0 for every interface)",
    )
    p.add_argument(
        "--kv-events-curve-secret-key",
        default=None,
        metavar="FILE",
        help="encrypt and authenticate the event sockets with ZeroMQ CURVE: this publisher's "
        "zmq.auth secret certificate (needs --kv-events-curve-clients-dir)",
    )
    p.add_argument(
        "--kv-events-curve-clients-dir",
        default=None,
        metavar="DIR",
        help="CURVE: folder of the *.key public keys of the subscribers allowed to connect",
    )
    p.add_argument(
        "--kv-events-no-token-ids",
        action="store_true",
        help="send BlockStored events without token ids (block hashes only)",
    )


def publisher_from_args(
    args: argparse.Namespace, buffer: EventBuffer, snapshot_fn: Callable[[], KVSnapshot]
) -> ZmqEventPublisher:
    """The publisher the flags describe. Raises ``ValueError`` naming the flag for bad CURVE
    keys, for CURVE flags without ``--kv-events-endpoint`` (checked by the caller first), and
    for an endpoint its socket cannot bind or connect (a port in use, a malformed address)."""
    from kvreuse.events.publisher import EndpointError, ZmqEventPublisher

    curve = _curve(args)
    try:
        return ZmqEventPublisher(
            buffer,
            args.kv_events_endpoint,
            replay_endpoint=args.kv_events_replay_endpoint,
            snapshot_fn=snapshot_fn,
            bind_host=args.kv_events_bind_host,
            curve=curve,
            include_token_ids=not args.kv_events_no_token_ids,
        )
    except EndpointError as exc:
        flag = "--kv-events-replay-endpoint" if exc.replay else "--kv-events-endpoint"
        raise ValueError(f"{flag}: {exc}") from None


def _curve(args: argparse.Namespace) -> CurveServer | None:
    from kvreuse.events.curve import CurveServer

    if args.kv_events_curve_secret_key is not None:
        return CurveServer.load(args.kv_events_curve_secret_key, args.kv_events_curve_clients_dir)
    if args.kv_events_curve_clients_dir is not None:
        raise ValueError("--kv-events-curve-clients-dir needs --kv-events-curve-secret-key")
    return None


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse the security flags when they would do nothing (no ``--kv-events-endpoint``): a
    user who asked for CURVE must not believe events are protected when none are published),
    and bad CURVE keys, before the model loads. Raises ``ValueError`` naming the flag."""
    if args.kv_events_endpoint:
        if args.kv_events_curve_secret_key is not None or args.kv_events_curve_clients_dir is not None:
            _curve(args)
        return
    for flag, value in (
        ("--kv-events-curve-secret-key", args.kv_events_curve_secret_key),
        ("--kv-events-curve-clients-dir", args.kv_events_curve_clients_dir),
        ("--kv-events-no-token-ids", args.kv_events_no_token_ids or None),
    ):
        if value is not None:
            raise ValueError(f"{flag} needs --kv-events-endpoint (the events are off without it)")


def seal_warning(publisher: ZmqEventPublisher, api_keys: bool) -> str | None:
    """The start-up warning for events that can leave the host without CURVE while API keys
    are set (the keys seal the HTTP API; the events carry every tenant's blocks), else None."""
    if not api_keys or publisher.curve is not None or not publisher.leaves_host:
        return None
    what = "block hashes" if not publisher.include_token_ids else "token ids"
    where = ", ".join(e for e in (publisher.endpoint, publisher.replay_endpoint) if e)
    return (
        f"KV events on {where} can leave this host unencrypted and unauthenticated while --api-key is set: "
        f"any subscriber there reads every tenant's {what}. Bind them to loopback (--kv-events-bind-host "
        "127.0.0.1), or set --kv-events-curve-secret-key and --kv-events-curve-clients-dir"
    )
