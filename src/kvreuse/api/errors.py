"""OpenAI's error shape, shared by the executor's server and the router.

Every error response is::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

``APIError`` carries one such error with its HTTP status; raising it from a route (or from
``render_chat``) gives the client that body. A tenant's limit refusal
(``kvreuse.api.limiter.LimitExceeded``) is a 429 with ``Retry-After`` (``limit_response``).
The handlers that turn every other failure into this shape are the server's
(``kvreuse.server.errors.install_error_handlers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from kvreuse.api.limiter import LimitExceeded


class APIError(Exception):
    """An error the client caused (or a server failure) with its HTTP status and OpenAI fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.message, status=self.status, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    message: str,
    *,
    status: int = 400,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type=type, param=param, code=code), status_code=status, headers=headers)


def limit_response(exc: LimitExceeded) -> JSONResponse:
    """The 429 of a tenant limit, with its ``Retry-After`` headers (the executor's and the
    router's alike; the in-flight refusal of ``TenantLimitMiddleware`` has the same shape)."""
    return error_response(exc.message, status=429, type=exc.type, param=exc.param, code=exc.code, headers=exc.headers())
