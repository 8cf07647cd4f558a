"""Logprobs over HTTP: completions (``logprobs: k``) and chat (``logprobs`` + ``top_logprobs``),
whole and streamed, against a plain transformers forward of the same tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch

from kvreuse.api.chat_prompt import render_chat
from kvreuse.api.protocol import ChatCompletionRequest

from .helpers import words


def _sse(response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], n: int) -> list[tuple[int, torch.Tensor]]:
    """``n`` greedy steps of a plain forward: (token, log_softmax row) per output token."""
    ids, steps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
        token = int(torch.argmax(logp))
        steps.append((token, logp))
        ids.append(token)
    return steps


def test_completion_logprobs_match_a_plain_forward(client, async_engine, tiny_llama):
    tok = async_engine.tokenizer
    prompt = tok.encode(words(30, 101))
    r = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    ref = greedy_reference(tiny_llama.model, prompt, 5)
    assert lp["tokens"] == [tok.decode([t]) for t, _ in ref]
    offset = 0
    for i, (token, logp) in enumerate(ref):
        assert abs(lp["token_logprobs"][i] - logp[token].item()) <= 1e-4
        top = lp["top_logprobs"][i]
        assert lp["token_logprobs"][i] == max(top.values())
        expected = torch.topk(logp, 3)
        assert list(top) == [tok.decode([t]) for t in expected.indices.tolist()]  # exactly k, most likely first
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert torch.allclose(torch.tensor(list(top.values())), expected.values, atol=1e-4)
        assert lp["text_offset"][i] == offset
        offset += len(lp["tokens"][i])


def test_chat_logprobs_match_a_plain_forward(client, async_engine, tiny_llama):
    tok = async_engine.tokenizer
    messages = [{"role": "user", "content": words(24, 102)}]
    body = {
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 4,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    prompt = render_chat(tok, ChatCompletionRequest(messages=messages).messages).token_ids
    ref = greedy_reference(tiny_llama.model, prompt, 4)
    assert len(content) == 4
    for entry, (token, logp) in zip(content, ref):
        assert entry["token"] == tok.decode([token])
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert abs(entry["logprob"] - logp[token].item()) <= 1e-4
        top = entry["top_logprobs"]
        assert len(top) == 4 and entry["logprob"] == top[0]["logprob"] == max(t["logprob"] for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert [t["token"] for t in top] == [tok.decode([t]) for t in torch.topk(logp, 4).indices.tolist()]


def test_chat_logprobs_without_top_logprobs_lists_none(client):
    body = {
        "messages": [{"role": "user", "content": words(10, 103)}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
    }
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(entry["top_logprobs"] == [] for entry in content)


def test_no_logprobs_asked_returns_null(client):
    r = client.post("/v1/completions", json={"prompt": words(10, 104), "max_tokens": 2, "temperature": 0})
    assert r.json()["choices"][0]["logprobs"] is None
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_equal_the_whole_response(client):
    body = {"prompt": words(40, 105), "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2, "n": 2}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = _sse(r)
    for index in (0, 1):
        parts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        merged = {key: sum((p["logprobs"][key] for p in parts), []) for key in whole["choices"][index]["logprobs"]}
        expected = whole["choices"][index]["logprobs"]
        assert merged["tokens"] == expected["tokens"] and merged["text_offset"] == expected["text_offset"]
        assert merged["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-4)
        assert [list(t) for t in merged["top_logprobs"]] == [list(t) for t in expected["top_logprobs"]]
        assert "".join(p["text"] for p in parts) == whole["choices"][index]["text"]


def test_streamed_chat_logprobs_equal_the_whole_response(client):
    body = {
        "messages": [{"role": "user", "content": words(30, 106)}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [c for c in _sse(r) if c["choices"]]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role-only opening chunk
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-4)
    assert [[t["token"] for t in e["top_logprobs"]] for e in streamed] == [
        [t["token"] for t in e["top_logprobs"]] for e in whole
    ]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "echo": True}, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ],
)
def test_bad_logprobs_fields_are_400s_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
