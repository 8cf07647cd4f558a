"""Request and response bodies of the OpenAI API, with vLLM's extras.

Requests are pydantic models: a wrong type or out-of-range value fails validation and the
server answers 400 with a message naming the field (see ``errors.py``). Booleans are strict
(``"yes"`` is not ``true``). Unknown fields are ignored, as OpenAI and vLLM do.

Sampling fields are bounded by what the sampler's fp32 arithmetic can honour, so one request's
settings can never make a step fail: every number must be finite (NaN and Infinity, which JSON
parsers accept, are refused), ``top_p`` is at least ``MIN_TOP_P`` (smaller is 0 in float32),
a ``temperature`` below 1e-5 samples greedily, and the OpenAI/vLLM knobs kvreuse does not
implement are range-checked before they are refused unless neutral.

Responses are plain dicts built by ``usage_dict`` and the route modules: they are
serialised once per SSE chunk, and dicts keep that cheap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvreuse.api.body import check_text
from kvreuse.api.cache_breakpoints import prompt_cache_retention_config
from kvreuse.events.records import TIER_NAMES  # level -> what users read (re-exported)
from kvreuse.sampling_params import MAX_LOGPROBS, SamplingParams


def _drop_nulls(data: Any) -> Any:
    """An explicit ``null`` means "the default" (OpenAI's spec allows null for optional
    fields and clients send it); a required field sent as null is then reported missing."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage on every chunk

    _nulls = model_validator(mode="before")(_drop_nulls)


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    _nulls = model_validator(mode="before")(_drop_nulls)

    model: StrictStr | None = None  # None: the served model (vLLM accepts it missing)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # < 1e-5: greedy
    # (0, 1] here; SamplingParams refuses what is under MIN_TOP_P with a message that says why
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(default=0, ge=-1)  # vLLM extra; -1 and 0 mean off
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64 (seed + n offset fits uint64)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM extra
    ignore_eos: StrictBool = False  # vLLM extra
    include_stop_str_in_output: StrictBool = False  # vLLM extra
    n: StrictInt = Field(default=1, ge=1, le=16)  # seed's bound above leaves room for these offsets
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # kvreuse / vLLM extras
    cache_salt: StrictStr | None = Field(default=None, min_length=1)
    kv_cache_retention_config: dict[str, Any] | None = None
    # OpenAI's prompt caching: a routing affinity key (``kvreuse route`` keeps a key's requests on one
    # executor), and "24h" keeps the prompt a day (folded into kv_cache_retention_config, docs/anthropic.md)
    prompt_cache_key: StrictStr | None = Field(default=None, min_length=1, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @field_validator("prompt_cache_retention")
    @classmethod
    def _one_retention(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value == "24h" and info.data.get("kv_cache_retention_config") is not None:
            raise PydanticCustomError(
                "value_error", "give prompt_cache_retention or kv_cache_retention_config, not both"
            )
        return value

    @model_validator(mode="after")
    def _fold_prompt_cache_retention(self) -> Any:
        if self.prompt_cache_retention == "24h":
            self.kv_cache_retention_config = prompt_cache_retention_config(self.prompt_cache_retention)
        return self

    # blend of a prompt's assembled modules or documents: {"first_tokens": k, "ratio": r}
    # (engine/blend.py, parsed once by server/serving.py: parse_blend; absent: the server's default)
    blend: Any = None
    request_id: StrictStr | None = None
    # vLLM extra: the prompt's token ids and each choice's generated ids in the response (streamed:
    # prompt_token_ids on a choice's first chunk, token_ids on every chunk; routes' docstrings)
    return_token_ids: StrictBool = False
    # kvreuse extra: false opts this request out of prompt-lookup speculation (engine/spec_decode.py)
    speculative: StrictBool = True
    # OpenAI fields kvreuse does not implement: accepted at their neutral values, else a 400
    # naming them (silently ignoring them would hand the client something it did not ask for)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)  # OpenAI's range
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, allow_inf_nan=False)  # vLLM: 1 is neutral
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)  # vLLM: 0 is neutral
    logit_bias: dict[str, Any] | None = None  # token id -> bias in [-100, 100] (checked by _check_logit_bias)
    best_of: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def _refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: penalties are not supported; leave {name} out or 0")
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty: penalties are not supported; leave repetition_penalty out or 1")
        if self.min_p:
            raise ValueError("min_p: not supported; leave min_p out or 0")
        _check_logit_bias(self.logit_bias)
        if self.logit_bias:
            raise ValueError("logit_bias: not supported; leave logit_bias out or empty")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported (only best_of == n); leave best_of out")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: structured output is not supported; only {\"type\": \"text\"}")
        if self.tools and self.tool_choice != "none":
            raise ValueError('tools: tool calling is not supported; leave tools out or set tool_choice: "none"')

    def sampling_params(self, default_max_tokens: int, *, seed_offset: int = 0) -> SamplingParams:
        """The engine's ``SamplingParams``; ``seed_offset`` separates the ``n`` samples.

        Raises ``ValueError`` (naming the field) for combinations the model cannot check.
        """
        self._refuse_unsupported()
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.num_logprobs(),
            speculative=self.speculative,
        )

    def num_logprobs(self) -> int | None:
        """``k`` top logprobs per output token, or ``None`` for none. Raises ``ValueError``
        (naming the field) for a combination the API forbids."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: a bias is in [-100, 100]


def _check_logit_bias(bias: dict[str, Any] | None) -> None:
    """OpenAI's shape of ``logit_bias``: keys are token ids (decimal, >= 0), values finite
    numbers in [-100, 100]. Raises ``ValueError`` naming the field and the bad entry. (Ids are
    not checked against the vocabulary: any non-empty bias is refused as unsupported after.)"""
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {key!r}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):  # NaN and inf fail too
            raise ValueError(
                f"logit_bias: the bias of token {key} must be a number in "
                f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {value!r}"
            )


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default max_tokens for completions


def default_max_tokens(chat: bool, prompt_tokens: int, max_model_len: int, pool_tokens: int) -> int:
    """``max_tokens`` for a body that gives none, for a prompt of ``prompt_tokens`` tokens:
    completions 16 (OpenAI's) or what the context leaves, at least 1; chat what the context and
    the KV pool of ``pool_tokens`` leave (vLLM fills the context; the last sampled token needs no
    slot), which may be < 1 (the caller refuses that prompt). One rule for the executor and
    for a router continuing a stream (``kvreuse.router.stream_request``)."""
    if not chat:
        return max(1, min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_model_len - prompt_tokens))
    return min(max_model_len - prompt_tokens, pool_tokens - prompt_tokens + 1)


MAX_PROMPTS = 256  # prompts in one completions request (each times n engine requests)
MAX_SEQUENCES = 256  # n x prompts: engine requests one completions request may start


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids, or a list of token-id lists (each list element is a separate prompt)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top k per token (logprobs_format.py)
    # kvreuse extra: reusable documents placed before the prompt, in order (README, "Documents")
    documents: list[StrictStr | list[StrictInt]] | None = Field(default=None, min_length=1, max_length=256)
    suffix: StrictStr | None = None

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None and self.echo:
            raise ValueError("echo: prompt logprobs (echo with logprobs) are not supported; drop one of them")
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: strings or token-id lists. Raises ``ValueError`` if empty, or
        when ``n`` x prompts is over ``MAX_SEQUENCES``; ``APIError`` for text no tokenizer
        can encode (a lone surrogate)."""
        out = self._prompts()
        if self.n * len(out) > MAX_SEQUENCES:
            raise ValueError(
                f"n: {self.n} samples x {len(out)} prompts = {self.n * len(out)} sequences; at most "
                f"{MAX_SEQUENCES} per request (lower n or split the prompts)"
            )
        for text in out:
            if isinstance(text, str):
                check_text(text, "prompt")
        return out

    def _prompts(self) -> list[str | list[int]]:
        if self.suffix:
            raise ValueError("suffix: insertion after the completion is not supported; leave suffix out")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request (got {len(p)}); split the batch")
        if isinstance(p[0], int):
            return [list(p)]
        if isinstance(p[0], list) and any(not ids for ids in p):
            raise ValueError("prompt: token-id lists must not be empty")
        return list(p)


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be OpenAI's list of text parts. ``retention`` is a
    kvreuse extra: ``{"priority": 0-100, "duration_ms": int}`` for this message's tokens."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    retention: dict[str, Any] | None = None
    kvreuse: dict[str, Any] | None = None  # {"document": true}: a reusable document (README, "Documents")

    @property
    def is_document(self) -> bool:
        """Whether the message is marked ``"kvreuse": {"document": true}``. Raises
        ``ValueError`` naming ``kvreuse`` for anything else in that field."""
        if self.kvreuse is None:
            return False
        unknown = set(self.kvreuse) - {"document"}
        flag = self.kvreuse.get("document", False)
        if unknown or not isinstance(flag, bool):
            raise ValueError(
                'kvreuse: only {"document": true|false} is accepted'
                + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else "")
            )
        return flag

    def text(self) -> str:
        """The message's text; list content keeps its ``{"type": "text"}`` parts.
        Raises ``ValueError`` for other part types (images are not supported)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            if "kvreuse" in part:  # refused rather than ignored: a mark there would reuse nothing
                raise ValueError(
                    'messages: "kvreuse" marks a whole message as a document, beside "role"; '
                    "it is not accepted on a content part"
                )
            parts.append(part["text"])
        return "".join(parts)

    def template_dict(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False  # per-token logprobs in choices[].logprobs.content (logprobs_format.py)
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    add_generation_prompt: StrictBool = True  # vLLM extra
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra

    def model_post_init(self, __context: Any) -> None:
        # OpenAI renamed max_tokens; honour either, the new name winning.
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 without logprobs is harmless (vLLM)
            raise ValueError("top_logprobs: requires logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class OutputCounts(Protocol):
    """What ``usage_dict`` reads of an engine output (``kvreuse.engine.outputs.RequestOutput``)."""

    @property
    def cached_tokens_by_tier(self) -> dict[str, int] | None: ...

    @property
    def num_recomputed_tokens(self) -> int: ...

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def num_accepted_tokens(self) -> int: ...


def usage_dict(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    outputs: Sequence[OutputCounts] = (),
    finals: Sequence[OutputCounts] = (),
) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` is always present.
    With tiers below the device pool, ``prompt_tokens_details.cached_tokens_by_tier`` (an
    extension; other clients ignore it) says where ``outputs``' cached tokens came from
    (``device``, ``host``, ``disk``, ``remote``). When any of ``finals`` (each choice's latest
    output) speculated, ``completion_tokens_details`` says how many prompt-lookup draft tokens
    were accepted and rejected (OpenAI's predicted-output fields)."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    recomputed = sum(out.num_recomputed_tokens for out in outputs)
    if recomputed:  # blend recomputed some assembled (cached) tokens: an extension
        details["recomputed_tokens"] = recomputed
    tiered = [split for out in outputs if (split := out.cached_tokens_by_tier) is not None]
    if tiered:  # the engine has tiers below the device pool
        by_tier = {name: 0 for name in TIER_NAMES.values()}
        for split in tiered:
            for level, n in split.items():
                name = TIER_NAMES.get(level, level.lower())
                by_tier[name] = by_tier.get(name, 0) + n
        details["cached_tokens_by_tier"] = by_tier
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }
    drafted = sum(out.num_draft_tokens for out in finals)
    if drafted:
        accepted = sum(out.num_accepted_tokens for out in finals)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def now_s() -> int:
    return int(time.time())
