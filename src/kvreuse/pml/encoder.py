"""The only place the PML compiler calls the tokenizer.

Two kinds of text are tokenised differently, on purpose:
- PML text (module text, scaffolds, arguments, prompt text) is *text*: special-token
  strings in it such as ``<|im_start|>`` are split into ordinary tokens, so a document
  or an argument can never forge a chat turn.
- Role markers come from the chat template and are tokenised with special tokens parsed.

Neither adds BOS/EOS: ``add_special_tokens=False`` throughout (the reference does the
same); a template that wants BOS renders it into its markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.pml.errors import PMLError


@dataclass(frozen=True)
class TextEncoder:
    """Wraps a Hugging Face tokenizer (anything with ``__call__`` returning input_ids)."""

    tokenizer: Any

    def text(self, text: str) -> tuple[int, ...]:
        """Token ids of PML text; special-token strings are not special here."""
        if not text:
            return ()
        return tuple(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def markers(self, text: str) -> tuple[int, ...]:
        """Token ids of role markers; special-token strings become special tokens."""
        if not text:
            return ()
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def placeholder_id(self) -> int:
        """The id filling parameter slots during precompute: unk, else pad, else eos."""
        for attribute in ("unk_token_id", "pad_token_id", "eos_token_id"):
            token_id = getattr(self.tokenizer, attribute, None)
            if token_id is not None:
                return int(token_id)
        raise PMLError("the tokenizer has no unk, pad or eos token to fill parameter slots with")
