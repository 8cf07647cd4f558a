"""``GET /docs`` (Swagger UI) and ``GET /redoc`` (ReDoc): the API description as pages.

They answer exactly as ``/openapi.json`` does: guarded by the same key (``kvreuse.api.
middleware.GUARDED_PATHS``: 401 without one, 200 with any valid key). The description is
written into the page rather than fetched by it, because a browser's fetch of
``/openapi.json`` would carry no key. The pages load their scripts from the jsDelivr CDN, as
FastAPI's own do.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

router = APIRouter()

_SWAGGER = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"
_REDOC = "https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"


def _spec_script(request: Request) -> str:
    """The app's OpenAPI description as a JS literal that is safe inside ``<script>``."""
    return json.dumps(request.app.openapi()).replace("<", "\\u003c").replace(">", "\\u003e")


def _page(title: str, head: str, body: str) -> HTMLResponse:
    return HTMLResponse(
        f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{title}</title>{head}"
        f"</head><body>{body}</body></html>"
    )


@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    title = f"{request.app.title} - Swagger UI"
    return _page(
        title,
        f'<link rel="stylesheet" href="{_SWAGGER}/swagger-ui.css">',
        f'<div id="swagger-ui"></div><script src="{_SWAGGER}/swagger-ui-bundle.js"></script>'
        f'<script>SwaggerUIBundle({{spec: {_spec_script(request)}, dom_id: "#swagger-ui"}});</script>',
    )


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    title = f"{request.app.title} - ReDoc"
    return _page(
        title,
        "",
        f'<div id="redoc"></div><script src="{_REDOC}"></script>'
        f'<script>Redoc.init({_spec_script(request)}, {{}}, document.getElementById("redoc"));</script>',
    )
