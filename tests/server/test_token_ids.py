"""vLLM's ``return_token_ids`` extension, streamed and not, completions and chat: the prompt's
ids once, the generated ids behind each chunk's text (what a router needs to continue a
stream on another executor), nothing of it unless asked."""

from __future__ import annotations

import json

from .helpers import words

PML_SCHEMA = """<schema name="tokids">
  <system>Answer briefly.</system>
  <module name="doc">The kiln at Vass fires pots on Fridays.</module>
</schema>"""


def _events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completions_return_the_prompt_and_generated_ids(client, async_engine):
    tok = async_engine.tokenizer
    prompts = [words(30, 41), words(20, 42)]
    body = {
        "prompt": prompts,
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "n": 2,
        "return_token_ids": True,
    }
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == tok.encode(prompts[c["index"] // 2])
        assert len(c["token_ids"]) == 12 and tok.decode(c["token_ids"], skip_special_tokens=True) == c["text"]

    events = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]"
    ids: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    firsts: dict[int, list[int]] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        if "prompt_token_ids" in c:
            assert c["index"] not in firsts and c["index"] not in ids  # once, on the choice's first chunk
            firsts[c["index"]] = c["prompt_token_ids"]
        ids.setdefault(c["index"], []).extend(c["token_ids"])
        text[c["index"]] = text.get(c["index"], "") + c["text"]
    for c in whole["choices"]:  # greedy: the stream's ids and text are the whole response's
        assert firsts[c["index"]] == c["prompt_token_ids"]
        assert (ids[c["index"]], text[c["index"]]) == (c["token_ids"], c["text"])


def test_chat_returns_the_rendered_prompts_ids_once(client, async_engine):
    body = {
        "messages": [{"role": "user", "content": words(24, 43)}],
        "max_tokens": 10,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = client.post("/v1/chat/completions", json=body).json()
    (choice,) = whole["choices"]
    assert len(choice["token_ids"]) == 10 and whole["usage"]["prompt_tokens"] == len(whole["prompt_token_ids"])
    rendered = client.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    assert whole["prompt_token_ids"] == rendered
    events = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert events[0]["prompt_token_ids"] == rendered and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum("prompt_token_ids" in e for e in events[:-1]) == 1
    streamed = [t for e in events[1:-1] for t in e["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == choice["message"]["content"]


def test_without_the_field_no_ids_are_sent(client):
    body = {"prompt": words(10, 44), "max_tokens": 4, "temperature": 0.0, "stream": True}
    raw = client.post("/v1/completions", json=body).text
    assert "token_ids" not in raw
    raw = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    ).text
    assert "token_ids" not in raw


def test_a_pml_prompt_has_no_token_prompt_to_report(client):
    assert client.post("/v1/schemas", json={"schema": PML_SCHEMA}).status_code == 200
    prompt = '<prompt schema="tokids"><doc/><user>When?</user></prompt>'
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "return_token_ids": True}).json()
    assert r["choices"][0]["prompt_token_ids"] is None and len(r["choices"][0]["token_ids"]) >= 1
    events = _events(
        client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 3,
                "stream": True,
                "return_token_ids": True,
            },
        )
    )
    assert events[0]["prompt_token_ids"] is None
