"""The model's tool calls in a ``/v1/messages`` reply, as Anthropic's ``tool_use`` blocks.

Chat templates that render tools (Qwen's, Hermes') teach the model to answer a call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. When the request had ``tools``,
the reply's text is split at the first ``<tool_call>``: what comes before stays a text block,
each well-formed call becomes a ``tool_use`` block (``id`` ``toolu_...``, ``name``, ``input``) and
the stop reason is ``tool_use``. A reply whose calls do not parse stays text, whole.

Streamed, the text is sent as it comes until a ``<tool_call>`` could be starting (a tail that
is a prefix of the marker is held back); the rest is held until the reply ends and then sent as
``tool_use`` blocks (``content_block_start`` with an empty ``input``, one ``input_json_delta``,
``content_block_stop``), or as text when it holds no call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvreuse.server import messages_format as fmt

OPEN = "<tool_call>"
_CALL = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    input: dict[str, Any]

    def block(self) -> dict[str, Any]:
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": self.input}


def _call(raw: str) -> ToolCall | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    args = data.get("arguments", data.get("input", {})) if isinstance(data, dict) else None
    if isinstance(args, str):  # some templates' models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(args, dict):
        return None
    return ToolCall(f"toolu_{uuid.uuid4().hex[:24]}", data["name"], args)


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``(text before the first call, the calls)``; ``(text, [])`` when ``text`` holds no call
    or anything after the first ``<tool_call>`` is not a sequence of well-formed calls."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls, pos, tail = [], 0, text[start:]
    while pos < len(tail):
        match = _CALL.match(tail, pos)
        call = _call(match.group(1)) if match else None
        if match is None or call is None:
            return text, []
        calls.append(call)
        pos = match.end()
    return text[:start].rstrip(), calls


def held_back(text: str) -> int:
    """Where ``text`` must stop being streamed as text: at a ``<tool_call>``, or at a tail that
    could be the start of one; ``len(text)`` when neither."""
    start = text.find(OPEN)
    if start >= 0:
        return start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolStream:
    """The text events of one streamed reply whose request had tools: ``feed`` each output's
    new text, ``finish`` at the end; both yield SSE events for content block 0 and after."""

    def __init__(self) -> None:
        self.text = ""  # the reply so far
        self.sent = 0  # characters of it sent as text deltas
        self.calls: list[ToolCall] = []

    def feed(self, new_text: str) -> Iterator[str]:
        self.text += new_text
        upto = max(self.sent, held_back(self.text))
        if upto > self.sent:
            yield fmt.text_delta(self.text[self.sent : upto])
            self.sent = upto

    def finish(self, calls_allowed: bool) -> Iterator[str]:
        """The held text as text, or (``calls_allowed``: the reply ended of itself) the calls as
        ``tool_use`` blocks; block 0, the text, is closed here."""
        self.calls = split_tool_calls(self.text)[1] if calls_allowed else []
        rest = self.text[self.sent :]
        if not self.calls and rest:
            yield fmt.text_delta(rest)
        yield fmt.block_stop(0)
        for index, call in enumerate(self.calls, start=1):
            yield fmt.event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}},
                },
            )
            yield fmt.event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.input)},
                },
            )
            yield fmt.block_stop(index)
