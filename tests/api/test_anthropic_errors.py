"""AnthropicErrorMiddleware: OpenAI-shaped errors on /v1/messages* become Anthropic's, status and
headers kept; other paths and successes pass untouched."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvreuse.api.anthropic_errors import AnthropicErrorMiddleware, error_type, stream_error, translate
from kvreuse.api.errors import error_response


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
        (405, "invalid_request_error"),
        (502, "api_error"),
    ],
)
def test_status_to_type(status, kind):
    assert error_type(status) == kind


def test_translate_and_stream_error():
    body = json.dumps(
        {
            "error": {
                "message": "max_tokens: field required",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": None,
            }
        }
    ).encode()
    assert json.loads(translate(body, 400)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: field required"},
    }
    assert translate(b"not json", 400) is None and translate(b'{"type": "error", "error": {}}', 400) is None
    assert (
        stream_error("boom") == 'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'
    )


def _call(path: str, response) -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(AnthropicErrorMiddleware(response)(scope, receive, send))
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_the_middleware_rewrites_only_messages_errors():
    limited = error_response("slow down", status=429, type="tokens", headers={"Retry-After": "4"})
    status, headers, body = _call("/v1/messages", limited)
    assert status == 429 and headers["retry-after"] == "4" and headers["content-length"] == str(len(body))
    assert json.loads(body) == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    status, _, body = _call("/v1/chat/completions", limited)
    assert json.loads(body)["error"]["type"] == "tokens"  # OpenAI's shape elsewhere
    ok = error_response("fine", status=200)
    assert json.loads(_call("/v1/messages", ok)[2]) == {
        "error": {"message": "fine", "type": "invalid_request_error", "param": None, "code": None}
    }


def test_starlettes_default_errors_are_rewritten_too():
    # kvreuse route answers a method or path no route serves with Starlette's {"detail": ...}
    assert json.loads(translate(b'{"detail": "Method Not Allowed"}', 405)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Method Not Allowed"},
    }
    assert json.loads(translate(b'{"detail": "Not Found"}', 404)) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "Not Found"},
    }
    assert translate(b'{"detail": [{"loc": ["body"]}]}', 422) is None  # not a message: left alone
