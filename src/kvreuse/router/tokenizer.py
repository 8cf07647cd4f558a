"""Load the executors' tokenizer (just the tokenizer, never the weights) and check it.

The executor says where its tokenizer came from (``tokenizer_path``) and which model it
runs (``model_name``, a ``--model`` spec). The router loads the folder when it exists on
this machine, else resolves the model spec with ``kvreuse.model_loader.prepare_folder``
(which converts a packaged GGUF once, as the executor did). Either way it then checks the
executor's ``tokenizer_probe``: same token ids for a fixed text and a fixed chat, or the
router refuses to start, since its keys would never match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreuse.api.probe import tokenizer_probe
from kvreuse.router.executors import ExecutorInfo


class TokenizerMismatch(ValueError):
    """The router's tokenizer or chat template does not tokenize as the executor's."""


def tokenizer_folder(info: ExecutorInfo) -> Path:
    if info.tokenizer_path and Path(info.tokenizer_path).is_dir():
        return Path(info.tokenizer_path)
    from kvreuse.models.loader import prepare_folder

    return prepare_folder(info.model_name)[1]


def load_tokenizer(info: ExecutorInfo) -> Any:
    """The tokenizer of ``info``'s model, checked against its probe. Raises
    ``TokenizerMismatch`` or ``ValueError`` (model spec not resolvable here)."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder(info)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    check_probe(tokenizer, info)
    return tokenizer


def check_probe(tokenizer: Any, info: ExecutorInfo) -> None:
    expected = info.tokenizer_probe
    if not expected:
        return  # an executor that sends no probe: nothing to check against
    mine = tokenizer_probe(tokenizer)
    for part in ("text", "chat"):
        if mine.get(part) != expected.get(part):
            raise TokenizerMismatch(
                f"the router's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) tokenizes the {part} probe "
                f"differently from {info.url} (model {info.model_name!r}); its block keys would never match"
            )
