"""Module KV of PML schemas on disk (``--schema-dir``), so a restart loads instead of recomputing.

One safetensors file per (model, schema)::

    DIR/<sha256(model_id)[:16]>/<schema name>-<schema_hash[:16]>.safetensors
        tensors  "module:<qualified name>"  [layers, 2, stored tokens, kv_heads, head_dim]
        metadata format, model_id, schema_name, schema_hash, checksum (sha256 of the tensors
                 in key order), source (the schema's PML text, to re-register it on start)

A file is used only when its metadata names this model and this schema hash, its checksum
matches its tensors and every value is finite; otherwise ``StoreMismatch`` says why (the
caller recomputes the schema, then overwrites the file). Each refused file is counted once
in ``refused`` (by reason) and logged once, however many modules it holds; a module whose
tensor has the wrong shape is refused by the caller (``refuse``) the same way. A file whose
tensors are truncated still gives its schema's source (the safetensors header, read by
``_header``), so the schema is recomputed, not dropped. Writes go to a temporary file
renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvreuse.pml import CompiledSchema

log = logging.getLogger(__name__)

FORMAT = "kvreuse-pml-kv/1"
_PREFIX = "module:"
_FILE = re.compile(r"(.+)-[0-9a-f]{16}\.safetensors")  # <schema name>-<schema_hash[:16]>


class StoreMismatch(ValueError):
    """A stored file exists for this schema but belongs to another model or schema, or is corrupt.
    ``reason``: ``unreadable``, ``foreign``, ``checksum``, ``non_finite`` or ``shape``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _header(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, read from its header alone (8-byte length,
    then JSON), so a file whose tensor data is cut short still names its schema. Raises
    ``ValueError`` or ``OSError`` when the header itself is unreadable."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 * 1024 * 1024:
            raise ValueError(f"header of {size} bytes")
        raw = f.read(size)
    if len(raw) != size:
        raise ValueError("truncated header")
    meta = json.loads(raw).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("metadata is not an object")
    return meta


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class SchemaStore:
    """Module KV files for one model under ``root``. IO happens only in these methods."""

    def __init__(self, root: str | os.PathLike[str], model_id: str) -> None:
        self.model_id = model_id
        self.dir = Path(root) / hashlib.sha256(model_id.encode()).hexdigest()[:16]
        self._verified: dict[Path, tuple[tuple[int, int], dict[str, torch.Tensor]]] = {}
        self._refused: dict[Path, tuple[int, int]] = {}  # refused files (by stamp): not read or logged again
        self.refused: Counter[str] = Counter()  # files refused since start, by StoreMismatch.reason

    def path(self, schema: CompiledSchema) -> Path:
        return self.dir / f"{schema.name}-{schema.schema_hash[:16]}.safetensors"

    def save(self, schema: CompiledSchema, source: str, kv: dict[str, torch.Tensor]) -> Path:
        """Write every module's KV (qualified name -> CPU tensor); drop older versions of the
        schema. Raises ``OSError`` when the directory is not writable."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tensors = {_PREFIX + name: t.contiguous() for name, t in kv.items()}
        meta = {
            "format": FORMAT,
            "model_id": self.model_id,
            "schema_name": schema.name,
            "schema_hash": schema.schema_hash,
            "checksum": _checksum(tensors),
            "source": source,
        }
        target = self.path(schema)
        tmp = target.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, target)
        self._verified.pop(target, None)
        self._refused.pop(target, None)
        for old in self._files_of(schema.name):
            if old != target:
                old.unlink(missing_ok=True)
        return target

    def delete(self, name: str) -> int:
        """Remove every stored version of schema ``name`` (a deleted schema must not come
        back at the next start); returns how many files went."""
        files = self._files_of(name)
        for path in files:
            path.unlink(missing_ok=True)
            self._verified.pop(path, None)
        return len(files)

    def _files_of(self, name: str) -> list[Path]:
        """Files of schema ``name`` exactly: names may hold "-", so "a" must not match "a-b"'s."""
        if not self.dir.is_dir():
            return []
        return [p for p in self.dir.glob("*.safetensors") if (m := _FILE.fullmatch(p.name)) and m[1] == name]

    def load_module(self, schema: CompiledSchema, qualified_name: str) -> torch.Tensor | None:
        """The stored KV of one module, or ``None`` if no usable file holds this schema
        version. A file keyed to another model/schema, unreadable, failing its checksum or
        holding non-finite values is refused once (one warning, one count) and is ``None``
        from then on, until it is rewritten."""
        try:
            tensors = self._load(schema)
        except StoreMismatch as exc:
            self.refuse(schema, exc)
            return None
        return None if tensors is None else tensors.get(_PREFIX + qualified_name)

    def refuse(self, schema: CompiledSchema, exc: StoreMismatch) -> None:
        """Stop using this schema's file (its KV is recomputed): one warning, one count."""
        path = self.path(schema)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        self._verified.pop(path, None)
        self._refused[path] = (stat.st_mtime_ns, stat.st_size)
        self.refused[exc.reason] += 1
        log.warning("schema dir: refused %s (%s); recomputing schema %r", path.name, exc, schema.name)

    def sources(self) -> list[str]:
        """PML texts of every schema stored for this model (files that cannot be read are
        skipped with a warning)."""
        out = []
        for path in sorted(self.dir.glob("*.safetensors")) if self.dir.is_dir() else []:
            try:
                meta = _header(path)
            except Exception as exc:  # noqa: BLE001 - a corrupt file must not stop a start
                self.refused["unreadable"] += 1
                log.warning("schema dir: cannot read %s (%s); its schema is not restored", path, exc)
                continue
            if meta.get("model_id") != self.model_id or meta.get("format") != FORMAT or "source" not in meta:
                log.warning("schema dir: %s is not a module file of model %s; ignored", path, self.model_id)
                continue
            out.append(meta["source"])
        return out

    def _load(self, schema: CompiledSchema) -> dict[str, torch.Tensor] | None:
        path = self.path(schema)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if self._refused.get(path) == stamp:
            return None  # refused already (logged and counted then)
        cached = self._verified.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a mismatch
            raise StoreMismatch(f"it cannot be read: {exc}", "unreadable") from None
        if meta.get("model_id") != self.model_id or meta.get("schema_hash") != schema.schema_hash:
            raise StoreMismatch(
                f"it is keyed to model {meta.get('model_id')!r} / schema {meta.get('schema_hash', '')[:16]!r}, "
                f"not {self.model_id!r} / {schema.schema_hash[:16]!r}",
                "foreign",
            )
        if meta.get("checksum") != _checksum(tensors):
            raise StoreMismatch("it fails its checksum", "checksum")
        # KV is floating point, or int8 rows (uint8: values then a bf16 scale, --kv-cache-dtype int8,
        # whose model_id differs): another integer tensor (checksum recomputed or not) is not KV
        ints = [k for k, t in sorted(tensors.items()) if not t.is_floating_point() and t.dtype != torch.uint8]
        if ints:
            raise StoreMismatch(f"{ints[0].removeprefix(_PREFIX)!r} holds {tensors[ints[0]].dtype}, not KV", "dtype")
        bad = [k for k, t in sorted(tensors.items()) if not bool(torch.isfinite(_floats_of(t)).all())]
        if bad:
            raise StoreMismatch(f"{bad[0].removeprefix(_PREFIX)!r} holds non-finite values", "non_finite")
        self._verified = {path: (stamp, tensors)}  # keep one schema's tensors: restarts load schemas in turn
        return tensors


def _floats_of(t: torch.Tensor) -> torch.Tensor:
    """The floats ``t`` holds: itself, or an int8 row tensor's (uint8) bf16 scales, its last two bytes."""
    if t.dtype != torch.uint8:
        return t
    if t.dim() == 0 or t.shape[-1] <= 2:
        return torch.tensor(float("nan"))  # no room for values beside a scale: not int8 rows
    return t[..., -2:].contiguous().view(torch.bfloat16)
