"""The OpenAI-compatible HTTP app: ``build_app(engine) -> FastAPI``.

::

    client ─▶ BodyLimit ─▶ APIKey ─▶ TenantLimit ─▶ routes (completions / chat / info / events / dashboard / tokenize)
                                        │ generate()
                                        ▼
                                   AsyncEngine ─▶ engine thread ─▶ LLMEngine

``build_app`` only builds: it starts no thread and opens no socket. The caller starts the
engine (``engine.start()``) and any publisher before serving, and shuts them down after
(``kvreuse serve`` does both, ``kvreuse.cli.run_serve``). The app's state is one frozen
``ServerContext`` on ``app.state.ctx``; each app has its own metrics registry, so several
apps (tests) can live in one process.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI

from kvreuse import __version__
from kvreuse.api import docs_routes
from kvreuse.api.anthropic_errors import AnthropicErrorMiddleware
from kvreuse.api.cache_breakpoints import DEFAULT_POLICY, BreakpointPolicy
from kvreuse.api.limiter import TenantLimiter
from kvreuse.api.middleware import APIKeyMiddleware, BodyLimitMiddleware, TenantLimitMiddleware
from kvreuse.api.tenants import APIKeys
from kvreuse.engine.async_engine import AsyncEngine
from kvreuse.server import (
    chat_routes,
    completions_routes,
    dashboard_routes,
    events_routes,
    executor_info_routes,
    info_routes,
    messages_routes,
    schema_routes,
    tokenize_routes,
)
from kvreuse.server.context import EventFeed, ServerContext, ServerLimits
from kvreuse.server.errors import install_error_handlers
from kvreuse.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from kvreuse.events.publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


def _served_names(engine: AsyncEngine, served_model_name: str | Sequence[str] | None) -> tuple[str, ...]:
    if served_model_name is None:
        return (engine.model_name,)
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names or any(not n for n in names):
        raise ValueError("--served-model-name must be one or more non-empty names")
    return names


def engine_event_feed(engine: AsyncEngine) -> EventFeed | None:
    """The engine's KV events (``None`` when its ``LLMEngine`` has no ``EventBuffer``), with
    snapshots taken on the engine thread between steps."""
    buffer = engine.event_buffer
    if buffer is None:
        return None
    return EventFeed(buffer, engine.kv_snapshot)


def build_context(
    engine: AsyncEngine,
    *,
    served_model_name: str | Sequence[str] | None = None,
    limits: ServerLimits = ServerLimits(),
    publisher: ZmqEventPublisher | None = None,
    limiter: TenantLimiter | None = None,
    cache_policy: BreakpointPolicy = DEFAULT_POLICY,
) -> ServerContext:
    """The state of one app over ``engine``: a new metrics registry, a new ``instance_id``
    (a uuid: ``/health`` and ``/v1/kvreuse/info`` report it, so a router sees a restart
    even when it missed the downtime) and the engine's event feed. ``served_model_name``
    defaults to the engine's model name. ``limiter``'s counters go in the registry (the
    routes reach it through the request's lease, not the context). Raises ``ValueError``
    for an empty served name."""
    names = _served_names(engine, served_model_name)
    events = engine_event_feed(engine)
    metrics = ServerMetrics(engine, names[0], event_buffer=None if events is None else events.buffer, limiter=limiter)
    return ServerContext(engine, metrics, names, limits, uuid.uuid4().hex, events, publisher, cache_policy)


def build_app(
    engine: AsyncEngine,
    *,
    api_key: str | Sequence[str] | None = None,
    served_model_name: str | Sequence[str] | None = None,
    limits: ServerLimits = ServerLimits(),
    publisher: ZmqEventPublisher | None = None,
    limiter: TenantLimiter | None = None,
    metrics_tenant_labels: bool = False,
    cache_policy: BreakpointPolicy = DEFAULT_POLICY,
) -> FastAPI:
    """An app serving ``engine``; it starts nothing (the owner starts the engine before
    serving and shuts it down after). Requests naming a model other than the served names
    get 404. ``publisher``: the ZMQ publisher of the engine's events, advertised to routers
    on ``/v1/kvreuse/info`` (the owner starts and closes it). ``api_key`` (one spec or
    several: ``KEY`` for an admin, ``KEY:TENANT`` for a tenant, ``kvreuse.api.tenants``)
    guards ``/v1/*``, ``/openapi.json`` and the vLLM admin routes. ``limiter``: the
    per-tenant limits (``kvreuse.api.limiter``; it needs keys). With keys, ``/metrics`` names
    tenants only to an admin key, unless ``metrics_tenant_labels`` (``--metrics-tenant-labels``). ``cache_policy``:
    ``cache_control`` breakpoints -> retention on ``/v1/messages`` (``kvreuse.api.cache_breakpoints``).
    Raises ``ValueError`` for
    an empty served name, a bad key spec, or limits naming a tenant no key has."""
    keys = APIKeys.parse(api_key) if api_key else None
    if limiter is not None:
        limiter.limits.check_keys(keys)
    ctx = build_context(
        engine,
        served_model_name=served_model_name,
        limits=limits,
        publisher=publisher,
        limiter=limiter,
        cache_policy=cache_policy,
    )
    app = FastAPI(title="kvreuse", version=__version__, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(completions_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(info_routes.router)
    app.include_router(executor_info_routes.router)  # GET /v1/kvreuse/info, for routers
    app.include_router(schema_routes.router)  # PML schemas: /v1/schemas (docs/pml.md)
    app.include_router(events_routes.build_router(ctx.events))  # KV events: long-poll, SSE, snapshot (docs/events.md)
    app.include_router(dashboard_routes.router)  # GET /dashboard and the /v1/kv_cache_stats it polls
    app.include_router(tokenize_routes.router)  # vLLM's /tokenize, /detokenize, /reset_prefix_cache, /version
    app.include_router(messages_routes.router)  # Anthropic's /v1/messages (docs/anthropic.md)
    app.include_router(docs_routes.router)  # /docs, /redoc: guarded as /openapi.json is
    # Added last = outermost: the size limit runs before the key check reads nothing; the
    # tenant limit runs inside the key check, which names the tenant.
    if limiter is not None:
        app.add_middleware(TenantLimitMiddleware, limiter=limiter)
    if keys is not None:
        app.add_middleware(APIKeyMiddleware, api_key=keys, tenant_labels_public=metrics_tenant_labels)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: Anthropic's error shape on /v1/messages*
    return app
