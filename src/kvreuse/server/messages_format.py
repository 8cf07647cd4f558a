"""The bodies ``/v1/messages`` answers with: a message, its usage, its stream's events.

Shapes are Anthropic's (https://docs.anthropic.com/en/api/messages). ``usage`` counts the prompt
as the request's cache plan says (``kvreuse.api.cache_breakpoints.CachePlan.usage``) and adds a
``kvreuse`` extension with the cached tokens per tier when the engine has tiers.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvreuse.api.protocol import usage_dict

if TYPE_CHECKING:
    from kvreuse.api.cache_breakpoints import CachePlan
    from kvreuse.engine.outputs import RequestOutput


def stop_reason(out: RequestOutput, tokenizer: Any, stop_sequences: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of an output: ``max_tokens`` when ``max_tokens`` ran out,
    ``stop_sequence`` (and which) when the text was cut at one, else ``end_turn``; ``(None,
    None)`` while it runs. The engine cuts a stop string from the text without saying which:
    it is the one the decoded output continues with past the text (the engine's choice among
    several at one place, the smallest, is mirrored)."""
    if not out.finished:
        return None, None
    if out.finish_reason == "length":
        return "max_tokens", None
    if stop_sequences and out.finish_reason == "stop":
        decoded = tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        if decoded.startswith(out.text):
            rest = decoded[len(out.text) :]
            for s in sorted(stop_sequences):
                if rest.startswith(s):
                    return "stop_sequence", s
    return "end_turn", None


def usage_body(plan: CachePlan, out: RequestOutput, block_size: int) -> dict[str, Any]:
    """Anthropic's ``usage`` of an output (its prompt and the tokens generated so far)."""
    counts = plan.usage(out.num_prompt_tokens, out.num_cached_tokens, block_size)
    usage: dict[str, Any] = {
        "input_tokens": counts.input_tokens,
        "cache_creation_input_tokens": counts.cache_creation_input_tokens,
        "cache_read_input_tokens": counts.cache_read_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": counts.ephemeral_5m_input_tokens,
            "ephemeral_1h_input_tokens": counts.ephemeral_1h_input_tokens,
        },
        "output_tokens": len(out.output_token_ids),
    }
    by_tier = usage_dict(out.num_prompt_tokens, 0, out.num_cached_tokens, [out])["prompt_tokens_details"].get(
        "cached_tokens_by_tier"
    )
    if by_tier is not None:  # an extension: where the cache reads came from (device, host, disk, remote)
        usage["kvreuse"] = {"cache_read_input_tokens_by_tier": by_tier}
    return usage


def message_body(
    message_id: str,
    model: str,
    text: str,
    reason: tuple[str | None, str | None],
    usage: dict[str, Any],
    tool_blocks: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole message (``content`` empty until it has text: a stream's ``message_start``),
    its text block followed by ``tool_blocks`` (``messages_tools``)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": ([{"type": "text", "text": text}] if text else []) + (tool_blocks or []),
        "model": model,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


def event(name: str, payload: dict[str, Any]) -> str:
    """One server-sent event of a Messages stream (``event:`` names its ``type``)."""
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def message_start(message_id: str, model: str, usage: dict[str, Any]) -> str:
    return event(
        "message_start", {"type": "message_start", "message": message_body(message_id, model, "", (None, None), usage)}
    )


def block_start(index: int = 0) -> str:
    return event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
    )


PING = event("ping", {"type": "ping"})


def text_delta(text: str, index: int = 0) -> str:
    return event(
        "content_block_delta",
        {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
    )


def block_stop(index: int = 0) -> str:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(reason: tuple[str | None, str | None], usage: dict[str, Any]) -> str:
    return event(
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]}, "usage": usage},
    )


MESSAGE_STOP = event("message_stop", {"type": "message_stop"})
