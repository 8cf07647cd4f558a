"""``POST /v1/chat/completions``: the chat template, per-message retention, ``n`` choices.

A message marked ``"kvreuse": {"document": true}`` is a reusable document: its KV (template
glue included) is computed once and reused wherever it appears (``engine/document_cache.py``).

A PML prompt goes in as the content of a single user message starting with ``<prompt``
(its own role tags render the chat template; docs/pml.md).

``logprobs: true`` (with ``top_logprobs: k``) adds each choice's token logprobs (shape in
``logprobs_format.py``); ``top_logprobs`` without ``logprobs`` is a 400.

``return_token_ids: true`` (vLLM's extension, same field names) adds the rendered prompt's
ids as a top-level ``prompt_token_ids`` (``null`` for a PML prompt) and each choice's
generated ids as its ``token_ids``. Streamed, ``prompt_token_ids`` is on the first chunk (the
first role chunk) and each chunk's ``token_ids`` are the ids sampled since the choice's
previous chunk (completions_routes.py says why).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvreuse.api.chat_prompt import merge_retention, render_chat
from kvreuse.api.errors import APIError, error_body
from kvreuse.api.protocol import ChatCompletionRequest, now_s, usage_dict
from kvreuse.api.tenants import tenant_of, tenant_salt
from kvreuse.cache.retention import KvCacheRetentionConfig
from kvreuse.engine.async_engine import EngineError
from kvreuse.engine.blend import BlendOverride
from kvreuse.engine.logprobs import TokenLogprobs
from kvreuse.pml import PMLError
from kvreuse.pml.module_cache import is_pml_prompt
from kvreuse.server.context import ServerContext, context_of
from kvreuse.server.errors import from_value_error
from kvreuse.server.logprobs_format import ChatLogprobs
from kvreuse.server.serving import (
    SSE_DONE,
    EngineRequest,
    check_model,
    check_prompt,
    check_prompt_length,
    document_reply_room,
    new_request_id,
    parse_blend,
    parse_retention,
    reply_room,
    reserve_tokens,
    run_to_completion,
    sampling_params,
    sse,
    start_streams,
)

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """Raises 400 (bad field or messages, prompt too long), 404 (unknown model), 429 (a
    tenant limit, ``kvreuse.api.limiter``); 500 on engine failure. Without ``max_tokens`` the
    reply may fill the context (vLLM's default), or the KV pool where that is smaller
    (``reply_room``)."""
    ctx = context_of(request)
    model = check_model(ctx, body.model)
    salt = tenant_salt(tenant_of(request.scope), body.cache_salt)  # a tenant key's blocks are the tenant's
    request_retention = parse_retention(body.kv_cache_retention_config)
    blend = parse_blend(body.blend)  # parsed once, for every prompt; PML modules and documents have seams to blend
    pml = pml_message(body.messages)
    if pml is not None:  # a PML prompt: its role tags render the chat template (docs/pml.md)
        return await _create_pml(ctx, body, model, pml, request_retention, blend, request)
    # Rendering and tokenizing a long conversation takes milliseconds: off the event loop.
    prompt = await run_in_threadpool(
        render_chat,
        ctx.engine.tokenizer,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs,
    )
    retention = merge_retention(prompt.retention, request_retention)
    check_prompt(ctx, prompt.token_ids, body.max_tokens, param="messages")
    default_max = reply_room(ctx, len(prompt.token_ids), param="messages")
    if prompt.documents is not None:
        default_max = document_reply_room(ctx, default_max, prompt.documents, blend, param="messages")
    base_id = body.request_id or new_request_id("chatcmpl")
    requests = [
        EngineRequest(
            j,
            prompt.token_ids,
            sampling_params(body, default_max, seed_offset=j),
            f"{base_id}-{j}",
            salt,
            retention,
            prompt.documents,
            blend=blend,
        )  # documents: KV reused at any position
        for j in range(body.n)
    ]
    header = {"id": base_id, "created": now_s(), "model": model}
    meter = reserve_tokens(request, requests, [len(prompt.token_ids)], body.n)  # 429: tenant's tokens spent
    if body.stream:
        streams = await start_streams(ctx, requests, meter)
        return StreamingResponse(
            _stream(body, header, streams, ctx.engine.tokenizer, prompt.token_ids), media_type="text/event-stream"
        )
    finals = await run_to_completion(ctx, requests, request, meter)
    choices = _choices(finals, ctx.engine.tokenizer, body.return_token_ids)
    first = finals[0]
    usage = usage_dict(
        first.num_prompt_tokens, sum(len(o.output_token_ids) for o in finals), first.num_cached_tokens, [first], finals
    )
    response = {**header, "object": "chat.completion", "choices": choices, "usage": usage}
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt.token_ids
    return JSONResponse(response)


def pml_message(messages) -> str | None:
    """The PML prompt when the conversation is one user message whose content starts with
    ``<prompt``; otherwise ``None`` (an ordinary chat)."""
    if len(messages) != 1 or messages[0].role != "user" or not isinstance(messages[0].content, str):
        return None
    return messages[0].content if is_pml_prompt(messages[0].content) else None


async def _create_pml(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    model: str,
    pml: str,
    retention: KvCacheRetentionConfig | None,
    blend: BlendOverride | None,
    request: Request,
):
    # Compiled once, on the engine thread (where the schemas live); the choices share it.
    try:
        prepared = await ctx.engine.prepare_pml(pml)
    except PMLError as exc:
        raise APIError(str(exc), param="messages") from None
    # the module blocks take pool room too (the prepared plan pins its schema version)
    module_tokens = await ctx.engine.module_blocks(prepared) * ctx.engine.block_size
    end = prepared.next_position  # as for plain chat, the reply may fill the context
    check_prompt_length(ctx, end, body.max_tokens, param="messages")
    # what the context and the pool leave: the new tokens go in blocks of their own, after the modules'
    default_max = min(
        ctx.engine.max_model_len - end, reply_room(ctx, len(prepared.token_ids) + module_tokens, param="messages")
    )
    salt = tenant_salt(tenant_of(request.scope), body.cache_salt)
    base_id = body.request_id or new_request_id("chatcmpl")
    requests = [
        EngineRequest(
            j,
            [],
            sampling_params(body, default_max, seed_offset=j),
            f"{base_id}-{j}",
            salt,
            retention,
            prepared,
            blend=blend,
        )
        for j in range(body.n)
    ]
    header = {"id": base_id, "created": now_s(), "model": model}
    meter = reserve_tokens(request, requests, [end], body.n)  # 429: tenant's tokens spent
    if body.stream:  # a PML prompt has no flat token prompt: prompt_token_ids is null
        streams = await start_streams(ctx, requests, meter)
        return StreamingResponse(
            _stream(body, header, streams, ctx.engine.tokenizer, None), media_type="text/event-stream"
        )
    finals = await run_to_completion(ctx, requests, request, meter)
    response = {
        **header,
        "object": "chat.completion",
        "choices": _choices(finals, ctx.engine.tokenizer, body.return_token_ids),
        "usage": usage_dict(
            finals[0].num_prompt_tokens,
            sum(len(o.output_token_ids) for o in finals),
            finals[0].num_cached_tokens,
            finals[:1],
            finals,
        ),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = None
    return JSONResponse(response)


def _choices(finals, tokenizer, token_ids: bool) -> list[dict[str, Any]]:
    choices = [
        {
            "index": j,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None if out.logprobs is None else ChatLogprobs(tokenizer).build(out.logprobs),
            "finish_reason": out.finish_reason,
        }
        for j, out in enumerate(finals)
    ]
    if token_ids:
        for choice, out in zip(choices, finals):
            choice["token_ids"] = list(out.output_token_ids)
    return choices


def _chunk(
    header: dict[str, Any],
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        **header,
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


async def _stream(
    body: ChatCompletionRequest, header: dict[str, Any], streams, tokenizer, prompt_ids: list[int] | None
) -> AsyncIterator[str]:
    last: dict[int, Any] = {}
    continuous = body.include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]  # include_usage implies stream_options
    logprobs = ChatLogprobs(tokenizer)
    pending: dict[int, list[TokenLogprobs]] = {}  # tokens whose text has not been sent yet
    pending_ids: dict[int, list[int]] = {}  # return_token_ids: ids sampled since the choice's last chunk
    try:
        for j in range(body.n):  # OpenAI opens every choice with the role
            opening = _chunk(header, j, {"role": "assistant", "content": ""}, None)
            if body.return_token_ids and j == 0:
                opening["prompt_token_ids"] = prompt_ids
            yield sse(opening)
        async for index, out in streams:
            last[index] = out
            if out.new_logprobs is not None:
                pending.setdefault(index, []).extend(out.new_logprobs)
            if body.return_token_ids:
                pending_ids.setdefault(index, []).extend(out.new_token_ids)
            if not out.new_text and not out.finished:
                continue
            lp = None if out.new_logprobs is None else logprobs.build(pending.pop(index, []))
            chunk = _chunk(
                header,
                index,
                {"content": out.new_text} if out.new_text else {},
                out.finish_reason if out.finished else None,
                lp,
            )
            if body.return_token_ids:
                chunk["choices"][0]["token_ids"] = pending_ids.pop(index, [])
            if continuous:
                chunk["usage"] = usage_dict(
                    out.num_prompt_tokens, len(out.output_token_ids), out.num_cached_tokens, [out], [out]
                )
            yield sse(chunk)
        if body.include_usage:
            outs = [last[i] for i in sorted(last)]
            usage = usage_dict(
                outs[0].num_prompt_tokens,
                sum(len(o.output_token_ids) for o in outs),
                outs[0].num_cached_tokens,
                outs[:1],
                outs,
            )
            yield sse({**header, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    except ValueError as exc:
        err = from_value_error(exc)
        yield sse(error_body(err.message, param=err.param))
    except EngineError as exc:
        yield sse(error_body(str(exc), type="internal_server_error", code=exc.code))
    finally:
        await streams.aclose()
    yield SSE_DONE
