"""The OpenAI API in process (FastAPI TestClient) over the real engine and tiny model."""

from __future__ import annotations

import json

from .helpers import BLOCK_SIZE, words


def _sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_reports_usage_with_cached_tokens(client):
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": words(40, 1), "max_tokens": 5, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_same_long_prompt_twice_hits_the_prefix_cache(client):
    prompt = words(300, 2)
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
    second = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
    n = first["usage"]["prompt_tokens"]
    assert n > 10 * BLOCK_SIZE
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - BLOCK_SIZE
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # a hit changes nothing


def test_different_cache_salts_share_nothing(client):
    prompt = words(200, 3)

    def cached(salt):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
        return client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same text, other tenant: no reuse
    assert cached(None) == 0  # unsalted is a tenant of its own
    assert cached("tenant-a") >= 10 * BLOCK_SIZE


def test_prompt_as_list_of_strings_and_token_ids(client, async_engine):
    ids = async_engine.tokenizer.encode(words(20, 4))
    r = client.post(
        "/v1/completions", json={"prompt": [words(20, 5), words(20, 6)], "max_tokens": 2, "n": 1, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0}).json()
    by_text = client.post("/v1/completions", json={"prompt": words(20, 4), "max_tokens": 3, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    nested = client.post("/v1/completions", json={"prompt": [ids, ids[:10]], "max_tokens": 2, "temperature": 0})
    assert nested.status_code == 200 and len(nested.json()["choices"]) == 2


def test_completion_stream_chunks_usage_and_done(client):
    body = {
        "prompt": words(30, 7),
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    whole = client.post("/v1/completions", json={"prompt": words(30, 7), "max_tokens": 6, "temperature": 0}).json()
    assert streamed == whole["choices"][0]["text"]
    assert usage_chunk["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 6


def test_chat_completion_and_stream(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": words(20, 8)}]
    r = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert "cached_tokens" in whole["usage"]["prompt_tokens_details"]
    body = {
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        events = _sse_events(s)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-2]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    # The second identical chat reuses the prompt's full blocks.
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        whole["usage"]["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
    )


def test_retention_config_accepted_and_validated(client):
    good = {
        "token_range_retention_configs": [{"token_start": 0, "token_end": 32, "priority": 90, "duration_ms": 1000}],
        "decode_retention_priority": 10,
    }
    r = client.post(
        "/v1/completions", json={"prompt": words(40, 9), "max_tokens": 2, "kv_cache_retention_config": good}
    )
    assert r.status_code == 200, r.text
    bad = {"token_range_retention_configs": [{"token_start": 0, "token_end": 32, "priority": 101}]}
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "kv_cache_retention_config": bad})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "kv_cache_retention_config" and "priority" in err["message"]
    messages = [
        {"role": "system", "content": "tools", "retention": {"priority": 90, "duration_ms": 30000}},
        {"role": "user", "content": "hello"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    messages[0]["retention"] = {"priority": -1}
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and "messages[0].retention.priority" in r.json()["error"]["message"]


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/v1/completions", json={"prompt": words(40, 10), "max_tokens": 3})
    text = client.get("/metrics").text
    for name in (
        "kvreuse:prefix_cache_queries_total",
        "kvreuse:prefix_cache_hits_total",
        "kvreuse:prefix_cache_hit_rate",
        "kvreuse:num_blocks_free",
        "kvreuse:num_blocks_cached",
        "kvreuse:num_blocks_used",
        "kvreuse:num_requests_running",
        "kvreuse:num_requests_waiting",
        "kvreuse:time_to_first_token_seconds_bucket",
        "kvreuse:inter_token_latency_seconds_bucket",
        "kvreuse:prompt_tokens_computed_total",
        "kvreuse:prompt_tokens_reused_total",
        "kvreuse:blocks_by_priority",
    ):
        assert name in text, name
    queries = [line for line in text.splitlines() if line.startswith("kvreuse:prefix_cache_queries_total")]
    assert float(queries[0].rsplit(" ", 1)[1]) > 0
