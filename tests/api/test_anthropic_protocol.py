"""The Messages API request models: strings as blocks, sampling fields, strict validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvreuse.api.anthropic_protocol import CountTokensRequest, MessagesRequest


def test_strings_are_one_text_block_and_sampling_maps_to_the_engine():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 7,
            "system": "sys",
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u"},
            "unknown_future_field": 1,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
            ],
        }
    )
    assert [(b.type, b.text) for b in req.system] == [("text", "sys")]
    assert [(b.type, b.text) for b in req.messages[0].content] == [("text", "hi")]
    assert req.messages[1].content[0].result_text() == "r"
    params = req.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop) == (
        7,
        0.0,
        0.5,
        3,
        ("END",),
    )


def test_count_tokens_needs_no_max_tokens_but_messages_does():
    CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ValidationError) as err:
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert err.value.errors()[0]["loc"] == ("max_tokens",)


@pytest.mark.parametrize(
    ("field", "value", "loc"),
    [
        ("stream", "yes", ("stream",)),
        ("temperature", float("nan"), ("temperature",)),
        ("top_k", -1, ("top_k",)),
        ("metadata", {"user_id": "u" * 257}, ("metadata", "user_id")),
        ("cache_control", {"type": "persistent"}, ("cache_control", "type")),
    ],
)
def test_strict_fields(field, value, loc):
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(ValidationError) as err:
        MessagesRequest.model_validate(body)
    assert err.value.errors()[0]["loc"][: len(loc)] == loc
