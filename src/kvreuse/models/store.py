"""Model store: the conversion cache (GGUF -> safetensors, once, atomically) and model identity.

A converted folder is ``<cache root>/<name>-<12 hex of source identity>`` holding the HF files
and ``kvreuse.json`` (written last; holds the SHA-256 of the weight files). Identity hashes are
computed from that stored digest, the canonical config and the tokenizer files, so computing a
``model_id`` never re-reads the weights.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvreuse.models import gguf_blocks
from kvreuse.models.sources import SPEC_HELP, ModelSource

__all__ = [
    "MARKER",
    "TOKENIZER_FILES",
    "default_cache_root",
    "conversion_dir",
    "convert_gguf",
    "compute_model_id",
    "canonical_config_json",
    "tokenizer_digest",
    "state_dict_digest",
    "weights_digest",
    "atomic_write_text",
    "file_lock",
]

MARKER = "kvreuse.json"  # written last inside a converted folder; holds the weights hash
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
)


# --------------------------------------------------------------------------- identity

_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "_model_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_attn_implementation_internal",
    "_attn_implementation_autoset",
    "_commit_hash",
    "quantization_config",
    "architectures_auto_map",
}


def canonical_config_json(config: Any) -> str:
    """Config as sorted JSON without fields that do not change the math (path, dtype, ...)."""
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(d, sort_keys=True, default=str, separators=(",", ":"))


def tokenizer_digest(folder: Path) -> str:
    """SHA-256 over the tokenizer files present in ``folder`` (name + bytes)."""
    h = hashlib.sha256()
    for fname in TOKENIZER_FILES:
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


def compute_model_id(
    name: str, weights_digest: str, config: Any, tokenizer_hash: str, dtype: str, quantization: str = "none"
) -> tuple[str, str]:
    """Return ``(model_id, full hex)``: ``name@sha256:<16 hex>`` over weights+config+tokenizer+dtype
    and, when not ``"none"``, the quantization scheme (so fp32, bf16, int8 and int4 KV never
    share block keys; unquantized ids are unchanged from before quantization existed)."""
    h = hashlib.sha256()
    parts = [f"kvreuse-model-v{FORMAT_VERSION}", weights_digest, canonical_config_json(config), tokenizer_hash, dtype]
    if quantization != "none":
        parts.append(f"quantization={quantization}")
    for part in parts:
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
        raise ValueError(f"no *.safetensors or *.bin weights in {folder}; {SPEC_HELP}")
    return files


def weights_digest(folder: Path, cache_root: Path) -> str:
    """Weights hash of a folder: from its ``kvreuse.json`` marker (converted folders), else
    hashed once and memoised under ``cache_root/digests`` keyed by file names, sizes, mtimes."""
    marker = folder / MARKER
    if marker.is_file():
        return json.loads(marker.read_text())["weights_sha256"]
    files = _weight_files(folder)
    stat_key = hashlib.sha256(
        json.dumps([str(folder.resolve())] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]).encode()
    ).hexdigest()[:32]
    memo = cache_root / "digests" / f"{stat_key}.json"
    if memo.is_file():
        return json.loads(memo.read_text())["weights_sha256"]
    digest = _hash_files(files)
    atomic_write_text(memo, json.dumps({"folder": str(folder), "weights_sha256": digest}))
    return digest


# --------------------------------------------------------------------------- cache + conversion


def default_cache_root() -> Path:
    """``$KVREUSE_CACHE_DIR`` or ``~/.cache/kvreuse/models``."""
    env = os.environ.get("KVREUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvreuse" / "models"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
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
    # A packaged GGUF is the same file in every install (its version pins it): key on name
    # and version, not on the install path, so each new venv (every CI clone) reuses one
    # conversion instead of spending a minute and a few GB on its own.
    where = "" if src.from_package else str(src.path)
    ident = f"{src.kind}|{where}|{src.gguf_name}|{src.version}|v{FORMAT_VERSION}"
    return cache_root / f"{src.name}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _status(message: str) -> None:
    # One plain line on stderr (no wrapping, no markup), also readable in CI logs.
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[kvreuse] {message}", markup=False, highlight=False)


def _gguf_location(src: ModelSource, workdir: Path) -> tuple[Path, str]:
    """(folder, file name) of the GGUF to read; assembles packaged chunks into ``workdir``."""
    if src.kind == "packaged":
        import importlib

        assert src.gguf_name is not None  # a packaged source always names its GGUF file
        pkg = importlib.import_module(src.path.name)  # the package folder is named as the module
        out = pkg.assemble(workdir / src.gguf_name)  # verifies the expected sha256
        return out.parent, out.name
    return src.path.parent, src.path.name


def fresh_temp_dir(target: Path) -> Path:
    """A new temporary sibling of ``target`` (``.tmp-<name>-*``) to build it in, after removing
    the ones an interrupted earlier build left (a Ctrl-C or a kill can end a process before its
    cleanup runs). The caller holds ``target``'s file lock, so no live build owns one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".tmp-{glob.escape(target.name)}-*"):  # a name may hold [ ]
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))


def convert_gguf(src: ModelSource, target: Path) -> Path:
    """Convert a GGUF source into a safetensors HF folder at ``target`` (atomically).

    Writes model (fp32), tokenizer, generation config and ``kvreuse.json`` (weights hash)
    into a temporary sibling folder, then renames it to ``target``; a concurrent process
    waits on a lock file and reuses the result. Returns ``target``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with file_lock(target.parent / f".{target.name}.lock"):
        if (target / MARKER).is_file():
            return target
        tmp = fresh_temp_dir(target)
        try:
            t0 = time.monotonic()
            _status(f"converting GGUF to safetensors (one time, ~20-60 s): {src.name} -> {target}")
            gguf_dir, gguf_name = _gguf_location(src, tmp / "_gguf")
            kw = {"gguf_file": gguf_name, "local_files_only": True}
            tok = AutoTokenizer.from_pretrained(str(gguf_dir), **kw)
            model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), dtype=torch.float32, **kw)
            # save_pretrained refuses a quantizer-tagged model; the weights are plain fp32 now.
            model.hf_quantizer = None  # type: ignore[assignment]  # set by from_pretrained, undeclared in transformers
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            out = tmp / "model"
            model.save_pretrained(str(out))
            tok.save_pretrained(str(out))
            del model
            blocks = gguf_blocks.output_blocks_of(gguf_dir / gguf_name)
            if blocks is not None:  # kept as the file holds them (quant.Q6KLinear)
                gguf_blocks.save(out, blocks)
            meta = {
                "format_version": FORMAT_VERSION,
                "name": src.name,
                "source": str(src.path),
                "source_version": src.version,
                "gguf_file": gguf_name,
                "weights_sha256": _hash_files(_weight_files(out)),
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "convert_seconds": round(time.monotonic() - t0, 1),
            }
            (out / MARKER).write_text(json.dumps(meta, indent=1))
            if target.exists():  # a stale, unmarked leftover (crashed older run): replace it
                shutil.rmtree(target)
            os.chmod(out, 0o755)
            for f in out.iterdir():  # safetensors writes 0600; the cache may be shared
                os.chmod(f, 0o644)
            os.rename(out, target)
            _status(f"converted {src.name} in {time.monotonic() - t0:.1f} s")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
