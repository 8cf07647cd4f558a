"""What the client of one stream has been sent, and the events it gets.

``relay`` passes the events of the executor serving the client's own request, recording
the prompt's ids, the ids behind the text sent, the text, the finish reason and the first
executor's usage details, and strips from each event what the router asked for and the
client did not (``token_ids``/``prompt_token_ids``, per-chunk ``usage``, the usage chunk).
After it the ledger holds a state the executor itself was in: the ids of every chunk sent
and exactly their text (ids sampled after the last chunk, whose text was held back, are
not sent and not counted; the next executor samples them again).

``translate`` turns the events of a continuation (a ``/v1/completions`` stream from
another executor, ``kvreuse.router.stream_request``) into the client's format: chat chunks
for chat, completion chunks for completions, under the first executor's id, created and
model. Their text is not the continuation's: the router decodes the whole reply's ids with
the engine's own ``check_stop`` (the executors' tokenizer, their EOS ids, the client's stop
strings and ``max_tokens``), so the text is the text the first executor would have sent,
also where a character's bytes or a stop string straddle the point of failure. It ends
the stream itself (usage, ``[DONE]``) when the reply is finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.engine.stop_checker import check_stop
from kvreuse.router.sse import SSE_DONE, encode, payload
from kvreuse.router.stream_request import StreamRequest
from kvreuse.sampling_params import SamplingParams

_TOKEN_FIELDS = ("token_ids", "prompt_token_ids")


@dataclass
class _Replay:
    """The fields of an engine ``Sequence`` that ``check_stop`` reads and writes."""

    params: SamplingParams
    output_token_ids: list[int]
    text: str


class StreamLedger:
    def __init__(self, request: StreamRequest) -> None:
        self.request = request
        self.header: dict[str, Any] | None = None  # the first chunk's id, object, created, model
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []  # behind the text sent (and, continuing, ids whose text is held back)
        self.text = ""
        self.finish_reason: str | None = None
        self.details: dict[str, Any] | None = None  # the first executor's usage.prompt_tokens_details
        self.sent = 0  # data events sent to the client
        self.several_choices = False
        self.failed = False  # an executor's own error event was sent: the stream has ended
        self.done = False  # [DONE] was sent
        self.usage_sent = False  # the usage chunk was sent (an executor died before its [DONE] only)
        self._replay: _Replay | None = None
        self._tokenizer: Any = None
        self._eos: frozenset[int] = frozenset()
        self._unsent_ids: list[int] = []  # continuing, for a client that asked for token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def continuing(self) -> bool:
        return self._replay is not None

    # ------------------------------------------------------------------ the client's own request
    def relay(self, event: bytes) -> bytes | None:
        """The client's copy of ``event`` (``None``: nothing to send)."""
        body = payload(event)
        if body is None:
            self.done = self.done or event == SSE_DONE
            return event
        if "error" in body:
            self.failed = True
            return self._sent(event)
        keep_ids = self.request.wants_token_ids
        usage = body.pop("usage", None)
        if isinstance(usage, dict) and self.details is None:
            self.details = usage.get("prompt_tokens_details")
        if "prompt_token_ids" in body:  # chat: on the first chunk
            self.prompt_ids = body["prompt_token_ids"] if keep_ids else body.pop("prompt_token_ids")
        choices = body.get("choices") or []
        if self.header is None:
            self.header = {k: v for k, v in body.items() if k not in ("choices", "prompt_token_ids")}
        for choice in choices:
            if choice.get("index", 0) != 0:
                self.several_choices = True
                continue
            if "prompt_token_ids" in choice:  # completions: on the choice's first chunk
                self.prompt_ids = choice["prompt_token_ids"]
            self.output_ids.extend(choice.get("token_ids") or ())
            self.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if not keep_ids:
            for choice in choices:
                for name in _TOKEN_FIELDS:
                    choice.pop(name, None)
        if not choices:  # the usage chunk
            if not self.request.include_usage:
                return None
            body["usage"] = usage
            self.usage_sent = True
        elif self.request.continuous_usage and usage is not None:
            body["usage"] = usage
        return self._sent(encode(body))

    # ------------------------------------------------------------------ a continuation
    def continue_with(self, params: SamplingParams, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        """Read continuation events from now on; ``params`` hold the whole reply's stop
        conditions (``StreamRequest.stop_params``)."""
        self._replay = _Replay(params, self.output_ids, self.text)
        self._tokenizer, self._eos = tokenizer, eos_token_ids

    def translate(self, event: bytes) -> bytes | None:
        """The client's events for a continuation's ``event`` (``None``: nothing yet)."""
        assert self._replay is not None, "continue_with first"
        body = payload(event)
        if body is None:
            if event != SSE_DONE or self.done:
                return None
            if self.failed:  # after its own error event
                self.done = True
                return event
            return self.end()  # ended without a finish reason: say what we have
        if "error" in body:
            self.failed = True
            return self._sent(event)
        usage = body.get("usage")
        if self.details is None and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens_details"), dict):
            # no chunk of the first executor said (a chat's role chunk carries no usage): this
            # executor's count, of the original prompt's tokens only
            details = dict(usage["prompt_tokens_details"])
            details["cached_tokens"] = min(int(details.get("cached_tokens") or 0), len(self.prompt_ids or ()))
            self.details = details
        choices = body.get("choices") or []
        if not choices:
            return None  # its usage counts its own prompt: the client's comes from end()
        choice = choices[0]
        text, reason = "", None
        for token in choice.get("token_ids") or ():
            self._replay.output_token_ids.append(token)
            self._unsent_ids.append(token)
            piece, reason = check_stop(self._replay, self._tokenizer, self._eos)
            text += piece
            if reason is not None:
                break  # what follows a stop is never sent
        self.text = self._replay.text
        reason = reason or choice.get("finish_reason")  # a reason the replay cannot see (e.g. an abort)
        if not text and reason is None:
            return None
        out = self._sent(encode(self._chunk(text, reason)))
        if reason is None:
            return out
        self.finish_reason = reason
        return out + self.end()

    def _chunk(self, text: str, reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=reason)
        if self.request.wants_token_ids:
            choice["token_ids"], self._unsent_ids = self._unsent_ids, []
        chunk = {**(self.header or {}), "choices": [choice]}
        if self.request.continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    # ------------------------------------------------------------------ the end
    def end(self) -> bytes:
        """The events that end a finished reply: the usage chunk (when asked for and not sent
        yet), ``[DONE]``."""
        out = b""
        if self.request.include_usage and not self.usage_sent:
            out += self._sent(encode({**(self.header or {}), "choices": [], "usage": self.usage()}))
        self.done = True
        return out + SSE_DONE

    def usage(self) -> dict[str, Any]:
        """The reply's usage: the original prompt (its cached tokens as the first executor
        counted them, else as the continuation's did, up to the prompt's length) and every
        output token."""
        prompt = len(self.prompt_ids or ())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.output_ids),
            "total_tokens": prompt + len(self.output_ids),
            "prompt_tokens_details": self.details or {"cached_tokens": 0},
        }

    def _sent(self, event: bytes) -> bytes:
        self.sent += 1
        return event
