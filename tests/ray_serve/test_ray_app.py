"""``kvreuse ray --replicas 2`` end to end on a local Ray cluster, tiny random model: the
official ``openai`` client, plain and streamed; routing by the replicas' KV events; the
same errors as ``kvreuse serve``; SIGTERM stops the cluster. Skipped without the ray extra."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from tests.ray_serve.ray_app import TINY_SERVE_FLAGS, running_ray_app, stop  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
GREEDY = {"temperature": 0}
FLAGS = (*TINY_SERVE_FLAGS, "--served-model-name", MODEL, "--num-cpus", "4", "--replica-cpus", "1")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "kvreuse-ray.log"
    with running_ray_app(2, FLAGS, log) as (url, proc):
        yield url, proc, log


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_openai_client_gets_plain_and_streamed_completions(app):
    url, _, _ = app
    client = _client(url)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert plain.usage.completion_tokens == 12
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text == plain.choices[0].text  # greedy: the same reply, whichever replica served it


def test_the_openai_client_gets_a_streamed_chat_reply(app):
    url, _, _ = app
    client = _client(url)
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content
    assert plain.usage.completion_tokens == 8


def test_the_anthropic_client_gets_plain_and_streamed_messages(app):
    anthropic = pytest.importorskip("anthropic")
    url, _, _ = app
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=messages)
    with client.messages.stream(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in plain.content)
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_errors_are_kvreuse_serves(app):
    url, _, _ = app
    client = _client(url)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    resp = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


def _overlaps(url: str, prompt: str) -> list[float]:
    resp = httpx.post(f"{url}/v1/route/explain", json={"model": MODEL, "prompt": prompt}, timeout=10)
    return sorted(e["overlap_blocks"] for e in resp.json()["executors"])


def test_a_repeated_prefix_goes_where_its_blocks_are(app):
    """The replica that computed a prompt publishes its blocks; the index then shows them on
    that replica alone, and the same prompt again is routed there and reuses them."""
    url, _, _ = app
    client = _client(url)
    prompt = " ".join(f"word{i}" for i in range(100))  # within the 1,024-token context
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    blocks = first.usage.prompt_tokens // 16
    deadline = time.monotonic() + 30
    while _overlaps(url, prompt) != [0, blocks] and time.monotonic() < deadline:
        time.sleep(0.2)  # the events reach the ingress's index
    assert _overlaps(url, prompt) == [0, blocks]
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    # every full block of the prompt but its last token's is reused
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16


def test_sigterm_stops_the_app_and_the_local_cluster(app):
    url, proc, log = app
    assert stop(proc) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
    assert "kvreuse ray: stopping" in log.read_text()
