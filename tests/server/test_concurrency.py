"""A live uvicorn server (real sockets): concurrent streaming clients and disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from .helpers import wait_idle, words

MAX_TOKENS = 12


def _request(i: int, stream: bool) -> tuple[str, dict]:
    """Even clients use completions, odd ones chat; greedy, ``ignore_eos`` so every answer
    has exactly ``MAX_TOKENS`` tokens."""
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if i % 2 == 0:
        return "/v1/completions", {**common, "prompt": words(24 + 6 * i, 100 + i)}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words(20 + 6 * i, 100 + i)}]}


def _text(path: str, choice: dict, streamed: bool) -> str:
    if path == "/v1/completions":
        return choice["text"]
    return choice["delta"].get("content", "") if streamed else choice["message"]["content"]


def test_16_concurrent_streaming_clients_get_complete_correct_answers(client, live_url, async_engine):
    expected = []
    for i in range(16):  # the reference: one request at a time, not streamed
        path, body = _request(i, stream=False)
        expected.append(_text(path, client.post(path, json=body).json()["choices"][0], streamed=False))

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, str | None, bool]:
        path, body = _request(i, stream=True)
        text, finish, done = "", None, False
        async with http.stream("POST", live_url + path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    text += _text(path, choice, streamed=True)
                    finish = choice["finish_reason"] or finish
        return text, finish, done

    async def all_clients():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(16)))

    results = asyncio.run(all_clients())
    for i, (text, finish, done) in enumerate(results):
        assert done and finish == "length", (i, finish, done)
        assert text == expected[i], i
    stats = wait_idle(async_engine)
    assert stats.num_used_blocks == 0
    asyncio.run(async_engine.check_integrity())


def _finished_count(client, reason: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvreuse:request_success_total") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def paced(async_engine, monkeypatch):
    """The tiny model decodes 200 tokens in well under a second; pace it like a real model so
    a request is certainly still running when its client goes away."""
    step = async_engine.engine.step

    def paced_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(async_engine.engine, "step", paced_step)
    wait_idle(async_engine)
    return async_engine


def test_client_disconnect_mid_stream_frees_its_blocks(client, live_url, paced):
    async_engine = paced
    finished_before = _finished_count(client, "length")
    body = {"prompt": words(100, 300), "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", live_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break
        busy = async_engine.stats()
        assert busy.num_used_blocks > 0 and busy.num_running == 1, busy
    # Leaving both blocks closed the socket mid-stream: the request must be aborted.
    after = wait_idle(async_engine)
    asyncio.run(async_engine.check_integrity())
    assert after.num_used_blocks == 0
    assert after.num_free_blocks + after.num_cached_blocks == after.num_blocks  # idle: nothing held
    assert _finished_count(client, "length") == finished_before  # aborted, never ran to max_tokens
    assert async_engine.integrity_error is None
    r = client.post("/v1/completions", json={"prompt": "after the disconnect", "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_disconnect_before_a_whole_response_aborts_it(client, live_url, paced, path):
    """Not streaming: the client gives up while the request runs; it is aborted too."""
    async_engine = paced
    finished_before = _finished_count(client, "length")
    body = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = words(100, 301)
    else:
        body["messages"] = [{"role": "user", "content": words(100, 302)}]
    with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post(live_url + path, json=body)  # gives up after 0.5 s of a ~4 s request
    after = wait_idle(async_engine, timeout=10)
    asyncio.run(async_engine.check_integrity())
    assert after.num_used_blocks == 0
    assert _finished_count(client, "length") == finished_before  # aborted, never ran to max_tokens
