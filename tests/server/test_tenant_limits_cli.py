"""``kvreuse serve --tenant-limits FILE`` as a real subprocess: a bad file stops it before the
model loads, with the setting named; a tenant over its tokens per minute gets a 429 the
official client raises as ``RateLimitError``, with ``Retry-After``; a streaming client that
disconnects over a real socket leaves no slot behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.serve_process import free_port, running_server

LIMITS = """
[tenants.acme]
tokens_per_minute = 100

[tenants.globex]
max_in_flight = 1
"""
KEYS = ["--api-key", "admin-key", "--api-key", "acme-key:acme", "--api-key", "globex-key:globex"]
PROMPT = [(i * 71) % 1600 + 200 for i in range(40)]
ADMIN = {"Authorization": "Bearer admin-key"}  # tenant names on /metrics need the admin key


def _in_flight(url: str, tenant: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers=ADMIN, timeout=10).text.splitlines():
        if line.startswith(f'kvreuse:tenant_requests_in_flight{{tenant="{tenant}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_bad_limits_file_stops_the_server_before_the_model_loads(tmp_path):
    bad = tmp_path / "limits.toml"
    bad.write_text("[tenants.acme]\ntokens_per_minute = -1\n")
    # a model that cannot load: the limits' error comes first, or the model's would
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvreuse",
            "serve",
            "--model",
            str(tmp_path / "none.gguf"),
            "--tenant-limits",
            str(bad),
            *KEYS,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 2
    assert (
        f'kvreuse serve: --tenant-limits {bad}: tenants.acme.tokens_per_minute: expected a whole number >= 1 or '
        '"unlimited", got -1'
    ) in done.stderr


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits")
    (folder / "limits.toml").write_text(LIMITS)
    args = [
        "--model",
        "tiny:llama",
        "--kv-cache-memory",
        "0.02",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--tenant-limits",
        str(folder / "limits.toml"),
        *KEYS,
        "--log-level",
        "warning",
    ]
    with running_server(free_port(), args, folder / "serve.log") as url:
        yield url


def test_a_tenant_over_its_tokens_per_minute_gets_a_rate_limit_error(served):
    acme = openai.OpenAI(base_url=served + "/v1", api_key="acme-key", max_retries=0)
    first = acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, extra_body={"ignore_eos": True})
    assert first.usage.total_tokens == 70  # 30 of 100 left, refilling at 100/60 a second
    with pytest.raises(openai.RateLimitError) as refused:
        acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=30)
    assert refused.value.status_code == 429
    assert refused.value.body["code"] == "rate_limit_exceeded" and refused.value.body["type"] == "tokens"
    assert refused.value.body["message"].startswith(
        "Rate limit reached for tenant acme on tokens per minute: limit 100, available "
    )
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 24  # (70 - 30) tokens at 100/60 per s at most
    admin = openai.OpenAI(base_url=served + "/v1", api_key="admin-key", max_retries=0)
    assert admin.completions.create(model="tiny", prompt=PROMPT, max_tokens=30).usage.prompt_tokens == 40
    metrics = httpx.get(f"{served}/metrics", headers=ADMIN, timeout=10).text
    assert 'kvreuse:tenant_requests_refused_total{reason="tokens_per_minute",tenant="acme"} 1.0' in metrics


def test_a_client_that_disconnects_mid_stream_leaves_no_slot_behind(served):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{served}/v1/completions", json=body, timeout=60, headers={"Authorization": "Bearer globex-key"}
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the stream is running; now the client goes away
    deadline = time.monotonic() + 60
    while _in_flight(served, "globex") != 0.0:
        assert time.monotonic() < deadline, "globex's slot was never freed"
        time.sleep(0.1)
    globex = openai.OpenAI(base_url=served + "/v1", api_key="globex-key", max_retries=0)
    assert globex.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
