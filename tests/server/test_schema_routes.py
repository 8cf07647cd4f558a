"""POST /v1/schemas off the critical path, through the real server (tiny Llama): a schema over
a cost limit is a 400 naming the setting before any work; a 500-member union registers while
another client streams, slices of the union's precompute alternating with steps that give the
stream a token (the engine's calls are counted, not timed); prompts see the schema only once it is
complete, and the version registered before serves until then. Last, the schema dir through
the server: a restart over a bad file starts, recomputes and answers as before."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
import torch

from .fresh_app import fresh_client, fresh_server

SLICE = 64
STREAM = {
    "prompt": "Tell me about the ships.",
    "max_tokens": 1500,
    "temperature": 0,
    "ignore_eos": True,
    "request_id": "stream",
}


def union(name: str, members: int, *, tag: str = "") -> str:
    rows = "\n".join(
        f'  <module name="f{i}">Fact {i}{tag}: the keeper of lighthouse {i} logs every ship at dusk.</module>'
        for i in range(members)
    )
    return f'<schema name="{name}">\n<system>Answer from the facts.</system>\n<union>\n{rows}\n</union>\n</schema>'


class EngineLog:
    """A spy on the real engine loop's two calls: per ``LLMEngine.step``, the requests it
    produced a token for, ``("step", ids)``; per ``precompute_slice``, the module precompute
    tokens it ran, ``("slice", n)``, in the order the engine thread made them."""

    def __init__(self, engine) -> None:
        self.events: list[tuple[str, object]] = []
        step, precompute_slice = engine.step, engine.precompute_slice

        def logged_step():
            out = step()
            self.events.append(("step", [o.request_id for o in out]))
            return out

        def logged_slice():
            before = engine.modules.tokens_computed
            precompute_slice()
            if engine.modules.tokens_computed > before:
                self.events.append(("slice", engine.modules.tokens_computed - before))

        engine.step, engine.precompute_slice = logged_step, logged_slice

    @property
    def slices(self) -> list[int]:
        return [n for kind, n in self.events if kind == "slice"]


class StreamClient:
    """A streaming completion in a thread; ``tokens`` grows as chunks arrive; ``stop`` closes it."""

    def __init__(self, url: str) -> None:
        self.texts: list[str] = []
        self.first = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        import json

        with httpx.stream("POST", url + "/v1/completions", json={**STREAM, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.texts.append(json.loads(line[6:])["choices"][0]["text"])
                    self.first.set()
                if self.stop.is_set():
                    return


def test_a_schema_over_a_limit_is_a_400_naming_the_setting_before_any_work(tiny_llama):
    text = union("facts", 500)
    with fresh_client(tiny_llama, schema_max_tokens=5000) as (c, engine):
        r = c.post("/v1/schemas", json={"schema": text})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "schema" and err["code"] == "schema_too_large"
        assert "over the limit of 5000 (--schema-max-tokens)" in err["message"] and "500" in err["message"]
        stats = engine.stats()
        assert stats.tokens_computed_modules == 0 and stats.schemas_registering == 0 and stats.num_cached_blocks == 0
        assert c.get("/v1/schemas").json() == {"object": "list", "data": [], "registering": []}
        ok = c.post("/v1/schemas", json={"schema": union("small", 20)})
        assert ok.status_code == 200 and ok.json()["precompute_tokens"] <= 5000
    with fresh_client(tiny_llama, schema_max_bytes=1_000_000) as (c, engine):
        err = c.post("/v1/schemas", json={"schema": text}).json()["error"]
        assert "over the limit of 1000000 bytes (--schema-max-bytes)" in err["message"]
        assert engine.stats().tokens_computed_modules == 0
    with fresh_client(tiny_llama) as (c, engine):  # 0.002 GiB: 262 blocks of 16; the union needs 991
        err = c.post("/v1/schemas", json={"schema": text}).json()["error"]
        assert engine.engine.pool.num_blocks == 262
        assert err["message"] == (
            "schema 'facts' needs 991 KV blocks for its 501 modules but the pool has 262: "
            "split it or raise --kv-cache-memory"
        )


def test_a_500_member_union_registers_while_a_client_streams(tiny_llama):
    config = {"kv_cache_memory_gib": 0.05, "max_model_len": 2048, "schema_slice_tokens": SLICE}
    with fresh_server(tiny_llama, **config) as (url, engine):
        alone = httpx.post(url + "/v1/completions", json={**STREAM, "request_id": "alone"}, timeout=300).json()
        log = EngineLog(engine.engine)
        stream = StreamClient(url)
        assert stream.first.wait(60)
        r = httpx.post(url + "/v1/schemas", json={"schema": union("facts", 500)}, timeout=300)
        stream.stop.set()
        stream.thread.join(60)
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["computed"] == 501 and info["name"] == "facts"

        slices = log.slices
        assert sum(slices) == info["precompute_tokens"]  # every precompute token ran in a slice
        assert max(slices) <= SLICE and len(slices) >= info["precompute_tokens"] // SLICE  # many steps, not one
        # Between two slices the engine ran a step that gave the stream a token: between two
        # of its tokens there was at most one slice of at most SLICE tokens.
        first = next(i for i, (kind, _) in enumerate(log.events) if kind == "slice")
        last = max(i for i, (kind, _) in enumerate(log.events) if kind == "slice")
        window = log.events[first : last + 1]
        for (kind_a, _), (kind_b, ids) in zip(window, window[1:]):
            assert kind_a != kind_b  # slices and steps alternate
            assert kind_b == "slice" or "stream-0" in ids
        streamed = "".join(stream.texts)
        assert len(stream.texts) >= len(slices) and alone["choices"][0]["text"].startswith(streamed)
        stats = engine.stats()
        assert stats.schema_slices == len(slices) and stats.schemas_registering == 0
        metrics = httpx.get(url + "/metrics").text
        assert f'kvreuse:schema_precompute_slices_total{{model_name="tiny"}} {float(len(slices))}' in metrics
        assert 'kvreuse:schema_modules_filled_total{model_name="tiny",source="computed"} 501.0' in metrics
        import asyncio

        asyncio.run(engine.check_integrity())


def test_prompts_see_a_schema_only_once_it_is_complete(tiny_llama):
    """While version 2 registers, a prompt over the schema is served by version 1 (its exact
    tokens); a prompt over a schema still registering for the first time is a 400."""
    prompt = {
        "prompt": '<prompt schema="facts"><f7/><user>Which ship?</user></prompt>',
        "max_tokens": 6,
        "temperature": 0,
    }
    config = {"kv_cache_memory_gib": 0.05, "max_model_len": 2048, "schema_slice_tokens": 16}
    with fresh_server(tiny_llama, **config) as (url, engine):
        assert httpx.post(url + "/v1/schemas", json={"schema": union("facts", 10)}, timeout=120).status_code == 200
        v1 = httpx.post(url + "/v1/completions", json=prompt, timeout=60).json()["choices"][0]["text"]
        log = EngineLog(engine.engine)
        results: dict[str, httpx.Response] = {}

        def post(key: str, text: str) -> None:
            results[key] = httpx.post(url + "/v1/schemas", json={"schema": text}, timeout=300)

        threads = [
            threading.Thread(target=post, args=("v2", union("facts", 300, tag=" again"))),
            threading.Thread(target=post, args=("new", union("fresh", 300))),
        ]
        for t in threads:  # each compiles its schema in a worker thread while prompts compile on the
            t.start()  # engine thread, with the same tokenizer (pml/encoder.py)
        seen = {"v1_while_v2": 0, "fresh_unknown": 0}
        texts = []

        def registering() -> set[str]:
            return {p["name"] for p in httpx.get(url + "/v1/schemas").json()["registering"]}

        while any(t.is_alive() for t in threads):
            # A registration is popped from "registering" in the engine step that installs it, so
            # a name listed both before and after a request was registering all the while it was
            # served (the POST's answer reaches its thread later: it cannot bracket the request).
            before = registering()
            r = httpx.post(url + "/v1/completions", json=prompt, timeout=60)
            q = httpx.post(
                url + "/v1/completions",
                json={**prompt, "prompt": prompt["prompt"].replace("facts", "fresh")},
                timeout=60,
            )
            during = before & registering()
            assert r.status_code == 200 and q.status_code in (200, 400)
            texts.append(r.json()["choices"][0]["text"])
            if "facts" in during:
                assert texts[-1] == v1
                seen["v1_while_v2"] += 1
            if "fresh" in during:
                assert q.status_code == 400 and "fresh" in q.json()["error"]["message"]
                seen["fresh_unknown"] += 1
        for t in threads:
            t.join()
        assert results["v2"].status_code == 200 and results["new"].status_code == 200
        assert seen["v1_while_v2"] >= 1 and seen["fresh_unknown"] >= 1
        assert len(log.slices) > 1  # the registrations ran in slices
        v2 = httpx.post(url + "/v1/completions", json=prompt, timeout=60).json()
        assert v2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert set(texts) <= {v1, v2["choices"][0]["text"]}  # one version or the other, never a mix
        listed = httpx.get(url + "/v1/schemas").json()
        assert [s["name"] for s in listed["data"]] == ["facts", "fresh"] and listed["registering"] == []


def test_a_registration_in_flight_when_the_engine_stops_fails_and_holds_nothing(tiny_llama):
    import asyncio

    import pytest

    from kvreuse.engine.async_engine import AsyncEngine, EngineDeadError
    from kvreuse.engine.llm_engine import EngineConfig, LLMEngine

    engine = AsyncEngine(
        LLMEngine(
            EngineConfig(kv_cache_memory_gib=0.05, block_size=16, max_model_len=2048, schema_slice_tokens=4), tiny_llama
        )
    )
    engine.start()

    async def stop_mid_registration() -> None:
        task = asyncio.create_task(engine.register_schema(union("facts", 300)))
        while engine.stats().schema_slices == 0:  # a slice ran: the registration is under way
            await asyncio.sleep(0.01)
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            await task

    asyncio.run(stop_mid_registration())
    inner = engine.engine
    assert not inner.registrations.has_work() and "facts" not in inner.modules.schemas
    assert inner.pool.num_used_blocks == 0
    inner.check_integrity()


# The schema dir through the real server (tiny Llama): a schema POSTed (registered in slices)
# is saved; a restart over a file with a wrong tensor shape, cut-short tensors or all-NaN KV
# with a valid checksum starts all the same, refuses the file with one warning and one count,
# recomputes the schema (counted in tokens_computed_total) and answers as before; a good file
# is loaded and the restore logged and counted.
SCHEMA = """<schema name="docs">
  <system>Answer from the documents.</system>
  <union>
    <module name="d1">Document one: the mill on Tarn creek grinds barley every Tuesday.</module>
    <module name="d2">Document two: the ferry to Osk leaves at seven and returns at nine.</module>
  </union>
  <module name="who">Asker: <param name="name" len="4"/>.</module>
