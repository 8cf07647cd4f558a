"""vLLM's utility routes: /tokenize, /detokenize, /reset_prefix_cache, /version."""

from __future__ import annotations

import asyncio

from kvreuse import __version__

from .fresh_app import fresh_client
from .helpers import BLOCK_SIZE, wait_idle, words


def test_tokenize_gives_the_ids_completions_compute(client, async_engine):
    text = words(40, seed=901)
    tokenizer = async_engine.tokenizer
    expected = list(tokenizer.encode(text))
    body = client.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == expected
    assert body["count"] == len(expected) and body["max_model_len"] == async_engine.max_model_len
    assert (body["block_size"], body["full_blocks"]) == (BLOCK_SIZE, len(expected) // BLOCK_SIZE)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    # the same prompt through /v1/completions reports the same prompt length
    usage = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_tokenize_messages_matches_chat_prompt_tokens(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(12, seed=902)}]
    body = client.post("/tokenize", json={"messages": messages}).json()
    usage = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert body["count"] == usage["prompt_tokens"] == len(body["tokens"])
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert body["tokens"][: without["count"]] == without["tokens"] and without["count"] < body["count"]


def test_detokenize_round_trips_and_names_bad_ids(client, async_engine):
    ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": async_engine.tokenizer.decode(ids)}
    bad = client.post("/detokenize", json={"tokens": [1, async_engine.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert str(async_engine.vocab_size) in bad.json()["error"]["message"]


def test_tokenize_errors_name_the_field(client):
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/tokenize", json={"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert client.get("/version").json() == {"version": __version__}


def test_reset_prefix_cache_drops_cached_blocks_and_the_next_request_misses(tiny_llama):
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.01) as (client, engine):
        prompt = words(100, seed=903)
        first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
        stats = wait_idle(engine)
        cached = stats.num_cached_blocks
        assert cached >= first["prompt_tokens"] // BLOCK_SIZE > 0
        assert client.post("/reset_prefix_cache").json() == {"blocks_dropped": cached}
        after = wait_idle(engine)
        assert after.num_cached_blocks == 0 and after.num_free_blocks == after.num_blocks
        again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
        assert again["prompt_tokens_details"]["cached_tokens"] == 0
        cached_again = wait_idle(engine).num_cached_blocks
        assert cached_again == cached  # the recomputed prompt is cached again, block for block
        assert client.post("/reset_prefix_cache").json() == {"blocks_dropped": cached_again}
        asyncio.run(engine.call(lambda e: e.pool.check_integrity()))


def test_utility_routes_need_the_api_key_except_version(tiny_llama):
    with fresh_client(tiny_llama, api_key="sekrit") as (client, _):
        for path, body in (
            ("/tokenize", {"prompt": "a"}),
            ("/detokenize", {"tokens": [1]}),
            ("/reset_prefix_cache", None),
        ):
            assert client.post(path, json=body).status_code == 401
            assert client.post(path, json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert client.get("/version").status_code == 200
