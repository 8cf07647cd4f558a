"""Review C of issue 15's hardening: each test reproduces a defect (it fails on the branch as landed)."""

from __future__ import annotations

import time

import pytest

PROMPT = [(i * 37) % 1900 + 100 for i in range(40)]  # 2 full blocks of 16 + 8 tokens
KEYS = ["admin-key", "acme-key:acme", "globex-key:globex"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_only_admin_keys_learn_the_zmq_event_socket(tiny_llama):
    """/v1/kvreuse/info names the executor's ZMQ PUB socket, which has no authentication and
    carries every block's token ids: a tenant key gets a 403 there (as on the state and event
    routes), an admin key (a router's) gets the endpoint."""
    from fastapi.testclient import TestClient

    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
    from kvreuse.events.publisher import ZmqEventPublisher
    from kvreuse.server.api_server import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory_gib=0.002, block_size=16, max_model_len=512,
                                                event_buffer_max_size=1000), tiny_llama))
    publisher = ZmqEventPublisher(engine.engine.events, "tcp://127.0.0.1:*")
    try:
        engine.start()
        publisher.start()
        with TestClient(build_app(engine, served_model_name="tiny", api_key=KEYS, publisher=publisher)) as c:
            for path in ("/v1/kv_cache_events", "/v1/kvreuse/info"):
                r = c.get(path, headers=_auth("globex-key"))
                assert r.status_code == 403 and "zmq" not in r.text, r.text
            info = c.get("/v1/kvreuse/info", headers=_auth("admin-key"))
            assert info.status_code == 200 and info.json()["events"]["zmq_endpoint"] == publisher.endpoint
    finally:
        publisher.close()
        engine.shutdown()


from tests.server.test_pml_routes import PROMPT as PML_PROMPT, SCHEMA as PML_SCHEMA  # noqa: E402


def test_pml_chat_without_max_tokens_on_a_small_pool_fills_what_fits(tiny_llama):
    """Plain chat defaults max_tokens to what the pool holds (reply_room); the PML chat path
    (chat_routes._create_pml) still defaults to the context alone, so the same client gets a
    400 about a max_tokens it never sent: the issue's item 8, left in the PML branch."""
    from tests.server.fresh_app import fresh_client

    with fresh_client(tiny_llama, kv_cache_memory_gib=0.0001, max_model_len=1024) as (c, engine):
        assert engine.pool_tokens == 208
        assert c.post("/v1/schemas", json={"schema": PML_SCHEMA}).status_code == 200
        plain = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                     "max_tokens": None, "temperature": 0})
        assert plain.status_code == 200, plain.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PML_PROMPT}],
                                                 "temperature": 0})
        assert r.status_code == 200, r.text


# float64 and a dropped tensor were checked too and pass (recomputed / loaded right); a header
# that is not a JSON object drops the schema, but its source lives only there.
@pytest.mark.parametrize("mode", ["int_dtype"])
def test_more_corrupt_store_modes_cost_one_recompute(tiny_llama, tmp_path, mode):
    """More ways a --schema-dir file can be wrong at start: each must be refused (or
    recomputed) with the output right, never loaded as KV."""
    import torch

    from tests.pml.test_module_cache import GREEDY, SCHEMA, _rewrite, make

    first = make(tiny_llama, schema_dir=str(tmp_path))
    first.register_schema(SCHEMA)
    prompt = '<prompt schema="s"><b/><r who="Cy"/>Why?</prompt>'
    ref = first.generate(prompt, GREEDY)[0]
    (path,) = list(tmp_path.rglob("*.safetensors"))
    if mode == "int_dtype":  # right shape, valid checksum, but integers: 0/1 instead of the KV
        _rewrite(path, lambda t: (t > 0).to(torch.int64))
    elif mode == "float64":  # the right values in a wider dtype: may load, output must be right
        _rewrite(path, lambda t: t.to(torch.float64))
    elif mode == "drop_tensor":
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        from kvreuse.pml.schema_store import _checksum
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(path), metadata={**meta, "checksum": _checksum(tensors)})
    else:
        import json
        import struct
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = b"[]".ljust(n)
        path.write_bytes(raw[:8] + header + raw[8 + n:])
    restarted = make(tiny_llama, schema_dir=str(tmp_path))
    infos = restarted.engine.restored_schemas
    assert [i.name for i in infos] == ["s"], "the schema must be restored (recomputed), not dropped"
    assert restarted.generate(prompt, GREEDY)[0].token_ids == ref.token_ids
