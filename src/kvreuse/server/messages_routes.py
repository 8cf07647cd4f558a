"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API.

The request is rendered through the model's chat template (``kvreuse.api.anthropic_prompt``);
its ``cache_control`` breakpoints become the request's token-range retention and decide how
usage is counted (``kvreuse.api.cache_breakpoints``); ``document`` blocks are kvreuse documents,
reused at any position. Errors are in Anthropic's shape (``kvreuse.api.anthropic_errors``, the
app's outermost middleware), and so are a stream's ``error`` events.

A stream is Anthropic's event sequence::

    message_start (usage: the prompt's counts) -> content_block_start -> ping
    -> content_block_delta (text_delta)* -> content_block_stop
    -> message_delta (stop_reason, stop_sequence, usage) -> message_stop

The engine is reached through ``AsyncEngine.generate`` (``kvreuse.server.serving``) only.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvreuse.api.anthropic_errors import stream_error
from kvreuse.api.anthropic_prompt import MessagesPrompt, render_messages
from kvreuse.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvreuse.api.errors import APIError
from kvreuse.api.tenants import tenant_of, tenant_salt
from kvreuse.engine.async_engine import EngineError
from kvreuse.engine.outputs import RequestOutput
from kvreuse.sampling_params import SamplingParams
from kvreuse.server import messages_format as fmt
from kvreuse.server.context import ServerContext, context_of
from kvreuse.server.errors import from_value_error
from kvreuse.server.messages_tools import ToolStream, split_tool_calls
from kvreuse.server.serving import (
    ChoiceStreams,
    EngineRequest,
    check_model,
    check_prompt,
    document_reply_room,
    reply_room,
    reserve_tokens,
    run_to_completion,
    start_streams,
)

router = APIRouter()


async def _prompt(ctx: ServerContext, body: CountTokensRequest) -> MessagesPrompt:
    # Rendering and tokenizing a long conversation takes milliseconds: off the event loop.
    return await run_in_threadpool(render_messages, ctx.engine.tokenizer, body, ctx.cache_policy)


def _sampling(body: MessagesRequest) -> SamplingParams:
    try:
        return body.sampling_params()
    except ValueError as exc:  # SamplingParams names OpenAI's field: "stop" is stop_sequences here
        err = from_value_error(exc)
        if str(exc).startswith("stop_sequences"):
            raise APIError(str(exc), param="stop_sequences") from None
        if err.param == "stop":
            raise APIError(f"stop_sequences: {exc}", param="stop_sequences") from None
        raise err from None


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    """Raises 400 (a bad field, blocks or ``cache_control``; a prompt too long), 404 (an unknown
    model), 429 (a tenant limit); 500 on engine failure. All in Anthropic's error shape."""
    ctx = context_of(request)
    model = check_model(ctx, body.model)
    prompt = await _prompt(ctx, body)
    check_prompt(ctx, prompt.token_ids, body.max_tokens, param="messages")
    room = reply_room(ctx, len(prompt.token_ids), param="messages")  # 400 when the pool cannot hold the prompt
    if prompt.documents is not None:
        document_reply_room(ctx, room, prompt.documents, None, param="messages")
    message_id = f"msg_{uuid.uuid4().hex}"
    salt = tenant_salt(tenant_of(request.scope), body.cache_salt)  # a tenant key's blocks are the tenant's
    engine_request = EngineRequest(
        0, prompt.token_ids, _sampling(body), message_id, salt, prompt.plan.retention(), prompt.documents
    )
    meter = reserve_tokens(request, [engine_request], [len(prompt.token_ids)], 1)  # 429: tenant's tokens spent
    stops = engine_request.params.stop
    if body.stream:
        streams = await start_streams(ctx, [engine_request], meter)
        return StreamingResponse(
            _stream(ctx, streams, prompt, message_id, model, stops, bool(body.tools)), media_type="text/event-stream"
        )
    (final,) = await run_to_completion(ctx, [engine_request], request, meter)
    _observe(ctx, prompt, final)
    usage = fmt.usage_body(prompt.plan, final, ctx.engine.block_size)
    reason = fmt.stop_reason(final, ctx.engine.tokenizer, stops)
    text, calls = split_tool_calls(final.text) if body.tools and reason[0] == "end_turn" else (final.text, [])
    if calls:  # the model called tools (messages_tools): tool_use blocks after its text
        reason = ("tool_use", None)
    return JSONResponse(fmt.message_body(message_id, model, text, reason, usage, [c.block() for c in calls]))


def _observe(ctx: ServerContext, prompt: MessagesPrompt, final: RequestOutput) -> None:
    """The finished request's breakpoints and usage on ``/metrics``."""
    counts = prompt.plan.usage(final.num_prompt_tokens, final.num_cached_tokens, ctx.engine.block_size)
    ctx.metrics.observe_cache_control(
        prompt.plan.tokens_by_class(),
        counts.cache_read_input_tokens,
        counts.cache_creation_input_tokens,
        counts.input_tokens,
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """``{"input_tokens": n}``: the rendered prompt's tokens (what a message's usage adds up
    to). The same 400s as ``/v1/messages`` for the same request."""
    ctx = context_of(request)
    check_model(ctx, body.model)
    prompt = await _prompt(ctx, body)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


async def _stream(
    ctx: ServerContext,
    streams: ChoiceStreams,
    prompt: MessagesPrompt,
    message_id: str,
    model: str,
    stops: tuple[str, ...],
    tools: bool = False,
) -> AsyncIterator[str]:
    """``tools``: the request had tools, so the reply's tool calls become ``tool_use`` blocks."""
    tokenizer, block_size = ctx.engine.tokenizer, ctx.engine.block_size
    started = False
    calls = ToolStream() if tools else None
    try:
        async for _, out in streams:
            if not started:  # the first output (admitted, prefilled) knows the prompt's cache counts
                yield fmt.message_start(message_id, model, fmt.usage_body(prompt.plan, out, block_size))
                yield fmt.block_start()
                yield fmt.PING
                started = True
            if out.new_text:
                for event in [fmt.text_delta(out.new_text)] if calls is None else calls.feed(out.new_text):
                    yield event
            if out.finished:
                _observe(ctx, prompt, out)
                reason = fmt.stop_reason(out, tokenizer, stops)
                if calls is None:
                    yield fmt.block_stop()
                else:
                    for event in calls.finish(reason[0] == "end_turn"):
                        yield event
                    reason = ("tool_use", None) if calls.calls else reason
                yield fmt.message_delta(reason, fmt.usage_body(prompt.plan, out, block_size))
                yield fmt.MESSAGE_STOP
    except ValueError as exc:
        yield stream_error(str(exc), "invalid_request_error")
    except EngineError as exc:
        yield stream_error(str(exc), "api_error")
    finally:
        await streams.aclose()
