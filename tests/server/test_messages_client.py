"""``kvreuse serve`` as a real subprocess, driven by the official ``anthropic`` client (unmodified
but for ``base_url``): plain, streaming, multi-turn, system blocks, documents, count_tokens,
cache usage on a repeat, ``x-api-key`` and Bearer keys naming one tenant, errors as the
client's own exception types."""

from __future__ import annotations

import pytest

from tests.serve_process import free_port, running_server

from .helpers import BLOCK_SIZE, words

ADMIN, TENANT = "admin-key", "acme-key"
GREEDY = {"temperature": 0}  # this client version has no temperature argument: the body field


@pytest.fixture(scope="module")
def url(tmp_path_factory):
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
        ADMIN,
        "--api-key",
        f"{TENANT}:acme",
    ]
    with running_server(free_port(), args, log) as base:
        yield base


def _client(url, **kwargs):
    import anthropic

    kwargs.setdefault("api_key", ADMIN)
    return anthropic.Anthropic(base_url=url, max_retries=0, **kwargs)


def test_plain_multi_turn_system_blocks_and_count_tokens(url):
    client = _client(url)
    messages = [
        {"role": "user", "content": words(30, 601)},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "more"}, {"type": "text", "text": "please"}]},
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    msg = client.messages.create(
        model="tiny", max_tokens=5, extra_body=GREEDY, system=system, messages=messages, metadata={"user_id": "u-1"}
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 5
    counted = client.messages.count_tokens(model="tiny", system=system, messages=messages)
    usage = msg.usage
    assert (
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == counted.input_tokens
    )


def test_streaming_matches_the_plain_reply(url):
    client = _client(url)
    messages = [{"role": "user", "content": words(30, 602)}]
    plain = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, messages=messages)
    with client.messages.stream(model="tiny", max_tokens=6, extra_body=GREEDY, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in plain.content)
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    raw = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, messages=messages, stream=True)
    kinds = [event.type for event in raw]  # the client drops ping
    body = [k for k in kinds if k == "content_block_delta"]
    assert kinds == [
        "message_start",
        "content_block_start",
        *body,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_cache_control_repeat_reads_the_cached_prefix(url):
    client = _client(url)
    system = [{"type": "text", "text": words(100, 603), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": words(60, 604), "cache_control": {"type": "ephemeral"}}]}
    ]
    n = client.messages.count_tokens(model="tiny", system=system, messages=messages).input_tokens
    first = client.messages.create(model="tiny", max_tokens=2, extra_body=GREEDY, system=system, messages=messages)
    second = client.messages.create(model="tiny", max_tokens=2, extra_body=GREEDY, system=system, messages=messages)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    cached = (n - 1) // BLOCK_SIZE * BLOCK_SIZE  # every block but the one holding the last token
    assert second.usage.cache_read_input_tokens == cached
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == n - cached


def test_documents_are_reused_in_any_order(url):
    client = _client(url)
    docs = [
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": words(70, s)},
            "title": f"doc {s}",
        }
        for s in (605, 606)
    ]

    def ask(order):
        return client.messages.create(
            model="tiny",
            max_tokens=2,
            extra_body=GREEDY,
            messages=[{"role": "user", "content": [*order, {"type": "text", "text": "Summarise."}]}],
        )

    ask(docs)
    swapped = ask(docs[::-1])
    assert swapped.usage.cache_read_input_tokens > 0  # both documents' KV came from the first request


def test_x_api_key_and_bearer_name_the_same_tenant(url):
    messages = [{"role": "user", "content": words(80, 607)}]
    by_header = _client(url, api_key=TENANT).messages.create(model="tiny", max_tokens=2, messages=messages)
    assert by_header.usage.cache_read_input_tokens == 0
    import anthropic

    bearer = anthropic.Anthropic(base_url=url, auth_token=TENANT, api_key=None, max_retries=0)
    again = bearer.messages.create(model="tiny", max_tokens=2, messages=messages)
    n = bearer.messages.count_tokens(model="tiny", messages=messages).input_tokens
    assert again.usage.cache_read_input_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE  # the tenant's own blocks
    admin = _client(url).messages.create(model="tiny", max_tokens=2, messages=messages)
    # another salt: at most the template's default system block, which the admin's earlier requests cached
    assert admin.usage.cache_read_input_tokens <= BLOCK_SIZE


def test_errors_are_the_clients_exception_types(url):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as denied:
        _client(url, api_key="wrong").messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"
    client = _client(url)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": ("model: the model `claude-x` does not exist; this server serves tiny"),
        },
    }
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="tiny",
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "9m"}}],
                }
            ],
        )
    assert bad.value.body["error"]["message"].startswith("messages[0].content[0].cache_control.ttl:")
    with pytest.raises(anthropic.PermissionDeniedError):
        _client(url, api_key=TENANT).get("/v1/kvreuse/info", cast_to=object)
