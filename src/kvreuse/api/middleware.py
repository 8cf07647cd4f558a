"""ASGI guards in front of every route of the executor and the router: the body-size
limit, the API key and the tenant's in-flight limit.

All answer in OpenAI's error shape before any route (or JSON parsing, or tokenizing) runs.
The body is read in chunks and refused as soon as it passes the limit, so no more than
``max_bytes`` of a body is ever held.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvreuse.api.errors import error_body, limit_response
from kvreuse.api.limiter import LimitExceeded, TenantLimiter
from kvreuse.api.tenants import SEES_TENANTS, APIKeys, needs_admin, presented_key, tenant_of

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # --max-body-bytes of the executor and the router


async def _send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(error_body(message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413, whether or not Content-Length
    is declared. The body is buffered (the JSON parser needs all of it anyway) and replayed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_big = f"request body exceeds the {self.max_bytes}-byte limit"
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, 413, too_big, code="request_too_large")
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, 413, too_big, code="request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would say it

        await self.app(scope, replay, send)


# Open without a key: /health, /metrics, /version, /dashboard (the page holds no data).
METRICS_PATH = "/metrics"  # open, but tenant names on it need the admin key (APIKeyMiddleware)
GUARDED_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/reset_prefix_cache", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"}
)


def is_guarded(path: str) -> bool:
    """Whether ``path`` needs the key: ``/v1/*``, the API description (``/openapi.json``,
    ``/docs``, ``/redoc``) and the utility routes that compute or change state."""
    return path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``) of one of ``api_key`` (specs ``KEY`` or
    ``KEY:TENANT``, ``kvreuse.api.tenants``) on every guarded path (``is_guarded``);
    ``/health``, ``/metrics``, ``/version`` and ``/dashboard`` stay open for probes and
    scrapers, as in vLLM. It runs before the body is read. A tenant key gets a 403 on the
    admin routes (``needs_admin``); the caller's tenant goes in ``scope["state"]["tenant"]``.
    On ``/metrics`` it records whether the caller may see tenant names
    (``kvreuse.api.tenants.sees_tenants``): with an admin key, or everyone when
    ``tenant_labels_public`` (``--metrics-tenant-labels``)."""

    def __init__(
        self, app: ASGIApp, api_key: str | Sequence[str] | APIKeys, *, tenant_labels_public: bool = False
    ) -> None:
        self.app = app
        self.keys = api_key if isinstance(api_key, APIKeys) else APIKeys.parse(api_key)
        self.tenant_labels_public = tenant_labels_public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == METRICS_PATH:
            known, tenant = self.keys.lookup(presented_key(dict(scope.get("headers", ()))))
            scope.setdefault("state", {})[SEES_TENANTS] = self.tenant_labels_public or (known and tenant is None)
        if scope["type"] != "http" or not is_guarded(scope.get("path", "")) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        known, tenant = self.keys.lookup(presented_key(dict(scope.get("headers", ()))))
        if not known:
            await _send_error(
                send,
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
                extra_headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        if tenant is not None and needs_admin(scope["method"], scope["path"]):
            await _send_error(
                send,
                403,
                f"{scope['method']} {scope['path']} needs an admin key (one given "
                "without ':tenant'): it shows or changes every tenant's cache",
                code="admin_key_required",
            )
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages"})  # POST: what generates tokens
LEASE_STATE = "tenant_lease"  # scope["state"] key of the request's Lease


def lease_of(scope: Scope):
    """The request's ``kvreuse.api.limiter.Lease`` (``None``: no tenant limits on this app)."""
    return (scope.get("state") or {}).get(LEASE_STATE)


class TenantLimitMiddleware:
    """Hold one of the caller's tenant's in-flight slots (``TenantLimiter.open``) for every
    ``POST`` of ``LIMITED_PATHS``, from before the route runs until the app returns, which
    for a stream is when its last byte is sent or its client disconnects. A full limit is
    a 429 at once (``Retry-After``). The lease goes in ``scope["state"]`` (``lease_of``) for
    the route to reserve and record tokens on; it is closed here, whatever happens. Runs
    inside ``APIKeyMiddleware``, which names the tenant."""

    def __init__(self, app: ASGIApp, limiter: TenantLimiter) -> None:
        self.app, self.limiter = app, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("path") not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            lease = self.limiter.open(tenant_of(scope))
        except LimitExceeded as exc:
            await limit_response(exc)(scope, receive, send)
            return
        scope.setdefault("state", {})[LEASE_STATE] = lease
        try:
            await self.app(scope, receive, send)
        finally:
            lease.close()
