"""Request bodies of the Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Pydantic models, strict as the OpenAI ones (``kvreuse.api.protocol``): a wrong type or value is
a 400 naming the field (``messages[1].content[0].cache_control.ttl``), in Anthropic's error shape
on these routes (``kvreuse.api.anthropic_errors``). Unknown fields are ignored, as Anthropic's
server does for fields of newer API versions.

Content blocks are one model whose ``type`` says which fields it needs (``ContentBlock.check``):
``text``; ``document`` with a ``{"type": "text", "media_type": "text/plain", "data": ...}``
source (a reusable kvreuse document); ``tool_use`` (assistant) and ``tool_result`` (user). Images
and PDF documents are refused naming the block. ``cache_control`` may sit on any block, on a
system block, on a tool, and at the top level (``kvreuse.api.cache_breakpoints``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvreuse.sampling_params import MAX_STOP_SEQUENCES, SamplingParams

MAX_BLOCKS = 10_000  # content blocks in one message, tools, system blocks: bounds the work per request
MAX_MESSAGES = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _invalid(message: str) -> PydanticCustomError:
    """A validation failure whose message is ``message`` alone (no "Value error, ")."""
    return PydanticCustomError("value_error", message)


def _text_blocks(value: Any) -> Any:
    """A string where blocks are accepted is one text block: the blocks' errors then name
    the block (``content[2].type``), not "expected a string or a list"."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class CacheControl(_Strict):
    """``{"type": "ephemeral", "ttl": "5m" | "1h"}``; ttl defaults to 5m."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextSource(_Strict):
    """A document's text source (the only kind kvreuse takes: its tokens are the document)."""

    type: Literal["text"]
    media_type: Literal["text/plain"] = "text/plain"
    data: StrictStr


BLOCK_TYPES = ("text", "document", "tool_use", "tool_result")


class ContentBlock(_Strict):
    """One content block; ``type`` names the fields it needs."""

    type: StrictStr
    text: StrictStr | None = None  # text
    source: TextSource | None = None  # document
    title: StrictStr | None = None  # document
    context: StrictStr | None = None  # document
    id: StrictStr | None = None  # tool_use
    name: StrictStr | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: StrictStr | None = None  # tool_result
    content: list[ContentBlock] | None = None  # tool_result: a string or text blocks
    is_error: StrictBool = False  # tool_result
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _strings(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in BLOCK_TYPES:  # before its fields are read
            raise _invalid(f"type {data.get('type')!r} is not supported; use one of {', '.join(BLOCK_TYPES)}")
        if isinstance(data, dict) and isinstance(data.get("content"), str):
            return {**data, "content": _text_blocks(data["content"])}
        return data

    @model_validator(mode="after")
    def check(self) -> ContentBlock:
        needs = {
            "text": ("text",),
            "document": ("source",),
            "tool_use": ("id", "name", "input"),
            "tool_result": ("tool_use_id",),
        }
        for name in needs[self.type]:
            if getattr(self, name) is None:
                raise _invalid(f"{name} is required in a {self.type} block")
        if self.type == "tool_result" and any(b.type != "text" for b in self.content or ()):
            raise _invalid("a tool_result's content may hold only text blocks")
        return self

    def result_text(self) -> str:
        """A ``tool_result``'s content as text."""
        return "\n".join(b.text or "" for b in self.content or ())


class Message(_Strict):
    """A turn; string ``content`` is one text block."""

    role: Literal["user", "assistant"]
    content: list[ContentBlock] = Field(min_length=1, max_length=MAX_BLOCKS)

    _strings = field_validator("content", mode="before")(_text_blocks)


class Tool(_Strict):
    """A client tool: ``name``, ``description``, ``input_schema`` (a JSON schema object)."""

    name: StrictStr = Field(min_length=1, max_length=128)
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    def template_dict(self) -> dict[str, Any]:
        """The OpenAI function shape chat templates take (``tools=`` of ``apply_chat_template``)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class SystemBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None


class Metadata(_Strict):
    user_id: StrictStr | None = Field(default=None, max_length=256)


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: what a message request is, without sampling."""

    model: StrictStr
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: list[SystemBlock] | None = Field(default=None, max_length=MAX_BLOCKS)  # a string: one block
    tools: list[Tool] | None = Field(default=None, max_length=MAX_BLOCKS)
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # top level: a breakpoint on the last cacheable block

    _strings = field_validator("system", mode="before")(_text_blocks)

    def check_tool_choice(self) -> None:
        """Raises ``ValueError`` naming ``tool_choice`` for a choice kvreuse cannot force."""
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise ValueError(
                f"tool_choice.type: {self.tool_choice.type!r} is not supported (the model cannot be "
                'forced to call a tool); use "auto" or "none"'
            )


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``max_tokens`` is required, as Anthropic requires it."""

    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StrictStr] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=0)
    stream: StrictBool = False
    metadata: Metadata | None = None
    # kvreuse extra, as on the OpenAI routes: separates caches (a tenant key's salt is added to it;
    # ``kvreuse route`` puts a tenant's salt here before it forwards the body)
    cache_salt: StrictStr | None = Field(default=None, min_length=1)

    def sampling_params(self) -> SamplingParams:
        """The engine's ``SamplingParams``; raises ``ValueError`` naming the field."""
        if any(not s for s in self.stop_sequences or ()):
            raise ValueError("stop_sequences: each must be a non-empty string")
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences or ()),
        )
