"""The raw blocks of a GGUF tensor that a kvreuse kernel keeps as the file holds them: today the
output projection when the file stores it as Q6_K (llama.cpp's choice for the output tensor of
most 4- and 5-bit files; ``quant.Q6KLinear``).

A converted folder keeps them in ``gguf_blocks.st`` (safetensors, named so that neither the
weights hash nor transformers take it for model weights), written by ``store.convert_gguf`` from
the GGUF it converts; for a folder converted before that, a plain GGUF source is read again at
load. No blocks: the output projection is requantized to int8 as before.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

__all__ = ["FILE", "output_blocks_of", "save", "load"]

log = logging.getLogger(__name__)

FILE = "gguf_blocks.st"
_KEY = "output.q6_k"


def output_blocks_of(gguf_path: Path) -> torch.Tensor | None:
    """The output projection's Q6_K blocks ``[vocab, hidden / 256 * 210]`` uint8 (``output.weight``,
    else the tied ``token_embd.weight``), or None when the file holds it in another type or
    cannot be read."""
    try:
        import gguf
        import numpy as np

        tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
        t = tensors.get("output.weight") or tensors.get("token_embd.weight")
        if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q6_K or t.data.ndim != 2:
            return None
        return torch.from_numpy(np.array(t.data, dtype=np.uint8))  # a copy: the reader's map closes
    except Exception:  # noqa: BLE001 - an unreadable file keeps the int8 output projection
        return None


def save(folder: Path, blocks: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({_KEY: blocks.contiguous()}, str(folder / FILE))


def load(folder: Path) -> torch.Tensor | None:
    """The blocks ``save`` wrote into ``folder``, or None: also for a file that cannot be read
    (corrupt, truncated, another tensor), logged and ignored: the load goes on as without the
    file (a GGUF source's blocks read again, else int8) rather than failing on an optional file."""
    path = folder / FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        blocks = load_file(str(path)).get(_KEY)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type, or OSError
        log.warning("%s unreadable, ignored: %s", path, exc)
        return None
    if blocks is None or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        log.warning("%s holds no Q6_K blocks (uint8 [rows, bytes]), ignored", path)
        return None
    return blocks
