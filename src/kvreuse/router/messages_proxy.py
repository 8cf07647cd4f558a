"""Forward an Anthropic Messages request (``/v1/messages``, ``/v1/messages/count_tokens``) to an executor.

Routed as chat is (``kvreuse.router.proxy``): the body is rendered and hashed as the executor
renders it (``kvreuse.api.anthropic_prompt``), so the KV policy sees the prompt's overlap with
each executor, and its ``prompt_cache_key`` (an extension here) keeps to one executor
(``kvreuse.router.affinity``); a request is retried on another executor while the client has
received nothing (``kvreuse.router.upstream.send``), and a client that leaves first closes the
upstream request. A stream is relayed event by event; one that breaks after its first byte
is not continued on another executor (the OpenAI streams are, ``kvreuse.router.migration``): it
ends with the events received whole and an Anthropic ``error`` event, which the official client
raises. Errors the router answers itself are rewritten into Anthropic's shape by the app's
``AnthropicErrorMiddleware``. A stream that waits for its first byte past
``--stream-keepalive-interval`` starts with keep-alive comments (``kvreuse.router.keepalive``);
what the request answers instead then comes as the ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvreuse.api.anthropic_errors import error_type, stream_error
from kvreuse.api.connection import client_disconnected
from kvreuse.api.limiter import Lease
from kvreuse.router.deadline import Stalled
from kvreuse.router.keepalive import Waiting, kept_alive
from kvreuse.router.prompt_keys import RequestKeys
from kvreuse.router.proxy import first_byte
from kvreuse.router.router import Router
from kvreuse.router.sse import SSE_SEPARATOR, EventSplitter, payload
from kvreuse.router.upstream import EXECUTOR_HEADER, Upstream

logger = logging.getLogger(__name__)

# what an executor needs of the client's headers (x-api-key only when no Authorization replaces it)
_FORWARD_HEADERS = ("content-type", "authorization", "accept", "anthropic-version", "anthropic-beta", "x-api-key")
_MESSAGE_STOP, _ERROR = b"event: message_stop\n", b"event: error\n"
_MESSAGE_DELTA = b"event: message_delta\n"


def messages_keys(router: Router, body: object) -> RequestKeys:
    """The prompt's block keys, as the executor computes them for a body without documents
    (a documents prompt's blocks are keyed per document: it routes by load); no keys for a
    body that does not parse, which the executor then answers."""
    from kvreuse.api.anthropic_prompt import render_messages
    from kvreuse.api.anthropic_protocol import CountTokensRequest
    from kvreuse.api.cache_breakpoints import DEFAULT_POLICY
    from kvreuse.api.errors import APIError

    try:
        prompt = render_messages(router.hasher.tokenizer, CountTokensRequest.model_validate(body), DEFAULT_POLICY)
    except (ValueError, APIError):
        return RequestKeys(0, [])
    if prompt.documents is not None:
        return RequestKeys(len(prompt.token_ids), [])
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    keys = router.hasher.keys(prompt.token_ids, salt if isinstance(salt, str) and salt else None)
    return RequestKeys(len(prompt.token_ids), keys)


def messages_cost(router: Router, body: object, keys: RequestKeys) -> tuple[int, int] | None:
    """``(prompt tokens, completion tokens)`` a Messages request may use at most (its prompt
    and ``max_tokens``), or ``None`` when the executor would not run it (it answers that): a
    bad body, or one no executor's context holds (``Router.fits_context``)."""
    max_tokens = body.get("max_tokens") if isinstance(body, dict) else None
    if keys.num_tokens == 0 or not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return None
    if not router.fits_context(keys.num_tokens, max_tokens):
        return None
    return keys.num_tokens, max_tokens


def _used(usage: object) -> int | None:
    """A Messages ``usage``'s whole: its prompt (input, cache reads and writes) and output."""
    if not isinstance(usage, dict):
        return None
    keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens")
    counts = [usage.get(k) for k in keys]
    return sum(c for c in counts if isinstance(c, int)) if all(isinstance(c, int) for c in counts) else None


class MessagesUsage:
    """Records the usage of one proxied Messages response on a tenant's lease (its tokens per
    minute): a 200's body, or a stream's ``message_delta`` event; a 4xx used nothing."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def response(self, status: int, content: bytes) -> None:
        if status == 200:
            try:
                used = _used(json.loads(content).get("usage"))
            except (ValueError, AttributeError):
                return
            if used is not None:
                self.lease.record(used)
        elif 400 <= status < 500:
            self.lease.record(0)

    def events(self, data: bytes) -> bytes:
        """Whole events, passed on unchanged, having read the ``message_delta``'s usage."""
        for event in data.split(SSE_SEPARATOR):
            if event.startswith(_MESSAGE_DELTA):
                _, _, line = event.partition(b"\ndata: ")
                try:
                    used = _used(json.loads(line).get("usage"))
                except (ValueError, AttributeError):
                    continue
                if used is not None:
                    self.lease.record(used)
        return data


async def forward_messages(
    router: Router,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    *,
    request: Request,
    body: object,
    keys: RequestKeys,
    affinity: str | None = None,
    usage: MessagesUsage | None = None,
) -> Response:
    """The executor's response to ``raw`` at ``path``, or a 503 when none could take it.
    ``usage`` records what it used on the tenant's lease."""
    fwd = {k: v for k, v in headers.items() if k.lower() in _FORWARD_HEADERS}
    if "authorization" in {k.lower() for k in fwd}:
        fwd = {k: v for k, v in fwd.items() if k.lower() != "x-api-key"}
    stream = isinstance(body, dict) and body.get("stream") is True
    gone = asyncio.ensure_future(client_disconnected(request))
    try:
        attempts = first_byte(router, path, raw, fwd, keys, affinity, [], gone, stream=stream)
        if not stream:
            result = await attempts
        else:
            every_s = router.deadlines.keepalive_s
            waiting = Waiting(attempts, every_s, orphan=_close)
            if not await waiting.ready(every_s):  # no first byte yet: start the stream, keep-alives until it comes

                async def then(late: Response | Upstream) -> AsyncGenerator[bytes, None]:
                    if isinstance(late, Upstream):
                        async with aclosing(_relay(router, late, usage)) as events:
                            async for data in events:
                                yield data
                        return
                    if usage is not None:
                        usage.response(late.status_code, bytes(late.body))
                    yield _answer_event(late)  # its 200 is sent: what it answered instead ends it

                return StreamingResponse(
                    kept_alive(waiting, then), status_code=200, headers={"content-type": "text/event-stream"}
                )
            result = waiting.result()
        if not isinstance(result, Upstream):
            if usage is not None:
                usage.response(result.status_code, bytes(result.body))
            return result
        headers_out = {"content-type": result.content_type, EXECUTOR_HEADER: result.executor.url}
        return StreamingResponse(_relay(router, result, usage), status_code=result.status_code, headers=headers_out)
    finally:
        gone.cancel()


def _answer_event(response: Response) -> bytes:
    """``response`` (an error the router or an executor answered, in either API's shape) as
    an Anthropic ``error`` event."""
    answer = payload(b"data: " + bytes(response.body) + SSE_SEPARATOR) or {}
    error = answer.get("error")
    message = (error.get("message") if isinstance(error, dict) else None) or (
        f"the request failed with status {response.status_code}"
    )
    return stream_error(str(message), error_type(response.status_code)).encode()


async def _close(result: Response | Upstream) -> None:
    """A first answer that came when nobody waited for it any more."""
    if isinstance(result, Upstream):
        await result.close()


async def _relay(router: Router, upstream: Upstream, usage: MessagesUsage | None) -> AsyncGenerator[bytes, None]:
    """``upstream``'s whole events, untouched (``usage`` reads them); if it breaks before
    ``message_stop``, an Anthropic ``error`` event after them."""
    splitter = EventSplitter()
    done = False
    try:
        async for chunk in upstream.chunks():
            events = splitter.feed(chunk)
            if events:
                done = done or any(e.startswith((_MESSAGE_STOP, _ERROR)) for e in events)  # the executor ended it
                data = b"".join(events)
                yield data if usage is None else usage.events(data)
        failure = None if done else "it closed the stream before message_stop"
    except httpx.TransportError as exc:
        failure = f"the connection broke ({type(exc).__name__})"
        upstream.executor.mark_down(f"stream broke mid-response: {exc!r}")
    except Stalled as exc:
        failure = str(exc)
    finally:
        await upstream.close()
    if failure is not None:
        logger.warning("messages stream from %s cut mid-response: %s", upstream.executor.url, failure)
        router.metrics.streams_cut.inc()
        yield stream_error(f"the executor failed mid-stream: {failure}; the reply is incomplete").encode()
