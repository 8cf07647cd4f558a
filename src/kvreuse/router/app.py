"""The router's HTTP app: the OpenAI API of ``kvreuse serve``, in front of its executors.

    POST /v1/completions, /v1/chat/completions   routed, retried; a failed stream continued elsewhere
    POST /v1/messages, /v1/messages/count_tokens  Anthropic's API, routed and retried; a failed stream ends in
                                                  an error event (kvreuse.router.messages_proxy)
    GET  /v1/models                               from a healthy executor
    GET  /health                                  200 while any executor is healthy (each one's health, no URL)
    GET  /metrics                                 the router's own Prometheus metrics
    POST /v1/route/explain                        overlap, load and score per executor, and the choice
                                                  (ids; URLs too for an admin key, or without keys)
    GET  /v1/route/executors                      each executor's URL, health and load (admin key, with keys)

Guards (``kvreuse.api.middleware``, the executor's own, in the same order): bodies over
``max_body_bytes`` get the executor's 413 before anything else is read; with ``api_key``,
``/v1/*`` (explain included) and ``/openapi.json`` need ``Authorization: Bearer <api_key>``
before the body is read or anything tokenized. A body that is not UTF-8, not JSON or nested
too deeply gets the executor's 400 (``kvreuse.api.body.parse_json_body``) from the router.

With ``api_key`` the router has authenticated the client, so a proxied request carries the
router's executor key (``Router.control_headers``, an admin key) instead of the client's
header; without it, the client's own ``Authorization`` goes through and the executor checks
it. A tenant key's body gets the tenant's salt in ``cache_salt`` (``tenant_salt``) before it
is hashed, explained or forwarded, so its keys are the ones the executor computes.

Tenant limits (``limiter``, ``kvreuse.api.limiter``) are the executor's, checked before
anything is sent: a tenant's in-flight slot is taken before the body is parsed
(``TenantLimitMiddleware``) and held until the response's last byte; its tokens per minute
are reserved once the prompt is tokenized (``kvreuse.router.tenant_usage.request_cost``)
and corrected to the usage the executor answers with. A refusal is the executor's 429,
``Retry-After`` included, and reaches no executor.

``/openapi.json`` describes the request bodies with the executor's models
(``kvreuse.router.openapi``); the routes still forward the client's bytes. ``/docs`` and
``/redoc`` show it as the executor's do, and answer as ``/openapi.json`` does.

``/v1/route/explain`` takes a completions or chat body (a body with ``messages`` is chat)
and sends nothing to any executor; it decides as a dry run (``Router.decide(dry_run=True)``),
so it changes no policy state: its choice is the one the same request would get next. It
names executors by id (``Executor.id``, their ``--executor`` order: ``id``, ``choice_id``);
their URLs (``executor``, ``choice``) only to an admin key (or anyone, without keys), as
``/v1/route/executors`` does.

A routed request whose client disconnects before the response is abandoned and its
upstream request closed, so the executor aborts it (``proxy.forward``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvreuse import __version__
from kvreuse.api import docs_routes
from kvreuse.api.anthropic_errors import AnthropicErrorMiddleware
from kvreuse.api.body import parse_json_body
from kvreuse.api.errors import APIError, error_response, limit_response
from kvreuse.api.limit_metrics import TenantsHidden
from kvreuse.api.limiter import LimitExceeded, TenantLimiter
from kvreuse.api.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    TenantLimitMiddleware,
    lease_of,
)
from kvreuse.api.tenants import APIKeys, sees_tenants, tenant_of, tenant_salt
from kvreuse.router.affinity import prompt_cache_key
from kvreuse.router.messages_proxy import MessagesUsage, forward_messages, messages_cost, messages_keys
from kvreuse.router.openapi import explain_body_error, install_openapi
from kvreuse.router.proxy import EXECUTOR_HEADER, error, forward
from kvreuse.router.router import Router
from kvreuse.router.tenant_usage import UsageTap, ask_for_usage, request_cost


def build_router_app(
    router: Router,
    *,
    api_key: str | Sequence[str] | APIKeys | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limiter: TenantLimiter | None = None,
    metrics_tenant_labels: bool = False,
) -> FastAPI:
    """An app serving ``router``; its lifespan starts and stops the router's tasks.
    ``api_key``: the keys clients must send (None: the router checks none). ``limiter``:
    per-tenant limits (they need keys). ``metrics_tenant_labels`` (``--metrics-tenant-labels``):
    every scraper of ``/metrics`` sees tenant names (default: only an admin key's, with keys).
    Raises ``ValueError`` for a bad key spec, or limits naming a tenant no key has."""
    keys = api_key if isinstance(api_key, APIKeys) or api_key is None else APIKeys.parse(api_key)
    if limiter is not None:
        limiter.limits.check_keys(keys)
        from kvreuse.api.limit_metrics import LimiterCollector

        router.metrics.registry.register(LimiterCollector(limiter, "kvreuse:router_"))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.gather(*(router.probe(e) for e in router.executors.values()))
        router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvreuse router", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router
    install_openapi(app)  # the request bodies described with the executor's models
    app.include_router(docs_routes.router)  # /docs, /redoc: the executor's pages, guarded as /openapi.json is

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(LimitExceeded)
    async def _limited(_: Request, exc: LimitExceeded) -> Response:
        return limit_response(exc)  # the executor's 429, Retry-After included

    def upstream_headers(request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k != "authorization"}
        return {**headers, **router.control_headers} if keys is not None else dict(request.headers)

    async def routed(request: Request, path: str, *, chat: bool) -> Response:
        try:
            raw, body = await _client_body(request)
        except APIError as exc:
            return exc.response()  # the executor's 400 for this body, without tokenizing or sending it
        lease = lease_of(request.scope)
        tap = None
        if lease is not None and lease.limits_tokens and isinstance(body, dict):
            tap = UsageTap(lease, hide_usage=ask_for_usage(body))
            if tap.hide_usage:
                raw = _dumps(body)
        # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
        keys = await asyncio.to_thread(router.hasher.request_keys, chat, body if isinstance(body, dict) else {})
        if tap is not None and isinstance(body, dict):  # a tap is made only for a dict body
            cost = await asyncio.to_thread(
                request_cost, router.hasher, chat, body, keys, router.default_max_tokens, router.fits_context
            )
            if cost is not None:
                lease.reserve(*cost)  # LimitExceeded: the 429, and nothing is sent
        return _for_client(
            request,
            await forward(
                router,
                path,
                raw,
                upstream_headers(request),
                chat=chat,
                request=request,
                body=body,
                keys=keys,
                usage=tap,
            ),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await routed(request, "/v1/chat/completions", chat=True)

    async def messages(request: Request, path: str) -> Response:
        try:
            raw, body = await _client_body(request)
        except APIError as exc:
            return exc.response()  # in Anthropic's shape (AnthropicErrorMiddleware)
        keys = await asyncio.to_thread(messages_keys, router, body)
        lease, usage = lease_of(request.scope), None
        if (
            lease is not None
            and lease.limits_tokens
            and path == "/v1/messages"
            and (cost := messages_cost(router, body, keys)) is not None
        ):
            lease.reserve(*cost)  # LimitExceeded: the 429, and nothing is sent
            usage = MessagesUsage(lease)
        return _for_client(
            request,
            await forward_messages(
                router,
                path,
                raw,
                upstream_headers(request),
                request=request,
                body=body,
                keys=keys,
                affinity=prompt_cache_key(body),
                usage=usage,
            ),
        )

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        return await messages(request, "/v1/messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await messages(request, "/v1/messages/count_tokens")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for e in router.executors.values():
            if e.healthy:
                try:
                    headers = router.control_headers if keys is not None else _auth(request)
                    resp = await router.client.get(f"{e.url}/v1/models", headers=headers, timeout=5.0)
                except Exception:  # noqa: BLE001 - try the next executor
                    continue
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
        return error("no healthy executor", 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        # open to probes: whether each executor is healthy, in --executor order; never their addresses
        healthy = [e.healthy for e in router.executors.values()]
        return JSONResponse(
            {
                "status": "ok" if any(healthy) else "error",
                "policy": router.policy.name,
                "executors": [{"healthy": h} for h in healthy],
            },
            status_code=200 if any(healthy) else 503,
        )

    @app.get("/v1/route/executors")
    async def executors(request: Request) -> JSONResponse:
        """Each executor's URL, health, load and last error (an admin key's, with keys)."""
        if keys is not None and tenant_of(request.scope) is not None:
            return error_response(
                "GET /v1/route/executors needs an admin key (one given without ':tenant'): it names the executors",
                status=403,
                code="admin_key_required",
            )
        return JSONResponse({"executors": [e.status() for e in router.executors.values()]})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The router's metrics. Tenant names and their usage (``kvreuse:router_tenant_*``) only
        for a scraper who may see them (``sees_tenants``: no keys, an admin key, or
        ``metrics_tenant_labels``); others get sums over tenants, ``tenant="(all)"``."""
        if sees_tenants(request.scope):
            body, content_type = router.metrics.render()
        else:
            body, content_type = generate_latest(TenantsHidden(router.metrics.registry)), CONTENT_TYPE_LATEST
        return Response(body, media_type=content_type)

    @app.post("/v1/route/explain")
    async def explain(request: Request) -> JSONResponse:
        try:
            _, body = await _client_body(request)
        except APIError as exc:
            return exc.response()
        if not isinstance(body, dict):
            return error("the body must be a JSON object", 400, "invalid_request_error")
        chat = "messages" in body
        if (invalid := explain_body_error(body, chat)) is not None:
            return invalid.response()  # the executor's 400 for it: the body its description rules out
        keys = await asyncio.to_thread(router.hasher.request_keys, chat, body)
        routed = router.decide(keys, dry_run=True)
        overlaps = {c.name: c for c in (routed.candidates if routed else [])}
        admin = tenant_of(request.scope) is None  # as /v1/route/executors: addresses for admin keys only
        executors = []
        for e in router.executors.values():
            c = overlaps.get(e.name)
            executors.append(
                {
                    "id": e.id,
                    **({"executor": e.url} if admin else {}),
                    "healthy": e.healthy,
                    "overlap_blocks": c.overlap_blocks if c else router.index.overlaps(keys.keys, [e.name])[e.name],
                    "overlap_tokens": (c.overlap_blocks if c else 0) * router.block_size,
                    "load_blocks": e.load_blocks,
                    "in_flight": e.in_flight,
                    "score": routed.decision.scores.get(e.name) if routed else None,
                }
            )
        return JSONResponse(
            {
                "endpoint": "chat" if chat else "completions",
                "policy": router.policy.name,
                "overlap_weight": getattr(router.policy, "overlap_weight", None),
                "prompt_tokens": keys.num_tokens,
                "prompt_blocks": len(keys.keys),
                "block_size": router.block_size,
                "executors": executors,
                "choice_id": router.executors[routed.decision.choice].id if routed else None,
                **({"choice": routed.decision.choice if routed else None} if admin else {}),
            }
        )

    # Added last = outermost: the size limit runs first, then the key, then the tenant's
    # in-flight slot, then the routes.
    if limiter is not None:
        app.add_middleware(TenantLimitMiddleware, limiter=limiter)
    if keys is not None:
        app.add_middleware(APIKeyMiddleware, api_key=keys, tenant_labels_public=metrics_tenant_labels)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: Anthropic's error shape on /v1/messages*
    return app


