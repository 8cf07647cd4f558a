"""``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from kvreuse.api.protocol import now_s
from kvreuse.api.tenants import sees_tenants
from kvreuse.server.context import context_of
from kvreuse.server.serving import check_model

router = APIRouter()

INSTANCE_HEADER = "x-kvreuse-instance-id"  # on /health: this process's id (ServerContext.instance_id)
REMOTE_STORE_HEADER = "x-kvreuse-remote-store"  # on /health: the remote store's identity, when there is one


def _model_card(ctx, name: str, created: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "kvreuse",
        "root": ctx.engine.model_name,
        "max_model_len": ctx.engine.max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    ctx = context_of(request)
    created = now_s()
    return JSONResponse({"object": "list", "data": [_model_card(ctx, n, created) for n in ctx.served_model_names]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    """OpenAI's ``models.retrieve``; 404 ``model_not_found`` naming ``model`` otherwise."""
    ctx = context_of(request)
    check_model(ctx, model_id)
    return JSONResponse(_model_card(ctx, model_id, now_s()))


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine thread runs and the last idle integrity check passed, else 503
    (so a router takes this executor out of rotation). Every answer carries the process's
    instance id in the ``x-kvreuse-instance-id`` header: a router that sees it change knows
    the executor restarted (its cached blocks are gone) even if it never saw it down; with a
    remote store, its identity in ``x-kvreuse-remote-store``: a router that sees it differ
    from ``/v1/kvreuse/info``'s (a Redis Cluster down at start, up since) reads the info again."""
    ctx = context_of(request)
    engine = ctx.engine
    headers = {INSTANCE_HEADER: ctx.instance_id}
    if (store := engine.remote_store) is not None:
        headers[REMOTE_STORE_HEADER] = store
    if not engine.is_running:
        return JSONResponse(
            {"status": "error", "detail": "engine thread is not running"}, status_code=503, headers=headers
        )
    if engine.integrity_error is not None:
        return JSONResponse(
            {"status": "error", "detail": f"block pool integrity: {engine.integrity_error}"},
            status_code=503,
            headers=headers,
        )
    return JSONResponse({"status": "ok"}, headers=headers)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # tenant names and usage only for an admin key (or --metrics-tenant-labels): the tenant seal
    body, content_type = context_of(request).metrics.render(show_tenants=sees_tenants(request.scope))
    return Response(body, media_type=content_type)
