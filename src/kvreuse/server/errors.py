"""The handlers that put every failure of the server into OpenAI's error shape
(``kvreuse.api.errors``), and ``from_value_error``, which names the field a ``ValueError``
is about.

FastAPI's default 422 for an invalid body becomes a 400 whose message names the field; a
body FastAPI could not parse (not UTF-8, not JSON, nested too deeply) gets the message of
``kvreuse.api.body.parse_json_body``, the one the router gives for the same body.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.api.body import parse_json_body
from kvreuse.api.errors import APIError, error_response, limit_response
from kvreuse.api.limiter import LimitExceeded
from kvreuse.engine.async_engine import EngineError
from kvreuse.pml import PMLError

logger = logging.getLogger(__name__)

# Request fields, most specific first: used to name the ``param`` of an engine ValueError.
_KNOWN_PARAMS = (
    "kv_cache_retention_config",
    "max_completion_tokens",
    "max_tokens",
    "cache_salt",
    "messages",
    "prompt",
    "suffix",
    "stream_options",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "best_of",
    "response_format",
    "tools",
    "temperature",
    "top_p",
    "top_k",
    "top_logprobs",
    "logprobs",
    "echo",
    "stop",
    "seed",
    "model",
    "n",
)
# Location parts pydantic adds for union members and validators: not field names.
# Fields that are unions: pydantic reports one failure per member; say what is accepted.
_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "expected a string or a list of strings",
    "content": "expected a string or a list of text parts",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "json-or-python", "function-after", "function-before"}


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away; its requests were aborted."""


def from_value_error(exc: ValueError) -> APIError:
    """A 400 for an engine or parameter ``ValueError``; ``param`` is the field its message names."""
    message = str(exc)
    if isinstance(exc, PMLError):  # markup in the prompt: line/column or the module is in the message
        return APIError(message, param="prompt")
    lowered = message.lower()
    # whole words only: "n" must not match every message containing the letter
    hits = [(m.start(), name) for name in _KNOWN_PARAMS if (m := re.search(rf"(?<![\w.]){name}(?!\w)", lowered))]
    param = min(hits)[1] if hits else None
    return APIError(message, param=param)


def _loc_path(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in str(part) or "-" in str(part):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(exc: RequestValidationError) -> APIError:
    """One 400 naming the first offending field (a union reports all its members' failures;
    the first says enough)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(f"malformed JSON body: {detail}".rstrip(": "), param=None)
    path = _loc_path(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return APIError(f"{path}: field required" if path else "request body is required", param=path or None)
    if not path:
        return APIError(f"request body must be a JSON object (Content-Type: application/json): {first.get('msg')}")
    got = first.get("input")
    top = path.rsplit(".", 1)[-1]
    union_failures = sum(1 for e in errors if _loc_path(tuple(e.get("loc", ()))) == path)
    if top in _UNION_HINTS and union_failures > 1:
        shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
        return APIError(f"{path}: {_UNION_HINTS[top]} (got {shown})", param=path)
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    return APIError(f"{path}: {first.get('msg')} (got {shown})", param=path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def _unparsable(request: Request) -> JSONResponse | None:
        """The body's own parse error (``parse_json_body``), or None if it parses."""
        try:
            parse_json_body(await request.body())  # read and kept by the route's parsing
        except APIError as exc:
            return exc.response()
        return None

    @app.exception_handler(LimitExceeded)
    async def _limited(_: Request, exc: LimitExceeded) -> JSONResponse:
        return limit_response(exc)  # 429 with Retry-After

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid" and (bad := await _unparsable(request)):
            return bad
        return validation_error(exc).response()

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(str(exc), status=500, type="internal_server_error", code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if (
            exc.status_code == 400
            and exc.detail == "There was an error parsing the body"  # FastAPI's words
            and (bad := await _unparsable(request))
        ):
            return bad
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        message = str(exc.detail or phrase)
        if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            message = f"Invalid URL ({request.method} {request.url.path})"  # OpenAI's wording
        kind = (
            "not_found_error"
            if exc.status_code == 404 and not message.startswith("Invalid URL")
            else "invalid_request_error"
        )
        return error_response(message, status=exc.status_code, type=kind)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(f"internal server error: {type(exc).__name__}", status=500, type="internal_server_error")
