"""A streamed completions or chat request, as the router needs it to continue the stream
on another executor (``kvreuse.router.migration``).

The body is validated with the executor's own models (``kvreuse.api.protocol``), so ``n``,
``max_tokens``, the stop conditions and the stream options read exactly as the executor
reads them.

Upstream, the router asks for what a continuation needs (``upstream_body``): vLLM's
``return_token_ids`` (the prompt's ids, and the ids behind each chunk's text) and usage on
every chunk (the first executor's cached tokens); ``StreamLedger`` strips from each event
what the client did not ask for.

A continuation (``continuation_body``) is a streamed ``/v1/completions`` request whose
prompt is the original prompt's ids followed by the ids the client has, with ``max_tokens``
less those ids and the same sampling settings. Stop strings are not sent: the router
applies them over the whole output, as the first executor would have (``StreamLedger``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvreuse.api.errors import APIError
from kvreuse.api.protocol import ChatCompletionRequest, CompletionRequest, default_max_tokens
from kvreuse.router.executors import ExecutorInfo
from kvreuse.sampling_params import SamplingParams

# what the router asks every executor for on a stream it may have to continue
_UPSTREAM_EXTRAS = {"return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@dataclass(frozen=True)
class StreamRequest:
    chat: bool
    body: dict[str, Any]  # as the client sent it (with its tenant's salt)
    parsed: CompletionRequest | ChatCompletionRequest | None  # None: it does not validate (the executor says why)
    num_prompts: int  # completions: prompts in the body (each gets its own choices)

    @classmethod
    def of(cls, chat: bool, body: Any) -> StreamRequest | None:
        """The request of a body with ``stream: true``; ``None`` for any other body."""
        if not isinstance(body, dict) or body.get("stream") is not True:
            return None
        try:
            parsed = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
            prompts = 1 if chat else len(parsed.prompts())  # type: ignore[union-attr]  # not chat: a CompletionRequest
            parsed.num_logprobs()  # checks what validation leaves to it (top_logprobs without logprobs)
        except (ValidationError, ValueError, APIError):
            return cls(chat, body, None, 0)
        return cls(chat, body, parsed, prompts)

    # ------------------------------------------------------------------ what the client asked
    @property
    def wants_token_ids(self) -> bool:
        return self.parsed is not None and self.parsed.return_token_ids

    @property
    def include_usage(self) -> bool:
        return self.parsed is not None and self.parsed.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.parsed.stream_options.continuous_usage_stats  # type: ignore[union-attr]  # include_usage implies stream_options

    def unsupported(self) -> str | None:
        """Why a stream of this request cannot be continued from its tokens, or ``None``."""
        p = self.parsed
        if p is None:
            return "its body does not validate"
        if p.n != 1:
            return f"it asks for n = {p.n} choices (only n = 1 is continued)"
        if self.num_prompts != 1:
            return f"it holds {self.num_prompts} prompts (only one is continued)"
        if p.num_logprobs() is not None:
            return "it asks for logprobs (not continued)"
        if isinstance(p, CompletionRequest) and p.echo:
            return "it asks for echo (not continued)"
        return None

    # ------------------------------------------------------------------ bodies
    def upstream_body(self) -> bytes:
        """The body sent to the executors: the client's, with ``_UPSTREAM_EXTRAS``."""
        return json.dumps({**self.body, **_UPSTREAM_EXTRAS}).encode()

    def max_tokens(self, prompt_tokens: int, info: ExecutorInfo) -> int:
        """The reply's whole budget: the body's ``max_tokens``, else the default the first
        executor (``info``) gave a prompt of ``prompt_tokens``."""
        assert self.parsed is not None
        if self.parsed.max_tokens is not None:
            return self.parsed.max_tokens
        return default_max_tokens(self.chat, prompt_tokens, info.max_model_len, info.pool_tokens)

    def stop_params(self, max_tokens: int) -> SamplingParams:
        """The stop conditions of the whole reply (what ``check_stop`` reads)."""
        assert self.parsed is not None
        return self.parsed.sampling_params(max_tokens)

    def continuation_body(self, prompt_ids: list[int], output_ids: list[int], max_tokens: int) -> bytes:
        """A streamed ``/v1/completions`` body continuing after ``output_ids``; ``max_tokens``
        is the whole reply's (``max_tokens()``)."""
        p = self.parsed
        assert p is not None
        body: dict[str, Any] = {
            "prompt": [*prompt_ids, *output_ids],
            "max_tokens": max_tokens - len(output_ids),
            "stream": True,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "ignore_eos": p.ignore_eos,
            **_UPSTREAM_EXTRAS,
        }
        for name in ("model", "seed", "stop_token_ids", "cache_salt", "kv_cache_retention_config", "user"):
            value = getattr(p, name)
            if value is not None:
                body[name] = value
        return json.dumps(body).encode()
