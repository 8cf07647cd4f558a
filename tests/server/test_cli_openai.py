"""``kvreuse serve`` as a real subprocess, driven by the official ``openai`` client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_process import free_port, running_server

from .helpers import BLOCK_SIZE, words

API_KEY = "test-key"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [
        "--model",
        "tiny:llama",
        "--kv-cache-memory",
        "0.02",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--api-key",
        API_KEY,
        "--log-level",
        "info",
    ]
    with running_server(free_port(), args, log) as url:
        yield url, log


def test_startup_prints_address_and_pool(served):
    url, log = served
    text = log.read_text()
    assert url in text and "KV pool:" in text and "blocks" in text and "GiB" in text and "bytes/token" in text


def test_openai_client_completions_and_chat(served):
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]

    prompt = words(200, 500)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - BLOCK_SIZE

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - BLOCK_SIZE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(30, 501)}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, extra_body={"cache_salt": "tenant-1"}
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True, extra_body={"cache_salt": "tenant-1"}
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


def test_openai_client_errors(served):
    import openai

    url, _ = served
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong").completions.create(model="tiny", prompt="x")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_the_key_never_reaches_the_access_log_and_the_api_description_needs_it(served):
    url, log = served
    assert httpx.get(f"{url}/dashboard?api_key={API_KEY}&x=1").status_code == 200
    assert httpx.get(f"{url}/openapi.json").status_code == 401
    assert httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    deadline = time.monotonic() + 10
    while "GET /openapi.json HTTP/1.1\" 200" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert '"GET /dashboard?api_key=***&x=*** HTTP/1.1" 200' in text
    assert '"GET /openapi.json HTTP/1.1" 401' in text
    assert API_KEY not in text


def test_serve_startup_line_names_the_resolved_dtype_and_quantization(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvreuse",
                "serve",
                "--model",
                "tiny:llama",
                "--dtype",
                "auto",
                "--quantization",
                "int4",
                "--port",
                str(port),
                "--kv-cache-memory",
                "0.01",
            ],
            env=ENV,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and "listening on" not in log.read_text():
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    line = next(ln for ln in log.read_text().splitlines() if "kvreuse: model" in ln)
    print(line)
    assert ", auto," not in line, line  # says the flag, not what it resolved to (bfloat16 / float32)
    assert "int4" in line, line  # the quantization in use is not reported at all
