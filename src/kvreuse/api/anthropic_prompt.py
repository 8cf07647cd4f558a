"""A Messages API request -> prompt token ids, its documents and its cache plan.

The request becomes chat-template messages, rendered as ``/v1/chat/completions`` renders them
(``kvreuse.api.chat_prompt``)::

    system blocks            -> one "system" message (texts joined by "\\n")
    user text blocks         -> a "user" message (consecutive texts joined by "\\n")
    user document block      -> a "user" message of its own, marked as a kvreuse document
                                (title, context and text joined by blank lines)
    user tool_result block   -> a "tool" message (tool_call_id, its text)
    assistant text/tool_use  -> an "assistant" message with tool_calls
    tools                    -> the template's ``tools`` (OpenAI's function shape)

A last ``assistant`` message is a prefill: the reply continues its text (no end-of-turn after it).

Tools and tool blocks need a template that renders tools (its source mentions ``tools``);
otherwise they are a 400 naming the field. Every template message is one ``Segment`` of the
cache plan (``kvreuse.api.cache_breakpoints``): a breakpoint on a block ends the segment of the
message holding it, one on a tool ends the first segment (templates render tools in their
head), and the top-level ``cache_control`` ends the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvreuse.api.anthropic_protocol import CacheControl, ContentBlock, CountTokensRequest
from kvreuse.api.body import check_text
from kvreuse.api.cache_breakpoints import Breakpoint, BreakpointPolicy, CachePlan, Segment, check_breakpoints
from kvreuse.api.chat_prompt import document_parts, message_boundaries, message_ends, rendered_lead
from kvreuse.api.errors import APIError
from kvreuse.document_prompt import DocumentPrompt


@dataclass(frozen=True)
class MessagesPrompt:
    token_ids: list[int]
    plan: CachePlan  # retention ranges from cache_control, and how usage is counted
    documents: DocumentPrompt | None = None  # document blocks: reused at any position


@dataclass
class _Turn:
    """One template message being built, and what the cache plan needs of it."""

    message: dict[str, Any]
    kind: str  # "system" | "document" | "history"
    breakpoints: list[tuple[str, CacheControl]] = field(default_factory=list)  # (field path, cache_control)


def supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools (it reads a ``tools`` variable)."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def _document_text(block: ContentBlock) -> str:
    assert block.source is not None
    return "\n\n".join(p for p in (block.title, block.context, block.source.data) if p)


class _Builder:
    """The template messages of one request, in order."""

    def __init__(self, tools_ok: bool) -> None:
        self.turns: list[_Turn] = []
        self.tools_ok = tools_ok
        self._open: _Turn | None = None  # the message text and tool blocks are added to

    def flush(self) -> None:
        self._open = None

    def _turn(self, role: str, kind: str = "history") -> _Turn:
        if self._open is None or self._open.message["role"] != role:
            self._open = _Turn({"role": role, "content": ""}, kind)
            self.turns.append(self._open)
        return self._open

    def add(self, role: str, block: ContentBlock, path: str) -> None:
        if block.type in ("tool_use", "tool_result") and not self.tools_ok:
            raise APIError(
                f"{path}: this model's chat template does not render tools, so {block.type} blocks "
                "cannot be sent to it",
                param=path,
            )
        if block.type == "text":
            turn = self._turn(role)
            text = check_text(block.text or "", f"{path}.text")
            turn.message["content"] += ("\n" if turn.message["content"] else "") + text
        elif block.type == "document":
            if role != "user":
                raise APIError(f"{path}: document blocks belong in user messages", param=path)
            self.flush()
            turn = _Turn(
                {"role": "user", "content": check_text(_document_text(block), f"{path}.source.data")}, "document"
            )
            self.turns.append(turn)
        elif block.type == "tool_use":
            if role != "assistant":
                raise APIError(f"{path}: tool_use blocks belong in assistant messages", param=path)
            turn = self._turn("assistant")
            turn.message.setdefault("tool_calls", []).append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
            )
        else:  # tool_result
            if role != "user":
                raise APIError(f"{path}: tool_result blocks belong in user messages", param=path)
            self.flush()
            turn = _Turn(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": check_text(block.result_text(), f"{path}.content"),
                },
                "history",
            )
            self.turns.append(turn)
        if block.cache_control is not None:
            turn.breakpoints.append((f"{path}.cache_control", block.cache_control))
        if block.type in ("document", "tool_result"):
            self.flush()  # what follows opens a message of its own


def _turns(body: CountTokensRequest, tools_ok: bool) -> list[_Turn]:
    builder = _Builder(tools_ok)
    if body.system:
        texts = [check_text(b.text, f"system[{k}].text") for k, b in enumerate(body.system)]
        system = _Turn({"role": "system", "content": "\n".join(texts)}, "system")
        system.breakpoints = [
            (f"system[{k}].cache_control", b.cache_control)
            for k, b in enumerate(body.system)
            if b.cache_control is not None
        ]
        builder.turns.append(system)
    for i, message in enumerate(body.messages):
        builder.flush()  # each request message opens a template message
        for j, block in enumerate(message.content):
            builder.add(message.role, block, f"messages[{i}].content[{j}]")
    return builder.turns


def _breakpoints(body: CountTokensRequest, turns: list[_Turn]) -> list[Breakpoint]:
    """In Anthropic's order: tools, system, messages, then the top-level one."""
    found = [
        Breakpoint(0, t.cache_control.ttl, f"tools[{k}].cache_control")
        for k, t in enumerate(body.tools or ())
        if t.cache_control is not None
    ]
    for index, turn in enumerate(turns):
        found += [Breakpoint(index, cc.ttl, path) for path, cc in turn.breakpoints]
    if body.cache_control is not None:
        found.append(Breakpoint(len(turns) - 1, body.cache_control.ttl, "cache_control"))
    return found


