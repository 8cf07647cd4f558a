"""Chat messages -> prompt token ids, and each message's token range for per-message retention.

The prompt is the tokenizer's chat template rendered to text (``add_generation_prompt``)
and encoded without adding special tokens (the template already holds them). Message
boundaries come from rendering each prefix ``messages[:i+1]``: message i spans from the end
of prefix i-1 to the end of prefix i, so template glue (role markers, a default system
prompt) belongs to the message it introduces.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.api.body import check_text
from kvreuse.api.errors import APIError
from kvreuse.api.protocol import ChatMessage
from kvreuse.cache.retention import KvCacheRetentionConfig, ranges_from_message_boundaries
from kvreuse.document_prompt import DocumentPrompt


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    retention: KvCacheRetentionConfig | None  # from per-message ``retention``, if any
    # messages marked "kvreuse": {"document": true}: the same ids as parts (text, document...);
    # None when no message is marked
    documents: DocumentPrompt | None = None


def _render_text(
    tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool, template_kwargs: dict[str, Any]
) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
    )


def _render(
    tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool, template_kwargs: dict[str, Any]
) -> list[int]:
    text = _render_text(
        tokenizer, messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def message_boundaries(
    tokenizer: Any,
    messages: list[dict[str, str]],
    num_tokens: int,
    template_kwargs: dict[str, Any],
    text: str | None = None,
) -> list[tuple[int, int]]:
    """``(token_start, token_end)`` of each message in a prompt of ``num_tokens`` tokens,
    clipped to be monotonic (a template whose prefixes tokenize differently cannot
    produce overlapping ranges).

    With the prompt's ``text`` and a fast tokenizer, the prompt is encoded once with character
    offsets, and a prefix's end is the count of tokens before the prefix's last character, where
    the prefix's text begins the prompt's, no token straddles its end, and the prompt's next
    token is a special or added one (a chat template's turn marker) or there is none. Any other
    prefix is tokenized itself. Both give the same count: pre-tokenization never merges across a
    special token, so a prefix ending right before one tokenizes to the tokens before it. A plain
    boundary is not enough: byte-level tokenizers split whitespace by what follows it (``" \n\n"``
    ends a string as one token, inside a longer one as two; review: reproduced with an
    Alpaca-style template). (Tokenizing every prefix is quadratic: ~20 ms for 8 documents of 500
    tokens.)"""
    spans = _token_spans(tokenizer, text) if text is not None else None
    bounds, start = [], 0
    for i in range(len(messages)):
        end = None
        if spans is not None and text is not None:
            prefix = _render_text(
                tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=template_kwargs
            )
            end = _aligned_count(spans, text, prefix)
        if end is None:
            end = len(
                _render(tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=template_kwargs)
            )
        end = min(max(end, start), num_tokens)
        bounds.append((start, end))
        start = end
    return bounds


def message_ends(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    indices: Sequence[int],
    num_tokens: int,
    template_kwargs: dict[str, Any],
    text: str | None = None,
) -> dict[int, int]:
    """The token end of each message in ``indices`` (ascending), as ``message_boundaries``
    gives it, computed for those messages only: one prefix rendered per index rather than per
    message (a 200-turn conversation with one breakpoint renders 1 prefix, not 200)."""
    spans = _token_spans(tokenizer, text) if text is not None else None
    ends, floor = {}, 0
    for i in indices:
        end = None
        if spans is not None and text is not None:
            prefix = _render_text(
                tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=template_kwargs
            )
            end = _aligned_count(spans, text, prefix)
        if end is None:
            end = len(
                _render(tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=template_kwargs)
            )
        floor = ends[i] = min(max(end, floor), num_tokens)
    return ends


def _token_spans(tokenizer: Any, text: str) -> tuple[list[int], list[int], list[bool]] | None:
    """``(starts, ends, marker)``: each token's character span in ``text`` (the prompt encoded as
    ``_render`` encodes it) and whether it is a special or added token, or ``None`` for a
    tokenizer without offsets (a slow one)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        return None
    markers = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return [a for a, _ in offsets], [b for _, b in offsets], [t in markers for t in encoded["input_ids"]]


