"""The schema dir through the real server (tiny Llama): a schema POSTed (registered in slices)
is saved; a restart over a file with a wrong tensor shape, cut-short tensors or all-NaN KV
with a valid checksum starts all the same, refuses the file with one warning and one count,
recomputes the schema (counted in tokens_computed_total) and answers as before; a good file
is loaded and the restore logged and counted."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from .fresh_app import fresh_client

SCHEMA = """<schema name="docs">
  <system>Answer from the documents.</system>
  <union>
    <module name="d1">Document one: the mill on Tarn creek grinds barley every Tuesday.</module>
    <module name="d2">Document two: the ferry to Osk leaves at seven and returns at nine.</module>
  </union>
  <module name="who">Asker: <param name="name" len="4"/>.</module>
</schema>"""
PROMPT = {"prompt": '<prompt schema="docs"><d2/><who name="Ana"/><user>When does the ferry leave?</user></prompt>',
          "max_tokens": 8, "temperature": 0}


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
