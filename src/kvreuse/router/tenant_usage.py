"""A routed request's tokens, for its tenant's tokens per minute (``kvreuse.api.limiter``):
what it may cost before it is sent (``request_cost``), what it used after (``UsageTap``).

``request_cost`` is the executor's own reservation: every prompt's tokens (tokenized as the
executor does, ``PromptHasher``) plus ``n`` times each prompt's ``max_tokens``; without
``max_tokens``, the executors' default (``kvreuse.api.protocol.default_max_tokens``: 16 or
what the context leaves for a completion, what the context and the pool leave for a chat),
the largest any executor would give, since none is chosen yet (``Router.default_max_tokens``).
A request no executor's context holds (``Router.fits_context``) reserves nothing: every
executor answers it with a 400 naming the field, and that is what its client gets, not a 429.

``UsageTap`` reads the ``usage`` the executor answers with into the lease: the JSON body of
a non-streamed response, the usage event of a stream. A stream whose client did not ask for
usage is sent upstream with ``stream_options.include_usage`` (``ask_for_usage``) and the
usage event is taken out of what the client gets, so the client sees the stream it asked
for. A 4xx of the executor (it refused the request before running it: a bad field, an
unknown model) costs nothing, as on the executor; any other response without usage (a 5xx,
a stream cut short) leaves the reservation charged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvreuse.api.limiter import Lease
from kvreuse.router.prompt_keys import PromptHasher, RequestKeys
from kvreuse.router.sse import SSE_SEPARATOR, payload


def request_cost(
    hasher: PromptHasher,
    chat: bool,
    body: dict,
    keys: RequestKeys,
    default_max_tokens: Callable[[bool, int], int],
    fits_context: Callable[[int, int | None], bool],
) -> tuple[int, int] | None:
    """``(prompt tokens, completion tokens)`` the request may use at most, or ``None`` when
    the body is not one the executor would run (it answers that itself, and nothing is
    reserved): a bad body, or a prompt and ``max_tokens`` over the context. ``keys`` are the
    request's (their ``num_tokens`` is the first prompt's); ``default_max_tokens(chat,
    prompt_tokens)`` is ``Router.default_max_tokens``, ``fits_context(prompt_tokens,
    max_tokens)`` ``Router.fits_context``."""
    from kvreuse.api.errors import APIError
    from kvreuse.api.protocol import ChatCompletionRequest, CompletionRequest

    if keys.num_tokens == 0:
        return None
    try:
        if chat:
            req = ChatCompletionRequest.model_validate(body)
            if not fits_context(keys.num_tokens, req.max_tokens):
                return None
            return keys.num_tokens, req.n * (req.max_tokens or default_max_tokens(True, keys.num_tokens))
        creq = CompletionRequest.model_validate(body)
        prompts = creq.prompts()
        lengths = [keys.num_tokens] + [
            len(hasher.tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts[1:]
        ]
    except (ValueError, APIError):
        return None
    if not all(fits_context(n, creq.max_tokens) for n in lengths):
        return None
    completion = sum(creq.n * (creq.max_tokens or default_max_tokens(False, n)) for n in lengths)
    return sum(lengths), completion


def ask_for_usage(body: dict) -> bool:
    """Ask a stream's executor for its usage event when the client did not (``body`` is
    changed); whether the usage event must then be hidden from the client."""
    options = body.get("stream_options")
    if body.get("stream") is not True or not isinstance(options, dict | None):
        return False
    if options and options.get("include_usage") is True:
        return False
    body["stream_options"] = {**(options or {}), "include_usage": True, "continuous_usage_stats": False}
    return True


def _used(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return prompt + completion if isinstance(prompt, int) and isinstance(completion, int) else None


class UsageTap:
    """Records the usage of one proxied response on ``lease``; ``hide_usage``: the router
    asked for the stream's usage event, the client did not."""

    def __init__(self, lease: Lease, hide_usage: bool) -> None:
        self.lease, self.hide_usage = lease, hide_usage

    def response(self, status: int, content: bytes) -> None:
        """A non-streamed response (or a stream refused before it started): a 200's usage;
        nothing used for a 4xx, which the executor answers before running anything."""
        if status == 200:
            self.json_body(content)
        elif 400 <= status < 500:
            self.lease.record(0)

    def json_body(self, content: bytes) -> None:
        """A non-streamed response body."""
        try:
            used = _used(json.loads(content).get("usage"))
        except (ValueError, AttributeError):
            return
        if used is not None:
            self.lease.record(used)

    def events(self, data: bytes) -> bytes:
        """Whole SSE events (``data: ...\\n\\n`` each) -> what the client gets of them. The
        usage is read from the usage chunk (``choices: []``) alone."""
        if b'"usage"' not in data:
            return data
        out = []
        for event in data.split(SSE_SEPARATOR)[:-1]:
            event += SSE_SEPARATOR
            chunk = payload(event) if b'"usage"' in event else None
            # only the usage chunk counts the whole reply: a chunk's own usage
            # (continuous_usage_stats) is one choice's so far
            used = _used(chunk.get("usage")) if chunk is not None and chunk.get("choices") == [] else None
            if used is not None:
                self.lease.record(used)
                if self.hide_usage:
                    continue
            out.append(event)
        return b"".join(out)
