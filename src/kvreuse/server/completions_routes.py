"""``POST /v1/completions``: one choice per (prompt, sample), streamed or whole.

A string prompt starting with ``<prompt`` is PML over a registered schema (docs/pml.md).

``documents`` (a kvreuse extra: texts or token-id lists) go before the one prompt, each a
reusable document whose KV is computed once and reused in any order (``engine/document_cache.py``).

A list prompt (strings or token-id lists) gives one choice per prompt and per ``n``,
numbered ``prompt_index * n + sample``, as OpenAI does.

``logprobs: k`` adds each choice's token logprobs (shape in ``logprobs_format.py``); with
``echo`` it is a 400, because prompt logprobs are not computed.

``return_token_ids: true`` (vLLM's extension, same field names) adds to each choice
``prompt_token_ids`` (its prompt's ids; ``null`` for a PML prompt, which has no flat token
prompt to send again) and ``token_ids`` (the generated ids, EOS or stop token included).
Streamed, ``prompt_token_ids`` comes on a choice's first chunk and each chunk's ``token_ids``
are the ids sampled since the choice's previous chunk, so a reader holding the chunks holds
exactly the ids behind their text (what a router needs to continue the stream elsewhere).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvreuse.api.body import check_text
from kvreuse.api.chat_prompt import special_lead
from kvreuse.api.errors import APIError, error_body
from kvreuse.api.protocol import CompletionRequest, default_max_tokens, now_s, usage_dict
from kvreuse.api.tenants import tenant_of, tenant_salt
from kvreuse.engine.async_engine import EngineError
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.engine.logprobs import TokenLogprobs
from kvreuse.pml.module_cache import is_pml_prompt
from kvreuse.pml.prepared import PreparedPrompt
from kvreuse.server.context import ServerContext, context_of
from kvreuse.server.errors import from_value_error
from kvreuse.server.logprobs_format import CompletionLogprobs
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
    reserve_tokens,
    run_to_completion,
    sampling_params,
    sse,
    start_streams,
)

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    """Raises 400 (bad field, prompt too long), 404 (unknown model), 429 (a tenant limit,
    ``kvreuse.api.limiter``); 500 on engine failure."""
    ctx = context_of(request)
    model = check_model(ctx, body.model)
    salt = tenant_salt(tenant_of(request.scope), body.cache_salt)  # a tenant key's blocks are the tenant's
    retention = parse_retention(body.kv_cache_retention_config)
    blend = parse_blend(body.blend)  # parsed once, for every prompt; PML modules and documents have seams to blend
    tokenizer = ctx.engine.tokenizer
    prompt_ids: list[list[int]] = []
    pml: list[str | None] = []  # PML prompts, each compiled once on the engine thread (docs/pml.md)
    prepared: list[PreparedPrompt | DocumentPrompt | None] = []
    lengths: list[int] = []  # context length of each prompt: where decoding starts
    prompts = body.prompts()
    documents = None if body.documents is None else _documents(ctx, body, prompts)
    for prompt in prompts:
        pml.append(prompt if isinstance(prompt, str) and is_pml_prompt(prompt) else None)
        if pml[-1] is not None:
            compiled = await ctx.engine.prepare_pml(pml[-1])
            prepared.append(compiled)
            ids, n = [], compiled.next_position
            check_prompt_length(ctx, n, body.max_tokens, param="prompt")
        elif documents is not None:
            prepared.append(documents)
            ids = [t for part, _ in documents.parts for t in part]
            check_prompt(ctx, ids, body.max_tokens, param="prompt")
            n = len(ids)
        else:
            prepared.append(None)
            ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt
            check_prompt(ctx, ids, body.max_tokens, param="prompt")
            n = len(ids)
        prompt_ids.append(ids)
        lengths.append(n)
    base_id = body.request_id or new_request_id("cmpl")
    requests = []
    for i, ids in enumerate(prompt_ids):
        default_max = default_max_tokens(False, lengths[i], ctx.engine.max_model_len, ctx.engine.pool_tokens)
        if documents is not None:  # the documents' blocks are held beside the reply's
            default_max = document_reply_room(ctx, default_max, documents, blend, param="documents")
        for j in range(body.n):
            index = i * body.n + j
            requests.append(
                EngineRequest(
                    index,
                    ids,
                    sampling_params(body, default_max, seed_offset=j),
                    f"{base_id}-{index}",
                    salt,
                    retention,
                    prepared[i],
                    blend=blend,
                )
            )
    echo_text = [(pml[i] or tokenizer.decode(ids)) if body.echo else "" for i, ids in enumerate(prompt_ids)]
    header = {"id": base_id, "object": "text_completion", "created": now_s(), "model": model}
    # what return_token_ids reports as each prompt's ids: none for PML (no flat prompt to resend)
    reported = [None if pml[i] is not None else ids for i, ids in enumerate(prompt_ids)]
    meter = reserve_tokens(request, requests, lengths, body.n)  # a 429 when the tenant's tokens per minute are spent
    if body.stream:
        streams = await start_streams(ctx, requests, meter)
        return StreamingResponse(
            _stream(ctx, body, header, streams, echo_text, reported), media_type="text/event-stream"
        )
    finals = await run_to_completion(ctx, requests, request, meter)
    choices: list[dict[str, Any]] = [
        {
            "index": req.index,
            "text": echo_text[req.index // body.n] + out.text,
            "logprobs": None if out.logprobs is None else CompletionLogprobs(tokenizer).build(out.logprobs),
            "finish_reason": out.finish_reason,
        }
        for req, out in zip(requests, finals)
    ]
    if body.return_token_ids:
        for choice, out in zip(choices, finals):
            choice["prompt_token_ids"] = reported[choice["index"] // body.n]
            choice["token_ids"] = list(out.output_token_ids)
    firsts = finals[:: body.n]  # one per prompt: prompt tokens are counted once per prompt
    usage = usage_dict(
        sum(o.num_prompt_tokens for o in firsts),
        sum(len(o.output_token_ids) for o in finals),
        sum(o.num_cached_tokens for o in firsts),
        firsts,
        finals,
    )
    return JSONResponse({**header, "choices": choices, "usage": usage})


def _documents(ctx: ServerContext, body: CompletionRequest, prompts: list) -> DocumentPrompt:
    """``documents`` (texts or token-id lists, in order) before the one prompt, as parts.
    A prompt's special tokens (BOS) come once, at its start, as for a plain prompt (vLLM's
    completions convention), when its first part is text: a text part before the first
    document, which every document is then encoded after; texts are encoded without them
    (a BOS before each document and before the question would be a prompt no model saw).
    Token-id parts are taken as given. Raises a 400 naming ``documents`` for several prompts,
    a PML prompt or an empty one."""
    if len(prompts) != 1 or (isinstance(prompts[0], str) and is_pml_prompt(prompts[0])):
        raise APIError("documents: give one plain prompt (the question) with documents", param="documents")
    tokenizer = ctx.engine.tokenizer
    documents, question = list(body.documents or ()), prompts[0]
    lead = special_lead(tokenizer) if isinstance((documents or [question])[0], str) else []
    parts = [(lead, False)] if lead else []
    vocab = ctx.engine.vocab_size
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            check_text(doc, f"documents[{i}]")
        ids = list(tokenizer.encode(doc, add_special_tokens=False)) if isinstance(doc, str) else doc
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(f"documents[{i}]: token ids must be in the vocabulary [0, {vocab})", param=f"documents[{i}]")
        parts.append((ids, True))
    parts.append(
        (list(tokenizer.encode(question, add_special_tokens=False)) if isinstance(question, str) else question, False)
    )
    try:
        return DocumentPrompt.of(parts)
    except ValueError as exc:
        raise APIError(str(exc), param="documents") from None


async def _stream(
    ctx: ServerContext,
    body: CompletionRequest,
    header: dict[str, Any],
    streams,
    echo_text: list[str],
    prompt_ids: list[list[int] | None],
) -> AsyncIterator[str]:
    last: dict[int, Any] = {}
    continuous = body.include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]  # include_usage implies stream_options
    logprobs: dict[int, CompletionLogprobs] = {}  # per choice, when asked for
    pending: dict[int, list[TokenLogprobs]] = {}  # tokens whose text has not been sent yet
    pending_ids: dict[int, list[int]] = {}  # return_token_ids: ids sampled since the choice's last chunk
    opened: set[int] = set()  # choices whose first chunk is out (it carries prompt_token_ids)
    try:
        async for index, out in streams:
            text = out.new_text
            if index not in last and echo_text[index // body.n]:
                text = echo_text[index // body.n] + text
            last[index] = out
            if out.new_logprobs is not None:
                pending.setdefault(index, []).extend(out.new_logprobs)
            if body.return_token_ids:
                pending_ids.setdefault(index, []).extend(out.new_token_ids)
            if not text and not out.finished:
                continue
            lp = None
            if out.new_logprobs is not None:
                lp = logprobs.setdefault(index, CompletionLogprobs(ctx.engine.tokenizer)).build(pending.pop(index, []))
            choice = {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            if body.return_token_ids:
                if index not in opened:
                    opened.add(index)
                    choice["prompt_token_ids"] = prompt_ids[index // body.n]
                choice["token_ids"] = pending_ids.pop(index, [])
            chunk = {**header, "choices": [choice]}
            if continuous:
                chunk["usage"] = usage_dict(
                    out.num_prompt_tokens, len(out.output_token_ids), out.num_cached_tokens, [out], [out]
                )
            yield sse(chunk)
        if body.include_usage:
            outs = [last[i] for i in sorted(last)]
            firsts = outs[:: body.n]
            usage = usage_dict(
                sum(o.num_prompt_tokens for o in firsts),
                sum(len(o.output_token_ids) for o in outs),
                sum(o.num_cached_tokens for o in firsts),
                firsts,
                outs,
            )
            yield sse({**header, "choices": [], "usage": usage})
    except ValueError as exc:
        err = from_value_error(exc)
        yield sse(error_body(err.message, param=err.param))
    except EngineError as exc:
        yield sse(error_body(str(exc), type="internal_server_error", code=exc.code))
    finally:
        await streams.aclose()
    yield SSE_DONE