def _aligned_count(spans: tuple[list[int], list[int], list[bool]], text: str, prefix: str) -> int | None:
    """Tokens of ``text`` that end within its first ``len(prefix)`` characters, when
    ``prefix`` begins ``text`` and the next token starts at or after that point and is a
    special or added token (or there is none); else ``None``."""
    if not text.startswith(prefix):
        return None
    starts, ends, marker = spans
    c = len(prefix)
    j = bisect.bisect_right(ends, c)  # tokens ending at or before c (offsets ascend)
    if j < len(starts) and (starts[j] < c or not marker[j]):  # straddles the end, or plain text follows
        return None
    return j


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPrompt:
    """Raises a 400 ``APIError`` naming ``messages`` when the template rejects them (e.g.
    roles that must alternate) or the model has no chat template, ``messages[i].content``
    for text no tokenizer can encode (a lone surrogate), ``messages[i].retention`` for bad
    retention."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            "messages: this model has no chat template, so it cannot take chat messages; "
            "send the text to /v1/completions as a prompt",
            param="messages",
        )
    kwargs = dict(template_kwargs or {})
    if "chat_template" in kwargs:
        # A template is code run on the server (vLLM refuses it too unless trusted).
        raise APIError(
            "chat_template_kwargs.chat_template: a request may not supply its own chat template; "
            "the model's template is used",
            param="chat_template_kwargs",
        )
    for reserved in ("tokenize", "add_generation_prompt", "conversation", "messages"):
        kwargs.pop(reserved, None)
    try:
        dicts = [m.template_dict() for m in messages]
        for i, d in enumerate(dicts):
            check_text(d["content"], f"messages[{i}].content")
        text = _render_text(tokenizer, dicts, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs)
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    except APIError:
        raise
    except ValueError as exc:
        message = str(exc) if str(exc).startswith("messages") else f"messages: {exc}"
        raise APIError(message, param="messages") from None
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and friends: the client's messages
        raise APIError(f"messages: the chat template rejected them: {exc}", param="messages") from None
    flags = []
    for i, m in enumerate(messages):
        try:
            flags.append(m.is_document)
        except ValueError as exc:
            raise APIError(f"messages[{i}].{exc}", param=f"messages[{i}].kvreuse") from None
    retentions = [m.retention for m in messages]
    if not any(r is not None for r in retentions) and not any(flags):
        return ChatPrompt(token_ids, None)
    bounds = message_boundaries(tokenizer, dicts, len(token_ids), kwargs, text)
    documents = document_parts(token_ids, bounds, flags, rendered_lead(tokenizer, token_ids)) if any(flags) else None
    if not any(r is not None for r in retentions):
        return ChatPrompt(token_ids, None, documents)
    try:
        return ChatPrompt(token_ids, ranges_from_message_boundaries(bounds, retentions), documents)
    except ValueError as exc:
        raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None


def special_lead(tokenizer) -> list[int]:
    """The special tokens ``tokenizer`` puts before a text it encodes for a prompt (Gemma's and
    Llama 3's BOS; [] for a tokenizer that adds none). Any it adds after the text (an EOS) are
    not part of the lead: they do not belong after the first document."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a"))
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    return full[: starts[0]] if starts else []


def rendered_lead(tokenizer, token_ids: list[int]) -> list[int]:
    """The BOS a rendered chat starts with: the tokenizer's own lead (:func:`special_lead`), or
    a BOS the template rendered though the tokenizer adds none to a prompt."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return special_lead(tokenizer) or ([bos] if bos is not None and token_ids[:1] == [bos] else [])


def document_parts(
    token_ids: list[int], bounds: list[tuple[int, int]], flags: list[bool], lead: Sequence[int] = ()
) -> DocumentPrompt:
    """The rendered prompt as parts: each marked message's token range (its template glue
    included) a document, everything else text, the generation prompt last. ``lead``: the
    tokenizer's BOS (:func:`special_lead`); when the first message is a document whose range
    starts with it (a template that renders BOS), it is split off as text, so every document
    is encoded after it, not the first one alone. Raises a 400 naming ``messages`` when the
    last message is a document and nothing follows it."""
    parts: list[tuple[list[int], bool]] = []
    for (start, end), flag in zip(bounds, flags):
        ids = token_ids[start:end]
        if not parts and flag and lead and len(ids) > len(lead) and ids[: len(lead)] == list(lead):
            parts.append((ids[: len(lead)], False))
            ids = ids[len(lead) :]
        parts.append((ids, flag))
    parts.append((token_ids[bounds[-1][1] :] if bounds else token_ids, False))
    try:
        return DocumentPrompt.of(parts)
    except ValueError as exc:
        raise APIError(f"messages: {exc}", param="messages") from None


def merge_retention(
    from_messages: KvCacheRetentionConfig | None, from_request: KvCacheRetentionConfig | None
) -> KvCacheRetentionConfig | None:
    """Per-message ranges plus the request's decode retention. Token ranges on both is
    ambiguous: a 400 naming ``kv_cache_retention_config``."""
    if from_messages is None:
        return from_request
    if from_request is None:
        return from_messages
    if from_request.token_range_retention_configs:
        raise APIError(
            "kv_cache_retention_config.token_range_retention_configs: give token ranges or per-message "
            "retention, not both",
            param="kv_cache_retention_config",
        )
    return KvCacheRetentionConfig(
        from_messages.token_range_retention_configs,
        from_request.decode_retention_priority,
        from_request.decode_duration_ms,
    )
