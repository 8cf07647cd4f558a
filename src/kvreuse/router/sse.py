"""Server-sent events as the executors write them: ``data: <json>\\n\\n`` events, the last
one ``data: [DONE]\\n\\n``; and the error event the router ends a failed stream with.

The router relays whole events only: ``EventSplitter`` cuts a byte stream at event
boundaries and keeps the incomplete tail, so a client never parses half an event.
"""

from __future__ import annotations

import json
from typing import Any

SSE_SEPARATOR = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"
_DATA = b"data: "


class EventSplitter:
    """Whole events out of arbitrary chunks of one stream."""

    def __init__(self) -> None:
        self.pending = b""  # the part of the stream after its last whole event

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events completed by ``chunk``, each with its separator."""
        whole, sep, self.pending = (self.pending + chunk).rpartition(SSE_SEPARATOR)
        if not sep:
            return []
        return [event + SSE_SEPARATOR for event in whole.split(SSE_SEPARATOR)]


def payload(event: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``data:`` event; ``None`` for ``[DONE]``, comments, or anything
    that is not one JSON object (such events are passed on as they are)."""
    if not event.startswith(_DATA) or event == SSE_DONE:
        return None
    try:
        body = json.loads(event[len(_DATA) :])
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def encode(body: dict[str, Any]) -> bytes:
    """One event, serialised as the executor serialises its own (``serving.sse``)."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + SSE_SEPARATOR


def error_event(message: str, code: str = "executor_failed") -> bytes:
    """An OpenAI-style error event; the official client raises it as ``openai.APIError``."""
    return encode({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
