"""API keys and the tenants they belong to, for the executor and the router alike.

``--api-key KEY`` (repeatable) is an *admin* key: everything, as before. ``--api-key
KEY:TENANT`` is a key of tenant ``TENANT`` (letters, digits, ``_ . -``; the part after the
last ``:``). A tenant's requests get the tenant's salt on their prompt blocks automatically
(``tenant_salt``): no tenant can hit, or learn by timing or ``/v1/route/explain`` whether,
another tenant's blocks, whatever ``cache_salt`` it sends. The routes that show or change
every tenant's cache (``ADMIN_PATHS``: block token ids in the KV state and events,
``/reset_prefix_cache``, registering or deleting PML schemas) need an admin key; a tenant
key gets a 403 there.

The middleware (``kvreuse.api.middleware.APIKeyMiddleware``) puts the caller's tenant in
``scope["state"]["tenant"]`` (``None`` for an admin key); ``tenant_of`` reads it back. On the
open ``/metrics`` it records whether the caller may see tenant names (``sees_tenants``): only
with an admin key, or when the server was started with ``--metrics-tenant-labels``.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# and their sub-paths; /v1/kvreuse/info names the (unauthenticated) ZMQ event socket, whose
# events carry every tenant's token ids: admins (routers) only
ADMIN_PATHS = ("/v1/kv_cache_state", "/v1/kv_cache_events", "/reset_prefix_cache", "/v1/kvreuse/info")
ADMIN_WRITES = ("/v1/schemas",)  # POST / DELETE need an admin key; GET does not


@dataclass(frozen=True)
class APIKeys:
    """Accepted keys -> tenant (``None``: an admin key)."""

    tenants: Mapping[str, str | None]

    @classmethod
    def parse(cls, specs: str | Iterable[str]) -> APIKeys:
        """``KEY`` or ``KEY:TENANT`` specs. Raises ``ValueError`` for an empty key, a bad
        tenant name, or one key given twice."""
        tenants: dict[str, str | None] = {}
        for spec in [specs] if isinstance(specs, str) else specs:
            key, sep, tenant = spec.rpartition(":") if ":" in spec else (spec, "", "")
            if sep and not TENANT_NAME.fullmatch(tenant):
                raise ValueError(
                    f"--api-key {spec[:4]}...: the tenant after the last ':' must be 1-64 letters, "
                    f"digits, '_', '.' or '-' (got {tenant!r})"
                )
            if not key:
                raise ValueError("--api-key: the key must not be empty")
            if key in tenants:
                raise ValueError(f"--api-key {key[:4]}...: the same key is given twice")
            tenants[key] = tenant if sep else None
        if not tenants:
            raise ValueError("--api-key: give at least one key")
        return cls(tenants)

    def lookup(self, authorization: bytes) -> tuple[bool, str | None]:
        """``(known, tenant)`` for an ``Authorization`` header value. Every key is compared
        (in constant time each), so the answer's timing does not say which one matched."""
        found, tenant = False, None
        for key, owner in self.tenants.items():
            if hmac.compare_digest(authorization, f"Bearer {key}".encode()):
                found, tenant = True, owner
        return found, tenant

    @property
    def has_tenants(self) -> bool:
        return any(t is not None for t in self.tenants.values())

    @property
    def tenant_names(self) -> frozenset[str]:
        return frozenset(t for t in self.tenants.values() if t is not None)


def presented_key(headers: Mapping[bytes, bytes]) -> bytes:
    """The credential of a request's (lower-cased) headers, as ``APIKeys.lookup`` takes it:
    ``Authorization: Bearer KEY`` (OpenAI's clients), else ``x-api-key: KEY`` (Anthropic's),
    which names the same keys and tenants."""
    given = headers.get(b"authorization", b"")
    if not given and (key := headers.get(b"x-api-key", b"")):
        return b"Bearer " + key
    return given


def needs_admin(method: str, path: str) -> bool:
    """Whether a tenant key is refused (403) on ``method path``."""
    if any(path == p or path.startswith(p + "/") for p in ADMIN_PATHS):
        return True
    return method in ("POST", "PUT", "DELETE") and any(path == p or path.startswith(p + "/") for p in ADMIN_WRITES)


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed with: the client's ``cache_salt`` for an admin
    key; for a tenant, ``tenant:<name>`` (then ``|`` and the client's salt, which still
    separates caches within the tenant)."""
    if tenant is None:
        return cache_salt
    return f"tenant:{tenant}" + (f"|{cache_salt}" if cache_salt else "")


SEES_TENANTS = "sees_tenants"  # scope["state"] key: may this caller see tenant names on /metrics


def sees_tenants(scope: Mapping[str, Any]) -> bool:
    """Whether the caller may see tenant names and their usage on ``/metrics``: true without
    API keys (no middleware: nothing is sealed), else as ``APIKeyMiddleware`` decided."""
    state = scope.get("state") or {}
    return state.get(SEES_TENANTS, True)


def tenant_of(scope: Mapping[str, Any]) -> str | None:
    """The tenant the middleware found for this request (``None``: admin key, or no keys)."""
    state = scope.get("state") or {}
    return state.get("tenant")
