"""``kvreuse route`` in front of two executors (real processes): Anthropic's /v1/messages proxied,
streams included, with the official client; prompt_cache_key keeps each agent on one executor."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from .cluster import executor, free_port, router, wait_healthy

EXECUTOR_HEADER = "x-kvreuse-executor"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("cluster"))
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    execs = [executor(port, logs).start() for port in ports]
    rr_port = free_port()
    procs = list(execs)
    try:
        for url in urls:
            wait_healthy(url, execs, timeout=300)
        procs.append(router(rr_port, urls, logs, "--routing-policy", "round_robin").start())
        base = f"http://127.0.0.1:{rr_port}"
        wait_healthy(base, procs, all_of=2)
        yield base
    finally:
        for p in reversed(procs):
            p.stop()


def test_the_official_client_through_the_router(routed):
    import anthropic

    client = anthropic.Anthropic(base_url=routed, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Name three rivers."}]
    msg = client.messages.create(model="tiny-llama-s0", max_tokens=5, messages=messages, extra_body=GREEDY)
    assert msg.type == "message" and msg.usage.output_tokens <= 5
    with client.messages.stream(model="tiny-llama-s0", max_tokens=5, messages=messages, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in msg.content) and final.stop_reason == msg.stop_reason
    counted = client.messages.count_tokens(model="tiny-llama-s0", messages=messages)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    with pytest.raises(anthropic.NotFoundError) as missing:  # the executor's own 404, passed through
        client.messages.create(model="claude-x", max_tokens=5, messages=messages)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:  # the router's own 400 (not JSON), rewritten
        client.post("/v1/messages", body=None, cast_to=object, options={"headers": {"content-type": "text/plain"}})
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"


def test_prompt_cache_key_keeps_each_agent_on_one_executor(routed):
    placed: dict[str, Counter] = {}
    for step in range(5):
        for agent in range(4):
            key = f"agent-{agent}"
            if step % 2:
                body = {
                    "model": "tiny-llama-s0",
                    "max_tokens": 1,
                    "prompt_cache_key": key,
                    "messages": [{"role": "user", "content": f"agent {agent} step {step}"}],
                }
                r = httpx.post(f"{routed}/v1/messages", json=body, timeout=60)
            else:
                body = {
                    "max_tokens": 1,
                    "prompt_cache_key": key,
                    "messages": [{"role": "user", "content": f"agent {agent} step {step}"}],
                }
                r = httpx.post(f"{routed}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            placed.setdefault(key, Counter())[r.headers[EXECUTOR_HEADER]] += 1
    # round robin alone would alternate every request; each key stays where its first went
    assert all(len(where) == 1 for where in placed.values()), placed
    assert len({next(iter(where)) for where in placed.values()}) == 2  # and the keys share both executors
