"""The tokenizer probe: token ids of a fixed text and a fixed chat.

An executor publishes ``tokenizer_probe(its tokenizer)`` on ``/v1/kvreuse/info``; a router
computes the same with its own tokenizer and refuses to start when they differ, since its
block keys would never match the executor's.
"""

from __future__ import annotations

from typing import Any

PROBE_TEXT = "kvreuse tokenizer probe: The quick brown fox jumps over 13 lazy dogs."
PROBE_CHAT = ({"role": "system", "content": "You are a probe."}, {"role": "user", "content": PROBE_TEXT})


def tokenizer_probe(tokenizer: Any) -> dict[str, list[int] | None]:
    """Token ids of ``PROBE_TEXT`` (as completions encode it) and of ``PROBE_CHAT`` (as
    chat renders it: template text, then encoded without special tokens); the chat entry
    is ``None`` when the tokenizer has no chat template."""
    chat = None
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(PROBE_CHAT), add_generation_prompt=True, tokenize=False)
        chat = list(tokenizer.encode(text, add_special_tokens=False))
    return {"text": list(tokenizer.encode(PROBE_TEXT)), "chat": chat}
