"""The schema dir (pml/schema_store.py) under the engine (tiny Llama): a registered schema is
saved and restored at start; a corrupt file, one keyed to another model or an unwritable dir
costs a recompute and a warning, never a failed start or wrong KV; names stay apart and a
removed schema is forgotten."""

import pytest
import torch

from tests.engine_helpers import LogitsSpy
from tests.pml.test_module_cache import GREEDY, SCHEMA, SINGLE, make


def test_schema_dir_persists_and_rejects_corrupt_files(tiny_llama, tmp_path, caplog):
    first = make(tiny_llama, schema_dir=str(tmp_path))
    assert first.register_schema(SCHEMA).computed == 4
    prompt = '<prompt schema="s"><b/><r who="Cy"/>Why?</prompt>'
    spy = LogitsSpy(first)
    ref = first.generate(prompt, GREEDY)[0]
    (path,) = list(tmp_path.rglob("*.safetensors"))

    restarted = make(tiny_llama, schema_dir=str(tmp_path))
    (info,) = restarted.engine.restored_schemas
    assert (info.name, info.computed, info.loaded) == ("s", 0, 4)
    spy2 = LogitsSpy(restarted)
    out = restarted.generate(prompt, GREEDY)[0]
    assert out.token_ids == ref.token_ids
    assert (spy.rows[0] - spy2.rows[0]).abs().max().item() <= 1e-6

    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the last tensor
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        third = make(tiny_llama, schema_dir=str(tmp_path))  # restores at start: warns and recomputes
    (info,) = third.engine.restored_schemas
    assert info.computed == 4 and info.loaded == 0
    assert "checksum" in caplog.text
    assert third.generate(prompt, GREEDY)[0].token_ids == ref.token_ids
    assert make(tiny_llama, schema_dir=str(tmp_path)).engine.restored_schemas[0].loaded == 4  # rewritten


