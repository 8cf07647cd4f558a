"""Anthropic's error shape on the Messages API routes, for the executor and the router alike.

Every error of ``/v1/messages`` and ``/v1/messages/count_tokens`` is::

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: field required"}}

with the type its status says (``ERROR_TYPES``). The rest of the server speaks OpenAI's shape
(``kvreuse.api.errors``); rather than a second copy of every handler and guard (the body limit,
the API key, the tenant limits answer before any route runs), ``AnthropicErrorMiddleware``, the
outermost layer, rewrites an OpenAI-shaped error body on these paths into this one, keeping
its status, message and headers (``Retry-After``). Errors in the middle of a stream are the
route's own ``error`` events (``stream_error``).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PATH = "/v1/messages"  # and /v1/messages/count_tokens

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (other 4xx: invalid request; other 5xx: API error)."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(message: str, type: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message}}


def stream_error(message: str, type: str = "api_error") -> str:
    """An ``error`` event of a Messages stream (what the official clients raise from)."""
    return f"event: error\ndata: {json.dumps(anthropic_error_body(message, type), separators=(',', ':'))}\n\n"


def translate(body: bytes, status: int) -> bytes | None:
    """An OpenAI error body, or Starlette's ``{"detail": "Not Found"}`` (a path or method no
    route serves, e.g. on ``kvreuse route``), as Anthropic's; ``None`` when ``body`` is neither
    (already Anthropic's, empty, not JSON)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict) and set(parsed) == {"detail"} and isinstance(parsed["detail"], str):
        return json.dumps(anthropic_error_body(parsed["detail"], error_type(status))).encode()
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or parsed.get("type") == "error" or not isinstance(error.get("message"), str):
        return None
    return json.dumps(anthropic_error_body(error["message"], error_type(status))).encode()


class AnthropicErrorMiddleware:
    """On the Messages API paths, rewrite error responses (status >= 400) into Anthropic's
    shape; everything else passes untouched, and so does every success (streams included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            new = translate(body, start["status"])
            if new is not None:
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                start = {**start, "headers": [*headers, (b"content-length", str(len(new)).encode())]}
                body = new
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
