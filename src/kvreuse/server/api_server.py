"""The OpenAI-compatible HTTP app: ``build_app(engine) -> FastAPI``.

::

    client ─▶ BodyLimit ─▶ APIKey ─▶ routes (completions / chat / info / events / dashboard / tokenize)
                                        │ generate()
                                        ▼
                                   AsyncEngine ─▶ engine thread ─▶ LLMEngine

The app holds its state on ``app.state.ctx`` (a ``ServerContext``); each app has its own
metrics registry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from kvreuse import __version__
from kvreuse.engine.async_engine import AsyncEngine
from kvreuse.server import (
    chat_routes, completions_routes, dashboard_routes, events_routes, executor_info_routes, info_routes,
    schema_routes, tokenize_routes,
)
from kvreuse.server.errors import install_error_handlers
from kvreuse.server.metrics import ServerMetrics
from kvreuse.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from kvreuse.server.serving import ServerContext, ServerLimits

logger = logging.getLogger(__name__)


def _served_names(engine: AsyncEngine, served_model_name: str | Sequence[str] | None) -> tuple[str, ...]:
    if served_model_name is None:
        return (engine.model_name,)
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names or any(not n for n in names):
        raise ValueError("--served-model-name must be one or more non-empty names")
    return names


def build_app(
    engine: AsyncEngine,
    *,
    api_key: str | None = None,
    served_model_name: str | Sequence[str] | None = None,
    limits: ServerLimits = ServerLimits(),
    event_buffer: Any = None,
) -> FastAPI:
    """An app serving ``engine`` (started here if it is not running; its owner shuts it
    down). ``served_model_name`` defaults to the engine's model name; requests naming
    another model get 404. ``event_buffer`` (the ``EventBuffer`` the engine's pool writes
    to; default: the engine's own, if any) is resolved here once and exposed to every route
    as ``app.state.event_buffer`` (``None``: events are off). ``app.state.instance_id`` is
    a new uuid per app (per executor process): ``/health`` and ``/v1/kvreuse/info`` report
    it, so a router sees a restart even when it missed the downtime.
    Raises ``ValueError`` for an empty served name."""
    names = _served_names(engine, served_model_name)
    engine.start()
    app = FastAPI(title="kvreuse", version=__version__, docs_url=None, redoc_url=None)
    app.state.engine = engine  # AsyncEngine; snapshots go through engine.call(...)
    app.state.instance_id = uuid.uuid4().hex  # a new process has a new id: its old blocks are gone
    buffer = event_buffer if event_buffer is not None else getattr(engine.engine, "events", None)
    app.state.event_buffer = buffer
    metrics = ServerMetrics(engine, names[0], event_buffer=buffer)
    app.state.ctx = ServerContext(engine, metrics, names, limits, api_key)
    install_error_handlers(app)
    app.include_router(completions_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(info_routes.router)
    app.include_router(executor_info_routes.router)  # GET /v1/kvreuse/info, for routers
    app.include_router(schema_routes.router)  # PML schemas: /v1/schemas (docs/pml.md)
    app.include_router(events_routes.router)  # KV events: long-poll, SSE, snapshot (docs/events.md)
    app.include_router(dashboard_routes.router)  # GET /dashboard and the /v1/kv_cache_stats it polls
    app.include_router(tokenize_routes.router)  # vLLM's /tokenize, /detokenize, /reset_prefix_cache, /version
    # Added last = outermost: the size limit runs before the key check reads nothing.
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    return app