def _rewrite(path, change) -> None:
    """Rewrite a stored file with ``change`` applied to every tensor and a valid checksum."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvreuse.pml.schema_store import _checksum

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = {k: change(t).contiguous() for k, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={**meta, "checksum": _checksum(tensors)})


@pytest.mark.parametrize("mode", ["shape", "truncated", "non_finite"])
def test_a_corrupt_store_file_costs_one_recompute_and_one_log_line(tiny_llama, tmp_path, caplog, mode):
    # Each mode used to stop the start (shape: RuntimeError), drop the schema (truncated) or
    # serve NaN KV (non_finite). Now: the server starts, the file is refused once (one
    # warning, one count by reason), the schema recomputed, the output right, the file rewritten.
    first = make(tiny_llama, schema_dir=str(tmp_path))
    first.register_schema(SCHEMA)
    prompt = '<prompt schema="s"><b/><r who="Cy"/>Why?</prompt>'
    ref = first.generate(prompt, GREEDY)[0]
    (path,) = list(tmp_path.rglob("*.safetensors"))
    if mode == "shape":
        _rewrite(path, lambda t: t[:, :, :, :1])  # one KV head where the model has two
    elif mode == "non_finite":
        _rewrite(path, lambda t: torch.full_like(t, float("nan")))
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # header intact, tensors cut
    reason = {"shape": "shape", "truncated": "unreadable", "non_finite": "non_finite"}[mode]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvreuse"):
        restarted = make(tiny_llama, schema_dir=str(tmp_path))
    (info,) = restarted.engine.restored_schemas
    assert (info.name, info.computed, info.loaded) == ("s", 4, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"schema dir: refused {path.name} (")
    assert warnings[0].endswith("; recomputing schema 's'")
    assert restarted.engine.stats().schema_store_refused == {reason: 1}
    assert restarted.generate(prompt, GREEDY)[0].token_ids == ref.token_ids
    again = make(tiny_llama, schema_dir=str(tmp_path))  # rewritten by the recompute
    assert again.engine.restored_schemas[0].loaded == 4 and again.engine.stats().schema_store_refused == {}


# float64 and a dropped tensor were checked too and pass (recomputed / loaded right); a header
# that is not a JSON object drops the schema, but its source lives only there.
@pytest.mark.parametrize("mode", ["int_dtype"])
def test_more_corrupt_store_modes_cost_one_recompute(tiny_llama, tmp_path, mode):
    """More ways a --schema-dir file can be wrong at start: each must be refused (or
    recomputed) with the output right, never loaded as KV."""
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
        import struct

        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = b"[]".ljust(n)
        path.write_bytes(raw[:8] + header + raw[8 + n :])
    restarted = make(tiny_llama, schema_dir=str(tmp_path))
    infos = restarted.engine.restored_schemas
    assert [i.name for i in infos] == ["s"], "the schema must be restored (recomputed), not dropped"
    assert restarted.generate(prompt, GREEDY)[0].token_ids == ref.token_ids


def test_schema_dir_refuses_a_file_keyed_to_another_model(tiny_llama, tmp_path, caplog):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    make(tiny_llama, schema_dir=str(tmp_path)).register_schema(SCHEMA)
    (path,) = list(tmp_path.rglob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    save_file(load_file(str(path)), str(path), metadata={**meta, "model_id": "someone-else@sha256:0"})
    llm = make(tiny_llama, schema_dir=str(tmp_path))
    assert llm.engine.restored_schemas == []  # not this model's file: ignored at start
    with caplog.at_level("WARNING"):
        info = llm.register_schema(SCHEMA)
    assert info.computed == 4 and info.loaded == 0
    assert "keyed to model 'someone-else@sha256:0'" in caplog.text


def test_schema_dir_keeps_names_apart_and_forgets_removed_schemas(tiny_llama, tmp_path):
    first = make(tiny_llama, schema_dir=str(tmp_path))
    first.register_schema(SINGLE.replace('name="one"', 'name="a-b"'))
    first.register_schema(SINGLE.replace('name="one"', 'name="a"').replace("green", "red"))
    assert sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.rglob("*.safetensors")) == ["a", "a-b"]
    assert first.remove_schema("a")
    assert [p.name.rsplit("-", 1)[0] for p in tmp_path.rglob("*.safetensors")] == ["a-b"]
    restarted = make(tiny_llama, schema_dir=str(tmp_path))
    assert [i.name for i in restarted.engine.restored_schemas] == ["a-b"]


def test_unwritable_schema_dir_is_a_warning_not_a_failure(tiny_llama, tmp_path, monkeypatch, caplog):
    """The schema dir is a cache: a failed save leaves the schema serving (persisted False),
    a restart on a dir whose file must be rewritten still starts, and a file deleted while
    serving is written again when the schema is registered again."""
    from kvreuse.pml.schema_store import SchemaStore

    first = make(tiny_llama, schema_dir=str(tmp_path))
    assert first.register_schema(SCHEMA).persisted is True
    (path,) = list(tmp_path.rglob("*.safetensors"))
    path.unlink()
    again = first.register_schema(SCHEMA)
    assert (again.computed, again.persisted) == (0, True) and path.is_file()  # rewritten though nothing was computed

    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # fails its checksum: the restart recomputes and must rewrite it
    path.write_bytes(bytes(data))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(SchemaStore, "save", refuse)
    with caplog.at_level("WARNING"):
        restarted = make(tiny_llama, schema_dir=str(tmp_path))  # used to fail to start
    (info,) = restarted.engine.restored_schemas
    assert info.computed == 4 and "cannot save schema 's'" in caplog.text
    out = restarted.generate('<prompt schema="s"><a/><r who="Bo"/>Go on.</prompt>', GREEDY)[0]
    assert out.finish_reason == "length"
    fresh = restarted.register_schema(SINGLE)
    assert fresh.persisted is False and "one" in restarted.engine.modules.schemas
