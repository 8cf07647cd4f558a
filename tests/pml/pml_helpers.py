"""Helpers shared by the PML tests (imported by name: tests/pml is on sys.path)."""

from __future__ import annotations

from pathlib import Path

SCHEMAS = Path(__file__).parent / "schemas"


class CharTokenizer:
    """One token per character (id = code point); no chat template; unk id 0.

    Lets layout tests count positions by eye and keeps hypothesis tests fast.
    """

    chat_template = None
    unk_token_id = 0
    pad_token_id = None
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def encode(tokenizer, text: str) -> list[int]:
    """Reference tokenisation of plain text for expected values."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def special(tokenizer, text: str) -> list[int]:
    """Reference tokenisation of role markers (special tokens parsed)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
