"""render_messages: a Messages API request -> template messages, token ids, exact cache plan."""

from __future__ import annotations

import copy

import pytest

from kvreuse.api.anthropic_prompt import render_messages, supports_tools
from kvreuse.api.anthropic_protocol import MessagesRequest
from kvreuse.api.cache_breakpoints import BreakpointPolicy
from kvreuse.api.errors import APIError
from kvreuse.cache.retention import TokenRangeRetentionConfig as R

# A ChatML template that renders tools (as Qwen's does: in the system turn) and tool turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools{% for t in tools %}\n{{ t.function.name }}: {{ t.function.description }}{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from kvreuse.models.tiny import _load_tokenizer, tokenizer_dir

    return _load_tokenizer(str(tokenizer_dir()))


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def _req(**fields):
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 1, **fields})


def _count(tok, messages, **kwargs):
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return len(tok.encode(text, add_special_tokens=False))


def test_plain_request_is_the_chat_template(tokenizer):
    body = _req(
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    )
    prompt = render_messages(tokenizer, body, BreakpointPolicy())
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert prompt.plan.retention() is None and prompt.documents is None


def test_breakpoints_give_exact_ranges(tokenizer):
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "next"},
    ]
    hour = {"type": "ephemeral", "ttl": "1h"}
    body = _req(
        system=[{"type": "text", "text": "You are terse.", "cache_control": hour}],
        messages=[
            chat[1],
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "answer", "cache_control": {"type": "ephemeral"}}],
            },
            chat[3],
        ],
    )
    plan = render_messages(tokenizer, body, BreakpointPolicy()).plan
    s, u, a = _count(tokenizer, chat[:1]), _count(tokenizer, chat[:2]), _count(tokenizer, chat[:3])
    # the history turns up to the 5m breakpoint are one range: one priority, one ttl
    assert plan.ranges == (R(0, s, 85, 3_600_000), R(s, a, 40, 300_000))
    assert u < a
    # the top-level cache_control: the last message
    top = render_messages(
        tokenizer, _req(messages=chat[1:], cache_control={"type": "ephemeral"}), BreakpointPolicy()
    ).plan
    assert top.ranges == (R(0, _count(tokenizer, chat[1:]), 40, 300_000),) and top.ttls == ("5m",)


def test_documents_become_marked_messages(tokenizer):
    body = _req(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "document",
                        "source": {"type": "text", "media_type": "text/plain", "data": "Paris is in France."},
                        "title": "Geo",
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "Where is Paris?"},
                ],
            }
        ]
    )
    prompt = render_messages(tokenizer, body, BreakpointPolicy())
    chat = [{"role": "user", "content": "Geo\n\nParis is in France."}, {"role": "user", "content": "Where is Paris?"}]
    assert prompt.token_ids == tokenizer.encode(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert prompt.documents is not None
    # the default system turn the template adds is glue of the first message, the document
    assert prompt.plan.ranges == (R(0, _count(tokenizer, chat[:1]), 50, 300_000),)


def test_tools_render_on_a_template_that_has_them(tools_tokenizer):
    assert supports_tools(tools_tokenizer)
    body = _req(
        system="sys",
        tools=[
            {
                "name": "get_weather",
                "description": "Weather now",
                "input_schema": {"type": "object"},
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            }
        ],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
    )
    prompt = render_messages(tools_tokenizer, body, BreakpointPolicy())
    text = tools_tokenizer.decode(prompt.token_ids)
    assert "# Toolsget_weather: Weather now" in text  # HF trims the newline after a block tag
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert "<tool_response id=t1>sunny</tool_response>" in text
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object"}},
        }
    ]
    head = _count(tools_tokenizer, [{"role": "system", "content": "sys"}], tools=tools)
    assert prompt.plan.ranges == (R(0, head, 95, 3_600_000),)  # tools + system: the tools' priority


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"tools": [{"name": "f", "input_schema": {}}], "messages": [{"role": "user", "content": "x"}]},
            "tools",
            "tools: this model's chat template does not render tools",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "r"}]}]},
            "messages[0].content[0]",
            "messages[0].content[0]: this model's chat template does not render tools",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "document", "source": {"type": "text", "data": "d"}}]}
                ]
            },
            "messages[0].content[0]",
            "messages[0].content[0]: document blocks belong in user messages",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
            "tool_choice",
            "tool_choice.type: 'any' is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content[0].text",
            "messages[0].content[0].text: text contains a lone UTF-16 surrogate",
        ),
    ],
)
def test_refusals_name_the_field(tokenizer, fields, param, message):
    with pytest.raises(APIError) as err:
        render_messages(tokenizer, _req(**fields), BreakpointPolicy())
    assert err.value.param == param and err.value.message.startswith(message) and err.value.status == 400


def test_a_last_assistant_message_is_continued(tokenizer):
    body = _req(
        messages=[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour"}]
    )
    text = tokenizer.decode(render_messages(tokenizer, body, BreakpointPolicy()).token_ids)
    assert text.endswith("<|im_start|>assistant\nThe colour")
