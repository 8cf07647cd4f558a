"""Every bad input gets a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import pytest

from .helpers import MAX_MODEL_LEN, words


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def _still_serving(client) -> None:
    r = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_malformed_json(client):
    r = client.post(
        "/v1/completions", content=b'{"prompt": "x", "max_tokens": ', headers={"content-type": "application/json"}
    )
    err = _error(r, 400)
    assert err == {
        "message": "request body is not valid JSON: Expecting value: line 1 column 31 (char 30)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    _still_serving(client)


def test_bodies_that_do_not_parse_name_the_body(client):
    # The same messages as the router's (kvreuse.api.body), never FastAPI's generic one.
    cases = {
        b'{"prompt": '
        + b"[" * 30_000
        + b"]" * 30_000
        + b"}": "request body: JSON is nested too deeply (arrays or objects about 1000 levels deep)",
        b'{"prompt": "\xff"}': "request body is not valid UTF-8 (byte 12 of 15: 0xff)",
    }
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body, message in cases.items():
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert _error(r, 400) == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    _still_serving(client)


def test_the_api_description_needs_the_key(async_engine):
    from fastapi.testclient import TestClient

    from kvreuse.server.api_server import build_app

    with TestClient(build_app(async_engine, api_key="sekrit", served_model_name="tiny")) as c:
        assert _error(c.get("/openapi.json"), 401)["code"] == "invalid_api_key"
        assert c.get("/openapi.json", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/dashboard").status_code == 200  # the page holds no data


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": 123}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "cache_salt": 7}, "cache_salt"),
        ("/v1/completions", {"prompt": "x", "kv_cache_retention_config": [1]}, "kv_cache_retention_config"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ],
)
def test_wrong_types_name_the_field(client, path, body, param):
    err = _error(client.post(path, json=body), 400)
    assert err["param"] == param and err["message"].startswith(param), err
    _still_serving(client)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_negative_max_tokens(client, path):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    err = _error(client.post(path, json={**body, "max_tokens": -5}), 400)
    assert err["param"] == "max_tokens" and "-5" in err["message"]
    _still_serving(client)


def test_prompt_longer_than_the_context(client):
    err = _error(client.post("/v1/completions", json={"prompt": words(3 * MAX_MODEL_LEN, 20), "max_tokens": 4}), 400)
    assert err["param"] == "prompt" and str(MAX_MODEL_LEN) in err["message"]
    ids = list(range(100, 100 + MAX_MODEL_LEN - 2))
    err = _error(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 10}), 400)
    assert err["param"] == "max_tokens"
    chat = {"messages": [{"role": "user", "content": words(3 * MAX_MODEL_LEN, 21)}], "max_tokens": 4}
    assert _error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "messages"
    _still_serving(client)


def test_token_ids_outside_the_vocabulary(client):
    err = _error(client.post("/v1/completions", json={"prompt": [1, 2, 10**9], "max_tokens": 2}), 400)
    assert "prompt" in err["message"]
    _still_serving(client)


def test_unknown_model(client):
    err = _error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    assert _error(client.post("/v1/chat/completions", json=chat), 404)["code"] == "model_not_found"
    _still_serving(client)


def test_unknown_route_and_method(client):
    err = _error(client.post("/v1/nothing"), 404)
    assert (err["type"], err["message"]) == ("invalid_request_error", "Invalid URL (POST /v1/nothing)")  # OpenAI's
    assert _error(client.get("/v1/completions"), 405)["message"] == "Invalid URL (GET /v1/completions)"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"  # client.models.retrieve
    assert _error(client.get("/v1/models/other"), 404)["code"] == "model_not_found"


def test_body_size_limit(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x" * 70_000}), 413)
    assert err["code"] == "request_too_large"
    _still_serving(client)


def test_api_key(async_engine):
    from fastapi.testclient import TestClient

    from kvreuse.server.api_server import build_app

    app = build_app(async_engine, api_key="sekrit", served_model_name="tiny")
    with TestClient(app) as c:
        body = {"prompt": "x", "max_tokens": 2}
        assert _error(c.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert _error(c.post("/v1/completions", json=body, headers=wrong), 401)["code"] == "invalid_api_key"
        assert _error(c.get("/v1/models", headers=wrong), 401)
        right = {"Authorization": "Bearer sekrit"}
        assert c.post("/v1/completions", json=body, headers=right).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key
        assert c.get("/metrics").status_code == 200


def test_more_bad_fields_name_the_right_param(client):
    cases = [
        ({"prompt": [-1], "echo": True, "max_tokens": 1}, "prompt", "vocabulary"),
        ({"prompt": [10**12], "max_tokens": 1}, "prompt", "vocabulary"),
        ({"prompt": "a", "seed": 2**70}, "seed", None),
        ({"prompt": "a", "suffix": "b"}, "suffix", "suffix"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": ["a"] * 300, "max_tokens": 1}, "prompt", "at most 256"),
        ({"prompt": "a", "stop_token_ids": [10**12]}, "stop_token_ids", "vocabulary"),
    ]
    for body, param, needle in cases:
        err = _error(client.post("/v1/completions", json=body), 400)
        assert err["param"] == param, (body, err)
        assert needle is None or needle in err["message"], (body, err)
    messages = [{"role": "user", "content": "hi"}]
    err = _error(
        client.post(
            "/v1/chat/completions",
            json={"messages": messages, "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}},
        ),
        400,
    )
    assert err["param"] == "chat_template_kwargs" and "own chat template" in err["message"]
    err = _error(
        client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"chat_template": "X"}}), 400
    )
    assert err["param"] == "chat_template_kwargs"
    _still_serving(client)


def test_value_error_param_matches_whole_words_only():
    from kvreuse.server.errors import from_value_error

    assert from_value_error(ValueError("unknown schema 'nope' (known: none)")).param is None
    assert from_value_error(ValueError("n must be between 1 and 16")).param == "n"
    assert from_value_error(ValueError("stop_token_ids: bad")).param == "stop_token_ids"  # not "stop"
    assert from_value_error(ValueError("max_tokens=3 is too many")).param == "max_tokens"


def test_explicit_nulls_mean_the_defaults(client):
    """OpenAI clients send null for optional fields they do not set."""
    nulls = {
        "temperature": None,
        "top_p": None,
        "n": None,
        "stream": None,
        "top_k": None,
        "ignore_eos": None,
        "seed": None,
        "stop": None,
        "stream_options": None,
        "max_tokens": 2,
    }
    r = client.post("/v1/completions", json={"prompt": "hi", "echo": None, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "logprobs": None, "top_logprobs": 0, **nulls},
    )
    assert r.status_code == 200, r.text
    assert _error(client.post("/v1/completions", json={"prompt": None}), 400)["param"] == "prompt"


def test_unimplemented_openai_fields_are_refused_unless_neutral(client):
    messages = [{"role": "user", "content": "hi"}]
    refused = [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
    ]
    for extra, param in refused:
        err = _error(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra}), 400)
        assert err["param"] == param, (extra, err)
    neutral = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "best_of": 1,
        "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
        "seed": 2**63 - 1,
        "n": 2,
    }
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **{**neutral, "best_of": 2}})
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_is_a_400_naming_the_field_not_tokenizer_internals(client):
    cases = [
        (
            "/v1/completions",
            b'{"prompt": "ok \\ud800 x", "max_tokens": 1}',
            "prompt: text contains a lone UTF-16 surrogate (\\ud800 at character 3); send valid Unicode",
            "prompt",
        ),
        (
            "/v1/completions",
            b'{"prompt": ["fine", "\\udfff"], "max_tokens": 1}',
            "prompt: text contains a lone UTF-16 surrogate (\\udfff at character 0); send valid Unicode",
            "prompt",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}, '
            b'{"role": "assistant", "content": "a\\ud83d"}], "max_tokens": 1}',
            "messages[1].content: text contains a lone UTF-16 surrogate (\\ud83d at character 1); send valid Unicode",
            "messages[1].content",
        ),
    ]
    for path, body, message, param in cases:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert _error(r, 400) == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    _still_serving(client)


def test_n_times_prompts_is_capped(client):
    r = client.post("/v1/completions", json={"prompt": ["a"] * 200, "n": 2, "max_tokens": 1})
    assert _error(r, 400) == {
        "message": "n: 2 samples x 200 prompts = 400 sequences; at most 256 per request (lower n or split the prompts)",
        "type": "invalid_request_error",
        "param": "n",
        "code": None,
    }
    ok = client.post("/v1/completions", json={"prompt": ["a"] * 16, "n": 16, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


def test_chat_without_max_tokens_on_a_small_pool_fills_what_fits(tiny_llama):
    from .fresh_app import fresh_client

    # 13 blocks of 16 = 208 pool tokens under a 1024-token context: the default reply is what
    # the pool holds (208 - prompt + 1: the last token needs no slot), not a 400 on max_tokens.
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.0001, max_model_len=1024) as (c, engine):
        assert engine.pool_tokens == 208
        messages = [{"role": "user", "content": "hello"}]
        r = c.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 208 - usage["prompt_tokens"] + 1
        assert r.json()["choices"][0]["finish_reason"] == "length"
        long = [{"role": "user", "content": "word " * 300}]
        err = _error(c.post("/v1/chat/completions", json={"messages": long}), 400)
        assert err["param"] == "messages" and err["message"].endswith(
            "tokens but the KV pool holds 208: shorten it or raise --kv-cache-memory"
        )


def test_chat_on_a_model_without_a_chat_template_says_so(tiny_llama):
    import copy
    import dataclasses

    from .fresh_app import fresh_client

    tokenizer = copy.deepcopy(tiny_llama.tokenizer)  # the fixture's is shared: never mutate it
    tokenizer.chat_template = None
    with fresh_client(dataclasses.replace(tiny_llama, tokenizer=tokenizer)) as (c, _):
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert _error(r, 400) == {
            "message": "messages: this model has no chat template, so it cannot take chat messages; "
            "send the text to /v1/completions as a prompt",
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
