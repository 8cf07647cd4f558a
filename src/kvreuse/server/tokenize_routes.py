"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache``,
``GET /version``.

::

    POST /tokenize     {"prompt": "..."} | {"messages": [...], "add_generation_prompt": true}
                       -> {"count", "max_model_len", "tokens", ["token_strs"], "block_size", "full_blocks"}
    POST /detokenize   {"tokens": [ids]} -> {"prompt": "..."}
    POST /reset_prefix_cache -> {"blocks_dropped": n}
    GET  /version      -> {"version": "..."}

``/tokenize`` gives the ids the completion and chat routes would compute for the same
input (same tokenizer call, same chat template); ``full_blocks`` says how many of them
form full KV blocks, the unit of prefix reuse. A ``<prompt ...>`` string is tokenised as
plain text here (PML prompts are compiled against a schema; see docs/pml.md).
``/reset_prefix_cache`` drops every cached block no request is using (an
``AllBlocksCleared`` event when events are on); running requests keep theirs. Like
``/v1/*``, these need the API key when the server has one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from kvreuse import __version__
from kvreuse.api.chat_prompt import render_chat
from kvreuse.api.errors import APIError
from kvreuse.api.protocol import ChatMessage
from kvreuse.server.context import context_of
from kvreuse.server.serving import check_model

router = APIRouter()


class TokenizeRequest(BaseModel):
    """Exactly one of ``prompt`` (plain text) and ``messages`` (rendered by the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None  # default: True for prompt, False for messages (vLLM)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Raises 400 naming ``prompt`` / ``messages`` when neither or both are given or the
    chat template rejects the messages; 404 for an unknown ``model``."""
    ctx = context_of(request)
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt (text) and messages (a chat)", param="prompt")
    tokenizer = ctx.engine.tokenizer
    if body.messages is not None:
        ids = (
            await run_in_threadpool(
                render_chat,
                tokenizer,
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
            )
        ).token_ids
        if body.add_special_tokens:  # the template already placed its markers; vLLM adds BOS only on request
            ids = _with_bos(tokenizer, ids)
    elif body.add_special_tokens is False:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=False))
    else:
        ids = list(tokenizer.encode(body.prompt))  # what /v1/completions computes
    block_size = ctx.engine.block_size
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": ctx.engine.max_model_len,
        "tokens": ids,
        "block_size": block_size,
        "full_blocks": len(ids) // block_size,
    }
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    """Raises 400 naming ``tokens`` for ids outside the vocabulary; 404 for an unknown ``model``."""
    ctx = context_of(request)
    check_model(ctx, body.model)
    vocab = ctx.engine.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"tokens: id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": ctx.engine.tokenizer.decode(body.tokens)}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, int]:
    """Runs on the engine thread between steps; blocks in use are untouched."""
    dropped = await context_of(request).engine.reset_prefix_cache()
    return {"blocks_dropped": dropped}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