</schema>"""
PROMPT = {
    "prompt": '<prompt schema="docs"><d2/><who name="Ana"/><user>When does the ferry leave?</user></prompt>',
    "max_tokens": 8,
    "temperature": 0,
}


def _metric(text: str, name: str, label: str = "") -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _rewrite(path, change) -> None:
    """Rewrite the file with ``change`` applied to every tensor, checksum recomputed (valid)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvreuse.pml.schema_store import _checksum

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = {k: change(t).contiguous() for k, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={**meta, "checksum": _checksum(tensors)})


@pytest.mark.parametrize("mode", ["shape", "truncated", "non_finite", "good"])
def test_a_restart_over_a_bad_store_file_starts_recomputes_and_answers_the_same(tiny_llama, tmp_path, caplog, mode):
    settings = {"schema_dir": str(tmp_path), "kv_cache_memory_gib": 0.01, "schema_slice_tokens": 8}
    with fresh_client(tiny_llama, **settings) as (c, _):
        r = c.post("/v1/schemas", json={"schema": SCHEMA})
        assert r.status_code == 200 and r.json()["persisted"] is True
        cost = r.json()["precompute_tokens"]
        ref = c.post("/v1/completions", json=PROMPT).json()["choices"][0]["text"]
    (path,) = list(tmp_path.rglob("*.safetensors"))
    if mode == "shape":
        _rewrite(path, lambda t: t[:, :, :, :1])  # one KV head where the model has two
    elif mode == "non_finite":
        _rewrite(path, lambda t: torch.full_like(t, float("nan")))
    elif mode == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # header intact, tensors cut

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvreuse"), fresh_client(tiny_llama, **settings) as (c, engine):
        listed = c.get("/v1/schemas").json()["data"]
        assert [s["name"] for s in listed] == ["docs"]
        assert c.post("/v1/completions", json=PROMPT).json()["choices"][0]["text"] == ref
        # The engine thread may still be finishing its last step when the response arrives:
        # read /metrics once the engine's own count has stopped moving, so the two agree.
        for _ in range(100):
            before = engine.stats()
            metrics = c.get("/metrics").text
            stats = engine.stats()  # the snapshot /metrics was read against (later ones may move on)
            if stats.tokens_computed == before.tokens_computed:
                break
            time.sleep(0.05)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    restored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("schema dir: restored")]
    refused = _metric(metrics, "kvreuse:schema_store_refused_total")
    modules = _metric(metrics, "kvreuse:schema_modules_filled_total", 'source="computed"')
    if mode == "good":
        assert warnings == [] and refused is None
        assert restored == ["schema dir: restored schema 'docs' (4 modules: 4 loaded, 0 computed)"]
        assert _metric(metrics, "kvreuse:schema_modules_filled_total", 'source="loaded"') == 4.0 and modules is None
        assert stats.tokens_computed_modules == 0
        return
    reason = {"shape": "shape", "truncated": "unreadable", "non_finite": "non_finite"}[mode]
    assert len(warnings) == 1 and warnings[0].startswith(f"schema dir: refused {path.name} (")
    assert restored == ["schema dir: restored schema 'docs' (4 modules: 0 loaded, 4 computed)"]
    assert _metric(metrics, "kvreuse:schema_store_refused_total", f'reason="{reason}"') == 1.0
    assert modules == 4.0
    assert stats.tokens_computed_modules == cost  # the recompute is counted
    assert _metric(metrics, "kvreuse:tokens_computed_total") == stats.tokens_computed >= cost
