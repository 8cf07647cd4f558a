"""PML over HTTP (tiny model): /v1/schemas, PML prompts in completions and chat, 400s for bad
markup that name the line/column or the module, and an idle pool afterwards."""

from __future__ import annotations

import asyncio

from .helpers import wait_idle

SCHEMA = """<schema name="httpdocs">
  <system>Answer from the documents.</system>
  <union>
    <module name="d1">Document one: the mill on Tarn creek grinds barley every Tuesday.</module>
    <module name="d2">Document two: the ferry to Osk leaves at seven and returns at nine.</module>
  </union>
  <module name="who">Asker: <param name="name" len="4"/>.</module>
</schema>"""
PROMPT = '<prompt schema="httpdocs"><d2/><who name="Ana"/><user>When does the ferry leave?</user></prompt>'


def _register(client):
    r = client.post("/v1/schemas", json={"schema": SCHEMA})
    assert r.status_code == 200, r.text
    return r.json()


def test_register_list_and_serve_completion_and_chat(client, async_engine):
    info = _register(client)
    assert info["name"] == "httpdocs" and set(info["modules"]) == {"", "d1", "d2", "who"}
    listed = client.get("/v1/schemas").json()["data"]
    assert "httpdocs" in [s["name"] for s in listed]

    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < usage["prompt_tokens"]

    r2 = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0},
    )
    assert r2.status_code == 200, r2.text
    assert r2.json()["choices"][0]["message"]["content"] == r.json()["choices"][0]["text"]
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached

    s = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True})
    assert s.status_code == 200 and "[DONE]" in s.text
    wait_idle(async_engine)


def test_a_pml_request_is_compiled_once_on_the_engine_thread(client, async_engine, monkeypatch):
    """Chat with n=2 compiles its prompt once (the choices share it); completions once per
    prompt; always on the engine thread, where the schemas live."""
    import threading

    import kvreuse.pml.prepared as prepared_mod

    _register(client)
    threads = []
    real = prepared_mod.compile_prompt
    monkeypatch.setattr(
        prepared_mod, "compile_prompt", lambda *a: threads.append(threading.current_thread().name) or real(*a)
    )
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": PROMPT}], "n": 2, "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert len(threads) == 1
    r = client.post("/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(threads) == 3
    engine_thread = async_engine._thread.name
    assert threads == [engine_thread] * 3
    wait_idle(async_engine)
    asyncio.run(async_engine.call(lambda e: e.check_integrity()))


def test_bad_markup_and_bad_prompts_are_400s(client, async_engine):
    r = client.post("/v1/schemas", json={"schema": '<schema name="x">\n<module name="m">a</mod>\n</schema>'})
    assert r.status_code == 400 and "line 2" in r.json()["error"]["message"]
    _register(client)
    bad = {
        '<prompt schema="httpdocs"><d3/>Hi</prompt>': "d3",
        '<prompt schema="httpdocs"><d1/><d2/>Hi</prompt>': "union",
        '<prompt schema="httpdocs"><who/>Hi</prompt>': "name",
        '<prompt schema="httpdocs"><who name="a very long name that overflows"/>Hi</prompt>': "name",
        '<prompt schema="nope">Hi</prompt>': "nope",
        '<prompt schema="httpdocs"><d1>': "line 1",
    }
    for prompt, needle in bad.items():
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, (prompt, r.text)
        assert needle in r.json()["error"]["message"], (prompt, r.text)
        assert r.json()["error"]["param"] == "prompt"
        c = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})
        assert c.status_code == 400, (prompt, c.text)
        assert c.json()["error"]["param"] == "messages"
    assert client.delete("/v1/schemas/httpdocs").status_code == 200
    assert client.delete("/v1/schemas/httpdocs").status_code == 404
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400 and "httpdocs" in r.json()["error"]["message"]
    stats = wait_idle(async_engine)
    assert stats.num_used_blocks == 0


SRC_SCHEMA = """<schema name="srcdocs">
  <system>Answer from the files.</system>
  <module name="notes" src="notes/a.txt"/>
</schema>"""


