"""The router's OpenAPI description: its request bodies are the executor's models.

The routed endpoints read their bodies raw (``kvreuse.router.app``): the router forwards
the client's bytes, adds a tenant's salt, and leaves validation to the executor, whose 400
it passes on. So their ``Request`` parameters say nothing about the body. The description
is generated instead from stand-in routes (never served) that declare the executor's own
models from ``kvreuse.api.protocol`` (and ``anthropic_protocol``), by the generator the executor's description comes
from, so both describe ``POST /v1/completions`` and ``POST /v1/chat/completions`` alike;
``POST /v1/route/explain`` takes either body, and checks it as described (``explain_body_error``):
it sends nothing anywhere, so no executor's 400 would stop a body the description rules out.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import ValidationError

from kvreuse.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvreuse.api.errors import APIError
from kvreuse.api.protocol import ChatCompletionRequest, CompletionRequest

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "json-or-python", "function-after", "function-before"}


def explain_body_error(body: dict[str, Any], chat: bool) -> APIError | None:
    """The executor's 400 for ``body`` as a chat (``chat``) or completions request, naming the
    first offending field as the executor does (``messages[0].role: ...``), or ``None``
    when the body is one the executor would take."""
    try:
        parsed = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        if isinstance(parsed, CompletionRequest):
            parsed.prompts()
        parsed.num_logprobs()  # what validation leaves to it (top_logprobs without logprobs)
    except ValidationError as exc:
        first = exc.errors()[0]
        parts = [p for p in first.get("loc", ()) if isinstance(p, int) or not (p in _TYPE_TAGS or "[" in p)]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return APIError(
            f"{path}: {first.get('msg')} (got {shown})" if path else str(first.get("msg")), param=path or None
        )
    except APIError as exc:
        return exc
    except ValueError as exc:
        return APIError(str(exc))
    return None


def _stand_ins() -> list[APIRoute]:
    """The body-typed twins of the routed endpoints, named as the app's own handlers."""
    twins = APIRouter()

    @twins.post("/v1/completions")
    async def completions(body: CompletionRequest) -> None:
        """A completion, routed to the executor the policy picks (streamed or not)."""

    @twins.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> None:
        """A chat completion, routed to the executor the policy picks (streamed or not)."""

    @twins.post("/v1/messages")
    async def create_message(body: MessagesRequest) -> None:
        """Anthropic's Messages API, routed as chat is (streamed or not; docs/anthropic.md)."""

    @twins.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> None:
        """The prompt's tokens, as the executor renders the request."""

    @twins.post("/v1/route/explain")
    async def explain(body: ChatCompletionRequest | CompletionRequest) -> None:
        """What the router would do with this body (a body with ``messages`` is chat): each
        executor's overlap, load and score, and the choice. Sends nothing to any executor."""

    return [r for r in twins.routes if isinstance(r, APIRoute)]


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` describe the routed endpoints' bodies with the executor's
    models (the app's other routes as they are)."""
    twins = _stand_ins()
    replaced = {(r.path, m) for r in twins for m in r.methods or ()}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            own = [
                r
                for r in app.routes
                if not (isinstance(r, APIRoute) and any((r.path, m) in replaced for m in r.methods or ()))
            ]
            app.openapi_schema = get_openapi(title=app.title, version=app.version, routes=[*twins, *own])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
