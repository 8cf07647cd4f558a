"""Tools through /v1/messages on a template that renders them, driven by the official
``anthropic`` client: tool definitions, an assistant's ``tool_use`` and the user's
``tool_result`` reach the prompt, with a breakpoint on the tools (tiny Llama whose tokenizer
carries a ChatML template with tools, as Qwen's does)."""

from __future__ import annotations

import pytest

from tests.api.test_anthropic_prompt import TOOLS_TEMPLATE

from .fresh_app import fresh_server

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather now",
        "input_schema": {"type": "object"},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
]


@pytest.fixture(scope="module")
def tools_server():
    import copy
    import dataclasses

    from kvreuse.models.tiny import tiny_model

    base = tiny_model("llama", seed=0)
    tokenizer = copy.deepcopy(base.tokenizer)  # tiny_model's tokenizer is shared (cached): never change it
    tokenizer.chat_template = TOOLS_TEMPLATE
    loaded = dataclasses.replace(base, tokenizer=tokenizer)
    with fresh_server(loaded, kv_cache_memory_gib=0.02) as (url, engine):
        yield url, engine


def test_tools_round_trip_with_the_official_client(tools_server):
    import anthropic

    url, engine = tools_server
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    first = client.messages.create(
        model="tiny", max_tokens=2, system="sys", tools=TOOLS, messages=MESSAGES, extra_body={"temperature": 0}
    )
    again = client.messages.create(
        model="tiny", max_tokens=2, system="sys", tools=TOOLS, messages=MESSAGES, extra_body={"temperature": 0}
    )
    counted = client.messages.count_tokens(model="tiny", system="sys", tools=TOOLS, messages=MESSAGES).input_tokens
    tok = engine.tokenizer
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object"}},
        }
    ]
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        ],
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tool_response id=t1>sunny</tool_response>" in text and "get_weather: Weather now" in text
    assert counted == len(tok.encode(text, add_special_tokens=False))
    head = len(
        tok.encode(
            tok.apply_chat_template([{"role": "system", "content": "sys"}], tools=tools, tokenize=False),
            add_special_tokens=False,
        )
    )
    # the tools + system head, under the 1h breakpoint: written first, read back after
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == head // 16 * 16
    assert again.usage.cache_read_input_tokens == (counted - 1) // 16 * 16
    assert again.usage.cache_creation_input_tokens == 0
