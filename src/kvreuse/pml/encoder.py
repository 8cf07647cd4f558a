"""The only place the PML compiler calls the tokenizer.

Two kinds of text are tokenised differently, on purpose:
- PML text (module text, scaffolds, arguments, prompt text) is *text*: special-token
  strings in it such as ``<|im_start|>`` are split into ordinary tokens, so a document
  or an argument can never forge a chat turn.
- Role markers come from the chat template and are tokenised with special tokens parsed.

Neither adds BOS/EOS: ``add_special_tokens=False`` throughout (the reference does the
same); a template that wants BOS renders it into its markers.

Safe on any thread, beside any other user of the same tokenizer (the server compiles a
schema in a worker thread while the engine thread compiles prompts and the routes tokenize
plain prompts on the event loop). A Hugging Face fast tokenizer keeps which of the two ways
it tokenises in its shared Rust backend (``encode_special_tokens``): each call sets it, then
encodes, and the encode releases the GIL, so a call on another thread in between makes one
thread's text come out the other way (a prompt's role markers split into text: 24 new tokens
instead of 12; or special tokens parsed in PML text). So this module never calls such a
tokenizer nor touches its backend's mode: it encodes with private copies of the backend, one
per way, whose mode is fixed when they are made and never changes.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kvreuse.pml.errors import PMLError

# tokenizer -> {split special-token strings?: its backend's private copy in that mode}
_fixed: weakref.WeakKeyDictionary[Any, dict[bool, Any]] = weakref.WeakKeyDictionary()
_fixed_lock = threading.Lock()  # one copy per tokenizer and mode (about 0.2 s each for SmolLM2)


def _fixed_mode_backend(tokenizer: Any, split_special: bool) -> Any | None:
    """A private copy of ``tokenizer``'s Rust backend (``tokenizers.Tokenizer``) that splits
    special-token strings iff ``split_special``, made once per tokenizer and mode and never
    changed after, so concurrent encodes with it are independent (tokens added to the
    tokenizer later are not seen: a served tokenizer is fixed once loaded). ``None`` for a
    tokenizer without such a backend: it is called instead (a slow one takes the mode per call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_special_tokens"):
        return None
    with _fixed_lock:
        copies = _fixed.setdefault(tokenizer, {})
        if split_special not in copies:
            copies[split_special] = _copy(backend, split_special)
        return copies[split_special]


def _copy(backend: Any, split_special: bool) -> Any:
    """``backend`` re-made from its serialised form, set as a call with
    ``add_special_tokens=False`` and no truncation or padding sets the shared one."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = split_special
    return copy


@dataclass(frozen=True)
class TextEncoder:
    """Wraps a Hugging Face tokenizer (anything with ``__call__`` returning input_ids)."""

    tokenizer: Any

    def text(self, text: str) -> tuple[int, ...]:
        """Token ids of PML text; special-token strings are not special here."""
        return self._encode(text, split_special=True)

    def markers(self, text: str) -> tuple[int, ...]:
        """Token ids of role markers; special-token strings become special tokens."""
        return self._encode(text, split_special=False)

    def _encode(self, text: str, *, split_special: bool) -> tuple[int, ...]:
        """The ids of ``text`` as the tokenizer gives them alone with ``add_special_tokens=False``
        and ``split_special_tokens=split_special``, whatever other threads do with it."""
        if not text:
            return ()
        backend = _fixed_mode_backend(self.tokenizer, split_special)
        if backend is None:
            return tuple(
                self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"]
            )
        return tuple(backend.encode(text, add_special_tokens=False).ids)

    def placeholder_id(self) -> int:
        """The id filling parameter slots during precompute: unk, else pad, else eos."""
        for attribute in ("unk_token_id", "pad_token_id", "eos_token_id"):
            token_id = getattr(self.tokenizer, attribute, None)
            if token_id is not None:
                return int(token_id)
        raise PMLError("the tokenizer has no unk, pad or eos token to fill parameter slots with")