def render_messages(tokenizer: Any, body: CountTokensRequest, policy: BreakpointPolicy) -> MessagesPrompt:
    """Raises a 400 ``APIError`` naming the field: tools on a template without them, a
    block in the wrong role, bad ``cache_control`` (more than 4, a 1h after a 5m), text no
    tokenizer can encode, or messages the template rejects."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            "messages: this model has no chat template, so it cannot take messages; "
            "send the text to /v1/completions as a prompt",
            param="messages",
        )
    tools_ok = supports_tools(tokenizer)
    if body.tools and not tools_ok:
        raise APIError("tools: this model's chat template does not render tools; leave tools out", param="tools")
    try:
        body.check_tool_choice()
    except ValueError as exc:
        raise APIError(str(exc), param="tool_choice") from None
    turns = _turns(body, tools_ok)
    breakpoints = _breakpoints(body, turns)
    try:
        check_breakpoints(breakpoints)
    except ValueError as exc:
        raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None
    kwargs = {"tools": [t.template_dict() for t in body.tools]} if body.tools else {}
    messages = [t.message for t in turns]
    try:
        # a last assistant message is a prefill: the reply continues it (Anthropic's behaviour)
        prefill = messages[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=not prefill, continue_final_message=prefill, tokenize=False, **kwargs
        )
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and friends: the client's messages
        raise APIError(f"messages: the chat template rejected them: {exc}", param="messages") from None
    flags = [t.kind == "document" for t in turns]
    if not breakpoints and not any(flags):
        return MessagesPrompt(token_ids, CachePlan())
    bounds = message_boundaries(tokenizer, messages, len(token_ids), kwargs, text) if any(flags) else None
    plan = _plan(tokenizer, body, turns, breakpoints, policy, len(token_ids), kwargs, text, bounds)
    documents = (
        None if bounds is None else document_parts(token_ids, bounds, flags, rendered_lead(tokenizer, token_ids))
    )
    return MessagesPrompt(token_ids, plan, documents)


def _plan(
    tokenizer: Any,
    body: CountTokensRequest,
    turns: list[_Turn],
    breakpoints: list[Breakpoint],
    policy: BreakpointPolicy,
    num_tokens: int,
    kwargs: dict[str, Any],
    text: str,
    bounds: list[tuple[int, int]] | None,
) -> CachePlan:
    """The cache plan over merged segments: consecutive turns of one class up to the last
    breakpoint are one segment (the same priority and ttl either way), so only the ends of
    segments are located, one prefix rendering each (``message_ends``), not every turn's.
    ``bounds``: every turn's, when a documents prompt has computed them anyway."""
    if not breakpoints:
        return CachePlan()
    kinds = [frozenset({t.kind} | ({"tools"} if body.tools and i == 0 else set())) for i, t in enumerate(turns)]
    classes = [policy.priority(k) for k in kinds]
    last = max(bp.segment for bp in breakpoints)
    cuts = sorted({bp.segment for bp in breakpoints} | {i for i in range(last) if classes[i] != classes[i + 1]})
    if bounds is not None:
        ends = {i: bounds[i][1] for i in cuts}
    else:
        ends = message_ends(tokenizer, [t.message for t in turns], cuts, num_tokens, kwargs, text)
    segments, start, first = [], 0, 0
    for cut in cuts:
        segments.append(Segment(frozenset().union(*kinds[first : cut + 1]), start, ends[cut]))
        start, first = ends[cut], cut + 1
    merged = [Breakpoint(cuts.index(bp.segment), bp.ttl, bp.param) for bp in breakpoints]
    return policy.plan(segments, merged)