def _for_client(request: Request, response: Response) -> Response:
    """``response`` without the executor's address (``EXECUTOR_HEADER``) for a tenant key: like
    ``/v1/route/executors`` and ``/health``, a routed response names executors to admin keys
    only (and to every client when the router has no keys)."""
    if tenant_of(request.scope) is not None and EXECUTOR_HEADER in response.headers:
        del response.headers[EXECUTOR_HEADER]
    return response


async def _client_body(request: Request) -> tuple[bytes, object]:
    """``(bytes to forward, parsed body)``: for a tenant key, the body with the tenant's salt
    in ``cache_salt`` (unchanged for an admin key, or when it is not a JSON object, which
    the caller answers, or whose ``cache_salt`` is neither absent, null nor a non-empty string:
    the executor refuses that one with its 400 naming the field, as it would without the router).
    Raises the executor's ``APIError`` (400) for a body that does not parse."""
    raw = await request.body()
    body = parse_json_body(raw)
    tenant = tenant_of(request.scope)
    if tenant is None or not isinstance(body, dict):
        return raw, body
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        return raw, body  # "" or 5: not a salt; salting it would make an invalid request valid
    body["cache_salt"] = tenant_salt(tenant, salt)
    return _dumps(body), body


def _dumps(body: dict) -> bytes:
    try:
        return json.dumps(body).encode()
    except RecursionError:  # parsed at the parser's limit: never forward it changed
        raise APIError("request body: JSON is nested too deeply (arrays or objects about 1000 levels deep)") from None


def _auth(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}
