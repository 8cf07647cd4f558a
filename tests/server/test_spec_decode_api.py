"""Prompt-lookup speculation through the HTTP API: the ``speculative`` request field, OpenAI's
``usage.completion_tokens_details`` (accepted / rejected prediction tokens), the same greedy
text with and without it on both routes (plain, ``n`` > 1, streamed), and the Prometheus
counters, on a server of its own over the tiny random Llama; the exact figures are those
the engine gives the same request through the Python API."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvreuse import LLM, SamplingParams

from .fresh_app import fresh_client
from .helpers import BLOCK_SIZE, MAX_MODEL_LEN, wait_idle

SPEC = {"speculative_tokens": 5, "speculative_ngram_min": 1, "kv_cache_memory_gib": 0.02}
MAX_TOKENS = 30


def prompt_ids() -> list[int]:
    """Recurring phrases (as tests/engine/test_spec_decode.py's prompts): drafts get accepted."""
    rng = random.Random(5)
    phrase = [rng.randrange(10, 2000) for _ in range(rng.randrange(3, 12))]
    out: list[int] = []
    while len(out) < 40:
        out += phrase if rng.random() < 0.6 else [rng.randrange(10, 2000)]
    return out[:40]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """What the Python API gives the same greedy request with the server's settings."""
    llm = LLM(loaded=tiny_llama, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, **SPEC)
    out = llm.generate(prompt_ids(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
    plain = llm.generate(
        prompt_ids(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, speculative=False)
    )[0]
    assert out.output_token_ids == plain.output_token_ids and plain.num_draft_tokens == 0
    assert out.num_draft_tokens > out.num_accepted_tokens > 0  # both kinds happen on this prompt
    chat_llm = LLM(loaded=tiny_llama, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, **SPEC)
    chat = chat_llm.chat(
        [{"role": "user", "content": chat_text()}],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )[0]
    return out, chat


def chat_text() -> str:
    return "alpha bravo charlie delta alpha bravo charlie delta echo alpha bravo charlie delta"


def details(out) -> dict:
    return {
        "accepted_prediction_tokens": out.num_accepted_tokens,
        "rejected_prediction_tokens": out.num_draft_tokens - out.num_accepted_tokens,
    }


def _samples(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels or set(s.labels) == {"model_name"}
    }


def test_completions_field_usage_and_identical_text(tiny_llama, expected):
    out, _ = expected
    body = {
        "prompt": prompt_ids(),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with fresh_client(tiny_llama, **SPEC) as (client, engine):
        on = client.post("/v1/completions", json=body)
        off = client.post("/v1/completions", json={**body, "speculative": False})
        two = client.post("/v1/completions", json={**body, "n": 2})
        sampled = client.post("/v1/completions", json={**body, "temperature": 0.7, "seed": 1})
        bad = client.post("/v1/completions", json={**body, "speculative": "yes"})
        wait_idle(engine)
        m = _samples(client.get("/metrics").text)
        stats = engine.engine.stats()
    assert on.status_code == off.status_code == two.status_code == sampled.status_code == 200
    on, off, two, sampled = on.json(), off.json(), two.json(), sampled.json()
    assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"] == out.output_token_ids
    assert on["choices"][0]["text"] == off["choices"][0]["text"] == out.text
    assert on["usage"]["completion_tokens_details"] == details(out)
    assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"] == MAX_TOKENS
    assert "completion_tokens_details" not in off["usage"]  # it never drafted
    assert "completion_tokens_details" not in sampled["usage"]  # sampled requests never speculate
    # n = 2: two greedy choices, each the same answer, drafts summed over both
    assert [c["token_ids"] for c in two["choices"]] == [out.output_token_ids] * 2
    assert two["usage"]["completion_tokens_details"] == {k: 2 * v for k, v in details(out).items()}
    assert bad.status_code == 400 and "speculative" in bad.text
    # Prometheus: every draft the server verified (on, n = 2 twice), and the engine's own counters
    assert m["kvreuse:spec_decode_num_draft_tokens_total"] == 3 * out.num_draft_tokens
    assert m["kvreuse:spec_decode_num_accepted_tokens_total"] == 3 * out.num_accepted_tokens
    assert stats.spec_decode_num_draft_tokens == 3 * out.num_draft_tokens
    assert stats.num_used_blocks == 0
    engine.engine.check_integrity()


def test_completions_stream_usage(tiny_llama, expected):
    out, _ = expected
    body = {
        "prompt": prompt_ids(),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    with fresh_client(tiny_llama, **SPEC) as (client, engine):
        lines = [
            line for line in client.post("/v1/completions", json=body).text.splitlines() if line.startswith("data: {")
        ]
    chunks = [json.loads(line[6:]) for line in lines]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert (text, ids) == (out.text, out.output_token_ids)
    assert chunks[-1]["usage"]["completion_tokens_details"] == details(out)
    # fewer chunks than tokens: an accepted run arrives as one chunk
    assert len([c for c in chunks if c["choices"]]) < MAX_TOKENS


def test_chat_field_usage_and_identical_text(tiny_llama, expected):
    _, chat = expected
    body = {
        "messages": [{"role": "user", "content": chat_text()}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    with fresh_client(tiny_llama, **SPEC) as (client, engine):
        on = client.post("/v1/chat/completions", json=body).json()
        off = client.post("/v1/chat/completions", json={**body, "speculative": False}).json()
        stream = client.post(
            "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ).text
        bad = client.post("/v1/chat/completions", json={**body, "speculative": 1})
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"] == chat.text
    assert chat.num_accepted_tokens > 0  # the tiny model's answer loops: drafts get accepted
    assert on["usage"]["completion_tokens_details"] == details(chat)
    assert "completion_tokens_details" not in off["usage"]
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == chat.text
    assert chunks[-1]["usage"]["completion_tokens_details"] == details(chat)
    assert bad.status_code == 400 and "speculative" in bad.text
