"""Agents' own caching words reach retention: Anthropic's cache_control breakpoints and
OpenAI's prompt_cache_retention, seen as block priorities in /v1/kv_cache_stats (exact counts)."""

from __future__ import annotations

from .fresh_app import fresh_client
from .helpers import BLOCK_SIZE, words


def _held(client) -> dict[str, int]:
    return client.get("/v1/kv_cache_stats").json()["blocks_by_priority"]


def test_prompt_cache_retention_24h_holds_the_prompt_at_the_history_priority(tiny_llama):
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.02) as (client, _):
        prompt = list(range(100, 100 + 5 * BLOCK_SIZE))
        r = client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 1,
                "prompt_cache_retention": "24h",
                "prompt_cache_key": "agent-1",
            },
        )
        assert r.status_code == 200, r.text
        assert _held(client) == {"40": 5}  # every prompt block, none at the default 35
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "prompt_cache_retention": "24h",
                "kv_cache_retention_config": {},
            },
        )
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("prompt_cache_retention: give prompt_cache_retention or")


def test_breakpoints_set_block_priorities(tiny_llama):
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.02) as (client, engine):
        system = words(60, 81)
        body = {
            "model": "tiny",
            "max_tokens": 1,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": words(60, 82)}],
        }
        assert client.post("/v1/messages", json=body).status_code == 200
        tok = engine.tokenizer
        head = len(
            tok.encode(
                tok.apply_chat_template([{"role": "system", "content": system}], tokenize=False),
                add_special_tokens=False,
            )
        )
        n = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        # a block takes the range of its first token: those starting in the system range are 85
        system_blocks = (head + BLOCK_SIZE - 1) // BLOCK_SIZE
        assert _held(client) == {"85": system_blocks, "35": n // BLOCK_SIZE - system_blocks}


def test_breakpoint_counters_on_metrics(tiny_llama):
    from prometheus_client.parser import text_string_to_metric_families

    with fresh_client(tiny_llama, kv_cache_memory_gib=0.02) as (client, engine):
        system = words(60, 83)
        body = {
            "model": "tiny",
            "max_tokens": 1,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": words(60, 84)}],
        }
        usage = [client.post("/v1/messages", json=body).json()["usage"] for _ in range(2)]
        tok = engine.tokenizer
        head = len(
            tok.encode(
                tok.apply_chat_template([{"role": "system", "content": system}], tokenize=False),
                add_special_tokens=False,
            )
        )
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples
        }

    def value(name, **labels):
        return samples[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]

    assert value("kvreuse:cache_breakpoint_tokens_total", **{"class": "system", "ttl": "1h"}) == 2 * head
    for kind, key in (
        ("cache_read", "cache_read_input_tokens"),
        ("cache_creation", "cache_creation_input_tokens"),
        ("input", "input_tokens"),
    ):
        assert value("kvreuse:messages_prompt_tokens_total", kind=kind) == usage[0][key] + usage[1][key]
    assert usage[0]["cache_creation_input_tokens"] == head // BLOCK_SIZE * BLOCK_SIZE


def test_a_servers_own_breakpoint_priorities(tiny_llama):
    from fastapi.testclient import TestClient

    from kvreuse.api.cache_breakpoints import BreakpointPolicy
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.server.api_server import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory_gib=0.02, block_size=BLOCK_SIZE), tiny_llama))
    engine.start()
    try:
        policy = BreakpointPolicy.parse("system=70,history=60")
        with TestClient(build_app(engine, served_model_name="tiny", cache_policy=policy)) as client:
            prompt = words(80, 85)
            body = {
                "model": "tiny",
                "max_tokens": 1,
                "cache_control": {"type": "ephemeral"},
                "messages": [{"role": "user", "content": prompt}],
            }
            assert client.post("/v1/messages", json=body).status_code == 200
            tok = engine.tokenizer
            end = len(
                tok.encode(
                    tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False),
                    add_special_tokens=False,
                )
            )
            n = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
            # one history range (the template's default system turn is its glue) at the server's 60
            # a block takes its first token's range: those starting before `end` are at the server's 60
            full, marked = n // BLOCK_SIZE, min(n // BLOCK_SIZE, (end + BLOCK_SIZE - 1) // BLOCK_SIZE)
            assert _held(client) == {k: v for k, v in (("60", marked), ("35", full - marked)) if v}
            assert marked >= 1
    finally:
        engine.shutdown()


def test_a_bad_priorities_flag_stops_the_server_before_the_model_loads(tmp_path):
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvreuse",
            "serve",
            "--model",
            str(tmp_path / "none.gguf"),
            "--cache-control-priorities",
            "rag=50",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 2
    assert "kvreuse serve: --cache-control-priorities takes name=integer pairs" in done.stderr
