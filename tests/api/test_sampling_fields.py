"""Sampling fields are bounded by what the sampler's fp32 arithmetic can honour: every value
that could make a step fail is refused by the request models, naming the field.

The HTTP side (status 400, OpenAI's error shape) is ``tests/server/test_sampling_limits.py``."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvreuse.api.protocol import ChatCompletionRequest, CompletionRequest
from kvreuse.sampling_params import MIN_TOP_P, SamplingParams


def _body(text: str) -> dict:
    """A completions body with ``text`` spliced in, parsed as the server does (``json.loads``
    accepts NaN and Infinity)."""
    return json.loads('{"prompt": "hi", "max_tokens": 2, ' + text + "}")


def _invalid(text: str) -> tuple[str, str, object]:
    """(field, pydantic error type, input) of a body the model refuses."""
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(_body(text))
    error = caught.value.errors()[0]
    return ".".join(str(p) for p in error["loc"]), error["type"], error["input"]


def _refused(text: str) -> str:
    """The ``ValueError`` message ``sampling_params`` raises for a body that validates."""
    with pytest.raises(ValueError) as caught:
        CompletionRequest.model_validate(_body(text)).sampling_params(16)
    return str(caught.value)


@pytest.mark.parametrize(
    ("text", "field", "kind"),
    [
        ('"temperature": NaN', "temperature", "finite_number"),
        ('"temperature": Infinity', "temperature", "finite_number"),
        ('"top_p": NaN', "top_p", "finite_number"),
        ('"top_p": 0', "top_p", "greater_than"),
        ('"presence_penalty": NaN', "presence_penalty", "finite_number"),
        ('"presence_penalty": 2.5', "presence_penalty", "less_than_equal"),
        ('"frequency_penalty": -Infinity', "frequency_penalty", "finite_number"),
        ('"frequency_penalty": -3', "frequency_penalty", "greater_than_equal"),
        ('"repetition_penalty": 0', "repetition_penalty", "greater_than"),
        ('"repetition_penalty": NaN', "repetition_penalty", "finite_number"),
        ('"min_p": 1.5', "min_p", "less_than_equal"),
        ('"min_p": -0.1', "min_p", "greater_than_equal"),
        ('"top_k": -2', "top_k", "greater_than_equal"),
        ('"seed": 9223372036854775808', "seed", "less_than_equal"),
        ('"n": 17', "n", "less_than_equal"),
        ('"max_tokens": 0', "max_tokens", "greater_than_equal"),
    ],
)
def test_out_of_range_numbers_fail_validation_naming_the_field(text, field, kind):
    assert _invalid(text)[:2] == (field, kind)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"top_p": 5e-324', "top_p must be in [1e-37, 1] (smaller rounds to 0 in float32), got 5e-324"),
        ('"top_p": 1e-46', "top_p must be in [1e-37, 1] (smaller rounds to 0 in float32), got 1e-46"),
        (
            '"repetition_penalty": 1.2',
            "repetition_penalty: penalties are not supported; leave repetition_penalty out or 1",
        ),
        ('"min_p": 0.05', "min_p: not supported; leave min_p out or 0"),
        ('"presence_penalty": 0.5', "presence_penalty: penalties are not supported; leave presence_penalty out or 0"),
        ('"logit_bias": {"abc": 1}', "logit_bias: keys must be token ids (non-negative integers), got 'abc'"),
        ('"logit_bias": {"-1": 1}', "logit_bias: keys must be token ids (non-negative integers), got '-1'"),
        ('"logit_bias": {"5": 101}', "logit_bias: the bias of token 5 must be a number in [-100, 100], got 101"),
        ('"logit_bias": {"5": NaN}', "logit_bias: the bias of token 5 must be a number in [-100, 100], got nan"),
        ('"logit_bias": {"5": -Infinity}', "logit_bias: the bias of token 5 must be a number in [-100, 100], got -inf"),
        ('"logit_bias": {"5": true}', "logit_bias: the bias of token 5 must be a number in [-100, 100], got True"),
        ('"logit_bias": {"5": 100}', "logit_bias: not supported; leave logit_bias out or empty"),
        ('"stop": ""', "stop must be a string or a list of non-empty strings"),
        ('"stop": ["a", ""]', "stop must be a string or a list of non-empty strings"),
        ('"stop": ["a", "b", "c", "d", "e"]', "stop accepts at most 4 sequences, got 5"),
        ('"stop": ["a", "' + "x" * 1025 + '"]', "stop strings must be at most 1024 characters, got one of 1025"),
    ],
)
def test_values_the_sampler_cannot_honour_are_refused_with_a_reason(text, message):
    assert _refused(text) == message


@pytest.mark.parametrize(
    "text",
    [
        f'"top_p": {MIN_TOP_P}',
        '"temperature": 1e-300',
        '"temperature": 0',
        '"top_k": -1',
        '"top_k": 100000000000000000000000',
        '"repetition_penalty": 1.0',
        '"min_p": 0',
        '"presence_penalty": 0',
        '"logit_bias": {}',
        '"stop": ["' + "x" * 1024 + '"]',
        '"seed": -9223372036854775808',
    ],
)
def test_edge_values_the_sampler_can_honour_are_accepted(text):
    CompletionRequest.model_validate(_body(text)).sampling_params(16)


def test_a_tiny_temperature_samples_greedily():
    params = CompletionRequest.model_validate(_body('"temperature": 1e-300')).sampling_params(16)
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy


def test_chat_bodies_get_the_same_checks():
    chat = {"messages": [{"role": "user", "content": "hi"}], "top_p": 5e-324}
    with pytest.raises(ValueError, match=r"^top_p must be in \[1e-37, 1\]"):
        ChatCompletionRequest.model_validate(chat).sampling_params(16)
    with pytest.raises(ValidationError, match="finite number"):
        ChatCompletionRequest.model_validate({**chat, "top_p": float("nan")})
