"""What completions and chat share: checks before the engine, running requests, SSE framing.

Every function takes the app's ``ServerContext`` (``kvreuse.server.context``) explicitly.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvreuse.api.connection import client_disconnected
from kvreuse.api.errors import APIError
from kvreuse.api.middleware import lease_of
from kvreuse.api.protocol import default_max_tokens
from kvreuse.cache.retention import FIELD as RETENTION_FIELD, KvCacheRetentionConfig
from kvreuse.engine.blend import BlendOverride
from kvreuse.sampling_params import SamplingParams
from kvreuse.server.context import ServerContext
from kvreuse.server.errors import ClientDisconnected, from_value_error

if TYPE_CHECKING:
    from kvreuse.api.limiter import Lease
    from kvreuse.engine.document_cache import DocumentPrompt
    from kvreuse.engine.llm_engine import RequestOutput
    from kvreuse.pml.prepared import PreparedPrompt


def check_model(ctx: ServerContext, name: str | None) -> str:
    """The served name to report. Raises a 404 ``model_not_found`` naming ``model``."""
    if name is None or name in ctx.served_model_names:
        return ctx.served_model_names[0]
    raise APIError(
        f"model: the model `{name}` does not exist; this server serves {', '.join(ctx.served_model_names)}",
        status=404,
        param="model",
        code="model_not_found",
    )


def check_prompt(ctx: ServerContext, token_ids: Sequence[int], max_tokens: int | None, *, param: str) -> None:
    """Raise a 400 naming ``param`` if the prompt is empty, holds ids outside the
    vocabulary, or cannot fit the context."""
    if not token_ids:
        raise APIError(f"{param}: the prompt is empty", param=param)
    vocab = ctx.engine.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)
    check_prompt_length(ctx, len(token_ids), max_tokens, param=param)


def check_prompt_length(ctx: ServerContext, n: int, max_tokens: int | None, *, param: str) -> None:
    """Raise a 400 if a prompt of context length ``n`` (for PML: where decoding starts) is
    over ``--max-prompt-tokens`` or leaves no room in the context."""
    if n > ctx.prompt_limit or n >= ctx.engine.max_model_len:
        raise APIError(
            f"{param}: the prompt is {n} tokens, but this model's context is {ctx.engine.max_model_len} tokens "
            f"(prompt limit {ctx.prompt_limit}); shorten it",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and n + max_tokens > ctx.engine.max_model_len:
        raise APIError(
            f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
            f"{ctx.engine.max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


def reply_room(ctx: ServerContext, n: int, *, param: str) -> int:
    """The longest reply a prompt of ``n`` tokens leaves room for: up to the context and what
    the KV pool holds (the last sampled token needs no slot), the default ``max_tokens`` of
    chat. Raises a 400 naming ``param`` when the pool cannot hold the prompt itself."""
    room = default_max_tokens(True, n, ctx.engine.max_model_len, ctx.engine.pool_tokens)
    if room < 1:
        raise APIError(
            f"{param}: the prompt is {n} tokens but the KV pool holds {ctx.engine.pool_tokens}: shorten it or "
            "raise --kv-cache-memory",
            param=param,
            code="context_length_exceeded",
        )
    return room


def document_reply_room(ctx: ServerContext, room: int, documents, blend: BlendOverride | None, *, param: str) -> int:
    """``room`` (a prompt's longest reply) cut to what the KV pool leaves once a documents
    prompt's context holds its blocks (``engine.document_context_blocks``: the documents' own
    blocks and blend's private ones, as the engine's capacity check counts them; the own
    tokens start a block of their own). Raises a 400 naming ``param`` when nothing is left."""
    bs = ctx.engine.block_size
    context_blocks = ctx.engine.document_context_blocks(documents, blend)
    own = len(documents.layout().token_ids)
    room = min(room, (ctx.engine.pool_tokens // bs - context_blocks) * bs - own + 1)
    if room < 1:
        raise APIError(
            f"{param}: the documents and the prompt do not fit in the KV pool "
            f"({ctx.engine.pool_tokens} tokens): shorten them or raise --kv-cache-memory",
            param=param,
            code="context_length_exceeded",
        )
    return room


def parse_retention(raw: dict[str, Any] | None) -> KvCacheRetentionConfig | None:
    """Validate ``kv_cache_retention_config``; a 400 names the field path."""
    if raw is None:
        return None
    try:
        return KvCacheRetentionConfig.from_dict(raw)
    except ValueError as exc:
        raise APIError(str(exc), param=RETENTION_FIELD) from None


def parse_blend(raw: Any) -> BlendOverride | None:
    """A request's ``blend``, parsed once, here: the value carried to the engine, which fills
    what it omits from ``--blend-*`` (PML modules) or ``--document-blend-*`` (documents). A
    400 names the field."""
    try:
        return BlendOverride.of(raw)
    except ValueError as exc:
        raise APIError(str(exc), param="blend") from None


def sampling_params(body: Any, default_max_tokens: int, *, seed_offset: int = 0) -> SamplingParams:
    """``body.sampling_params(...)`` with its ``ValueError`` turned into a 400."""
    try:
        return body.sampling_params(default_max_tokens, seed_offset=seed_offset)
    except ValueError as exc:
        raise from_value_error(exc) from None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class EngineRequest:
    """One engine request behind a response choice."""

    index: int  # the choice index
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    cache_salt: str | None
    retention: KvCacheRetentionConfig | None  # converted from the body's JSON by parse_retention
    prepared: PreparedPrompt | DocumentPrompt | None = None  # a PML prompt, compiled once (docs/pml.md), or documents
    blend: BlendOverride | None = None  # of the prepared prompt (parse_blend); None: the server's default


class TokenMeter:
    """What a response's usage says so far (each prompt's tokens once, plus every choice's
    output tokens), written to the tenant's lease as outputs arrive: a request cut short
    (its client left, the engine failed) is charged what it used, not what it reserved."""

    def __init__(self, lease: Lease, n: int) -> None:
        self._lease, self._n = lease, n  # choice index // n: the prompt it belongs to
        self._prompts: dict[int, int] = {}
        self._outputs: dict[int, int] = {}
        self._total = 0
        lease.record(0)  # nothing used until an output says so

    def observe(self, index: int, output: RequestOutput) -> None:
        prompt, outputs = index // self._n, len(output.output_token_ids)
        self._total += output.num_prompt_tokens - self._prompts.get(prompt, 0) + outputs - self._outputs.get(index, 0)
        self._prompts[prompt], self._outputs[index] = output.num_prompt_tokens, outputs
        self._lease.record(self._total)


def reserve_tokens(
    http_request: Request, requests: Sequence[EngineRequest], prompt_lengths: Sequence[int], n: int
) -> TokenMeter | None:
    """Reserve what the request may use at most (every prompt's tokens + every choice's
    ``max_tokens``) from its tenant's tokens per minute, and return the meter that corrects
    the charge to what it uses. Raises ``LimitExceeded`` (a 429) when the tenant cannot
    have it; ``None`` when the app has no tenant limits."""
    lease = lease_of(http_request.scope)
    if lease is None:
        return None
    lease.reserve(sum(prompt_lengths), sum(r.params.max_tokens for r in requests))
    return TokenMeter(lease, n)


async def _tracked(
    ctx: ServerContext, req: EngineRequest, meter: TokenMeter | None
) -> AsyncGenerator[RequestOutput, None]:
    tracker = ctx.metrics.track()
    async for output in ctx.engine.generate(
        req.prompt_token_ids,
        req.params,
        request_id=req.request_id,
        cache_salt=req.cache_salt,
        retention=req.retention,
        prepared=req.prepared,
        blend=req.blend,
    ):
        tracker.observe(output)
        if meter is not None:
            meter.observe(req.index, output)
        yield output


async def run_to_completion(
    ctx: ServerContext,
    requests: Sequence[EngineRequest],
    http_request: Request | None = None,
    meter: TokenMeter | None = None,
) -> list[RequestOutput]:
    """The final output of each request, run concurrently. Raises ``ValueError`` /
    ``EngineError`` of the first that fails (the others are cancelled and aborted), and
    ``ClientDisconnected`` when ``http_request``'s client leaves first: every request is
    then aborted and its blocks freed, as for a stream (vLLM's ``with_cancellation``).
    ``meter`` (``reserve_tokens``) sees every output."""

    async def last(req: EngineRequest) -> RequestOutput:
        final = None
        async for output in _tracked(ctx, req, meter):
            final = output
        assert final is not None and final.finished
        return final

    tasks = [asyncio.ensure_future(last(r)) for r in requests]
    everything = asyncio.gather(*tasks)
    watcher = asyncio.ensure_future(client_disconnected(http_request)) if http_request is not None else None
    try:
        if watcher is not None:
            either: set[asyncio.Future[Any]] = {everything, watcher}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not everything.done():
                raise ClientDisconnected()
        return list(await everything)
    finally:
        for task in tasks:
            task.cancel()
        if watcher is not None:
            watcher.cancel()
        # Read what the cancelled tasks end with, so asyncio logs no "never retrieved".
        await asyncio.gather(*tasks, return_exceptions=True)
        if not everything.done():
            everything.cancel()
        everything.add_done_callback(lambda f: f.cancelled() or f.exception())


@dataclass
class ChoiceStreams:
    """Outputs of several requests as ``(choice index, output)`` in arrival order.
    ``aclose()`` aborts whatever is unfinished; call it in a ``finally``."""

    outputs: AsyncGenerator[tuple[int, RequestOutput], None]
    _gens: list[AsyncGenerator[RequestOutput, None]]

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self.outputs

    async def aclose(self) -> None:
        await self.outputs.aclose()
        for gen in self._gens:  # covers a stream closed before it was ever iterated
            await gen.aclose()


async def start_streams(
    ctx: ServerContext, requests: Sequence[EngineRequest], meter: TokenMeter | None = None
) -> ChoiceStreams:
    """Admit every request and wait for its first output *before* the response starts, so
    a rejected request is still a plain 4xx (raises ``ValueError`` / ``EngineError``).
    ``meter`` (``reserve_tokens``) sees every output."""
    gens = [_tracked(ctx, r, meter) for r in requests]
    firsts = [asyncio.ensure_future(anext(g)) for g in gens]
    try:
        first_outputs = await asyncio.gather(*firsts)
    except BaseException:
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for g in gens:
            await g.aclose()
        raise
    return ChoiceStreams(_merge(requests, gens, first_outputs), gens)


async def _merge(requests, gens, first_outputs) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, gen: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        try:
            await queue.put((index, first))
            if not first.finished:
                async for output in gen:
                    await queue.put((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(r.index, g, f)) for r, g, f in zip(requests, gens, first_outputs)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