def test_src_modules_over_http_need_schema_src_dir_and_survive_a_restart(tiny_llama, tmp_path):
    from .fresh_app import fresh_client

    (tmp_path / "src" / "notes").mkdir(parents=True)
    (tmp_path / "src" / "notes" / "a.txt").write_text("The lighthouse on Vel is painted green.")
    # No --schema-src-dir: src= is refused with a 400 naming the module and the setting.
    with fresh_client(tiny_llama) as (client, _):
        r = client.post("/v1/schemas", json={"schema": SRC_SCHEMA})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "'notes'" in msg and "--schema-src-dir" in msg
    settings = {"schema_src_dir": str(tmp_path / "src"), "schema_dir": str(tmp_path / "kv")}
    with fresh_client(tiny_llama, **settings) as (client, engine):
        r = client.post("/v1/schemas", json={"schema": SRC_SCHEMA})
        assert r.status_code == 200, r.text
        assert r.json()["modules"] == ["", "notes"]
        escape = SRC_SCHEMA.replace("srcdocs", "escape").replace("notes/a.txt", "../src/notes/a.txt")
        r = client.post("/v1/schemas", json={"schema": escape})
        assert r.status_code == 400 and ".." in r.json()["error"]["message"]
        prompt = '<prompt schema="srcdocs"><notes/>What colour is it?</prompt>'
        first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
        wait_idle(engine)
    # A restart with the same folders restores the schema (src= re-read) from the schema dir.
    with fresh_client(tiny_llama, **settings) as (client, engine):
        restored = engine.engine.restored_schemas
        assert [s.name for s in restored] == ["srcdocs"] and restored[0].loaded == 2 and restored[0].computed == 0
        again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"] == first["usage"]
        wait_idle(engine)


def test_pml_prompts_obey_the_prompt_limit_and_default_max_tokens(tiny_llama):
    """--max-prompt-tokens counts the assembled modules; without max_tokens a PML
    completion gets what the context leaves (at most 16), as a plain one does."""
    from kvreuse.server.context import ServerLimits

    from .fresh_app import fresh_client

    with fresh_client(tiny_llama, kv_cache_memory_gib=0.01) as (client, engine):
        assert client.post("/v1/schemas", json={"schema": SCHEMA}).status_code == 200
        end = asyncio.run(engine.call(lambda e: e.modules.prompt_end(PROMPT)))
        ok = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 16
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.01, limits=ServerLimits(max_prompt_tokens=end - 1)) as (
        client,
        engine,
    ):
        assert client.post("/v1/schemas", json={"schema": SCHEMA}).status_code == 200
        for path, body, param in (
            ("/v1/completions", {"prompt": PROMPT}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}, "messages"),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"


def test_blend_over_http_repairs_seams_and_bad_values_are_400s(client, async_engine):
    _register(client)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    off = client.post("/v1/completions", json={**body, "blend": {"first_tokens": 0, "ratio": 0}})
    assert off.status_code == 200, off.text
    assert off.json()["choices"][0]["text"] == plain
    wait_idle(async_engine)
    before = async_engine.engine.stats().seam_repair_tokens
    full = client.post("/v1/completions", json={**body, "blend": {"first_tokens": 4, "ratio": 1.0}})
    assert full.status_code == 200, full.text
    wait_idle(async_engine)
    assert async_engine.engine.stats().seam_repair_tokens > before
    for bad in ({"ratio": 2.0}, {"first_tokens": -1}, "yes"):
        r = client.post("/v1/completions", json={**body, "blend": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "blend"
    wait_idle(async_engine)


def test_blend_in_chat_repairs_pml_and_is_checked_on_every_prompt(client, async_engine):
    _register(client)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0}
    wait_idle(async_engine)
    before = async_engine.engine.stats().seam_repair_tokens
    r = client.post("/v1/chat/completions", json={**chat, "blend": {"first_tokens": 2}})
    assert r.status_code == 200, r.text
    wait_idle(async_engine)
    assert async_engine.engine.stats().seam_repair_tokens > before
    plain = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
    bad = client.post("/v1/chat/completions", json={**plain, "blend": {"ratio": 5}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "blend", bad.text
    ok = client.post("/v1/chat/completions", json={**plain, "blend": {"ratio": 0.5}})
    assert ok.status_code == 200, ok.text  # no modules: nothing to repair
    wait_idle(async_engine)


def test_pml_chat_without_max_tokens_on_a_small_pool_fills_what_fits(tiny_llama):
    """Plain chat defaults max_tokens to what the pool holds (reply_room); the PML chat path
    (chat_routes._create_pml) still defaults to the context alone, so the same client gets a
    400 about a max_tokens it never sent: the issue's item 8, left in the PML branch."""
    from tests.server.fresh_app import fresh_client

    with fresh_client(tiny_llama, kv_cache_memory_gib=0.0001, max_model_len=1024) as (c, engine):
        assert engine.pool_tokens == 208
        assert c.post("/v1/schemas", json={"schema": SCHEMA}).status_code == 200
        plain = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": None, "temperature": 0},
        )
        assert plain.status_code == 200, plain.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "temperature": 0})
        assert r.status_code == 200, r.text
