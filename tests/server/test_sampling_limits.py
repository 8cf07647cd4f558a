"""Issue 31, finding 1 over HTTP: sampling values the fp32 sampler cannot honour are a 400 in
OpenAI's error shape naming the field, on both endpoints, and greedy answers stay the same.
(The models' side, value by value: ``tests/api/test_sampling_fields.py``.)"""

from __future__ import annotations

import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "the tide came in over the", "max_tokens": 6, "temperature": 0}


def _post_raw(client, path: str, body: str):
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("field", "raw", "message"),
    [
        ("top_p", "5e-324", "top_p must be in [1e-37, 1] (smaller rounds to 0 in float32), got 5e-324"),
        ("top_p", "1e-46", "top_p must be in [1e-37, 1] (smaller rounds to 0 in float32), got 1e-46"),
        ("top_p", "NaN", "top_p: Input should be a finite number (got nan)"),
        ("temperature", "Infinity", "temperature: Input should be a finite number (got inf)"),
        ("temperature", "NaN", "temperature: Input should be a finite number (got nan)"),
        ("presence_penalty", "-Infinity", "presence_penalty: Input should be a finite number (got -inf)"),
        ("frequency_penalty", "2.5", "frequency_penalty: Input should be less than or equal to 2 (got 2.5)"),
        (
            "repetition_penalty",
            "1.3",
            "repetition_penalty: penalties are not supported; leave repetition_penalty out or 1",
        ),
        ("min_p", "0.1", "min_p: not supported; leave min_p out or 0"),
        ("logit_bias", '{"5": NaN}', "logit_bias: the bias of token 5 must be a number in [-100, 100], got nan"),
        ("logit_bias", '{"x": 1}', "logit_bias: keys must be token ids (non-negative integers), got 'x'"),
        ("stop", '["a", ""]', "stop must be a string or a list of non-empty strings"),
        ("top_k", "-2", "top_k: Input should be greater than or equal to -1 (got -2)"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_values_the_sampler_cannot_honour_are_a_400_naming_the_field(client, path, field, raw, message):
    base = (
        '{"prompt": "hi", "max_tokens": 2'
        if path == "/v1/completions"
        else '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
    )
    r = _post_raw(client, path, f'{base}, "{field}": {raw}}}')
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": field, "code": None}}


def test_greedy_answers_are_the_same_before_and_after_the_refusals(client):
    before = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    for raw in ("5e-324", "1e-46"):
        for _ in range(3):
            assert _post_raw(client, "/v1/completions", '{"prompt": "x", "top_p": ' + raw + "}").status_code == 400
    assert client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"] == before
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 1e-300, "top_p": 1e-37})  # honoured: greedy
    assert r.status_code == 200, r.text
    greedy = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).json()
    assert r.json()["choices"][0]["message"] == greedy["choices"][0]["message"]
