"""The server app's state: one frozen ``ServerContext``, built by ``build_app`` with the app.

Routes read it with ``context_of(request)`` (it sits on ``app.state.ctx``, the only thing
there); nothing lives in module globals, so several apps (tests) share one process. The
KV event routes are bound to an ``EventFeed`` when they are built (``events_routes``), so
an app of those routes alone needs no engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from kvreuse.api.cache_breakpoints import DEFAULT_POLICY, BreakpointPolicy
from kvreuse.api.middleware import DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.events.publisher import ZmqEventPublisher
    from kvreuse.events.records import KVSnapshot
    from kvreuse.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerLimits:
    """Request limits (SPEC 9). ``max_prompt_tokens`` ``None`` means the model's context.
    Raises ``ValueError`` for a body limit under 1 KiB or a prompt limit under 1."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclass(frozen=True)
class EventFeed:
    """What the KV event routes serve: the ``EventBuffer`` the engine's pool writes to, and
    ``snapshot()``, which must return a ``KVSnapshot`` whose blocks and ``last_event_id``
    describe the same instant (the app's runs on the engine thread between steps)."""

    buffer: EventBuffer
    snapshot: Callable[[], Awaitable[KVSnapshot]]


@dataclass(frozen=True)
class ServerContext:
    """Everything the routes of one app read. Built once; never changed while serving."""

    engine: AsyncEngine  # started and shut down by its owner, not by the app
    metrics: ServerMetrics  # this app's own registry
    served_model_names: tuple[str, ...]  # the first is the name responses report
    limits: ServerLimits
    instance_id: str  # new per app (per executor process): a router sees a restart by it
    events: EventFeed | None = None  # None: KV events are off
    publisher: ZmqEventPublisher | None = None  # the ZMQ publisher /v1/kvreuse/info advertises, if any
    # cache_control breakpoints -> retention on /v1/messages (--cache-control-priorities / -ttls)
    cache_policy: BreakpointPolicy = DEFAULT_POLICY

    @property
    def prompt_limit(self) -> int:
        model_len = self.engine.max_model_len
        return model_len if self.limits.max_prompt_tokens is None else min(model_len, self.limits.max_prompt_tokens)


def context_of(request: Request) -> ServerContext:
    """The context of the app serving ``request`` (set by ``build_app``)."""
    return request.app.state.ctx
