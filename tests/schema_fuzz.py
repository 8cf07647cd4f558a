"""Schema-driven fuzzing (schemathesis) of a live server's own ``/openapi.json``: the request
bodies of the OpenAI and Anthropic endpoints, generated both to fit the schema (positive) and
to break it (negative), a bounded number per operation, with a fixed seed so CI replays the
same cases. Every answer must be below 500, and every 4xx must be in the API's own error shape:
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on ``/v1/completions`` and
``/v1/chat/completions``, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
``/v1/messages*``. Used by tests/server/test_schema_fuzz.py (``kvreuse serve``'s app) and
tests/router/test_schema_fuzz.py (``kvreuse route``'s)."""

from __future__ import annotations

import json
from typing import Any

import httpx

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
MODES = ("positive", "negative")
# Cases per operation and mode: 4 operations x 2 modes x 12 = 96 requests per server. Each is
# a request to a tiny model (max_tokens is clamped below), so the whole file stays well
# under 30 s on 2 busy cores.
MAX_EXAMPLES = 12
MAX_TOKENS = 4  # generated max_tokens above this are lowered: the fuzzing is of the API, not of decoding


def problem(path: str, response: httpx.Response) -> str | None:
    """What is wrong with ``response`` to a fuzzed request at ``path`` (``None``: nothing)."""
    if response.status_code >= 500:
        return f"server error {response.status_code}: {response.text[:500]}"
    if response.status_code < 400:
        return _stream_problem(response.text) if "data: " in response.text else None
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} is not JSON: {response.text[:300]!r}"
    if path in ANTHROPIC_PATHS:
        error = body.get("error") if isinstance(body, dict) else None
        ok = (
            body.get("type") == "error"
            and isinstance(error, dict)
            and isinstance(error.get("type"), str)
            and isinstance(error.get("message"), str)
        )
        shape = 'Anthropic\'s {"type": "error", "error": {"type", "message"}}'
    else:
        error = body.get("error") if isinstance(body, dict) else None
        ok = (
            isinstance(error, dict)
            and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str)
            and isinstance(error["type"], str)
        )
        shape = 'OpenAI\'s {"error": {"message", "type", "param", "code"}}'
    return None if ok else f"{response.status_code} not in {shape}: {response.text[:300]}"


def _stream_problem(text: str) -> str | None:
    """An error event in a 200 stream that is not the request's own fault (a server error
    hidden in a stream), else ``None``."""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return f"a stream event is not JSON: {line[:200]!r}"
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and error.get("type") != "invalid_request_error":
            return f"a stream ended in a server error: {line[:300]}"
    return None


def bounded(body: Any) -> Any:
    """``body`` with an integer ``max_tokens`` above ``MAX_TOKENS`` lowered to it, and set to
    it when neither it nor ``max_completion_tokens`` is there (a fuzzed valid request would
    otherwise decode up to the context's end); anything else unchanged."""
    if isinstance(body, dict):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[field] = MAX_TOKENS
    return body


def fuzz(base_url: str, path: str, mode: str, *, headers: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run ``MAX_EXAMPLES`` cases of ``mode`` against ``POST path`` of the server at
    ``base_url``, described by its own ``/openapi.json``; returns ``(cases, problems)``."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers or {})
    operation = schema[path]["POST"]
    found: list[str] = []
    cases = 0

    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same cases on every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        nonlocal cases
        cases += 1
        case.body = bounded(case.body)
        response = case.call(base_url=base_url, headers=headers, timeout=120)
        why = problem(path, httpx.Response(response.status_code, content=response.content))
        if why is not None:
            found.append(f"{mode} {path} {json.dumps(case.body, default=repr)[:400]} -> {why}")

    run()
    return cases, found
