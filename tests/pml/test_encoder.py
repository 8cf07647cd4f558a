"""``TextEncoder`` with another thread using the same tokenizer (the server compiles a schema
off the engine thread while the engine thread compiles prompts, and the routes tokenize plain
prompts on the event loop).

A Hugging Face fast tokenizer keeps "split special-token strings or not" in its shared Rust
backend (``encode_special_tokens``): every call sets it, then encodes with it, and the encode
releases the GIL. The tests put another thread's tokenizer call exactly between the two (a
proxy of the backend parks the first encode until the other call has run), the interleaving
that made a request overlapping a schema registration get its role markers split into text
(24 new tokens instead of 12, tests/server/test_schema_routes.py)."""

from __future__ import annotations

import threading

import pytest

from kvreuse.pml.encoder import TextEncoder

SPECIAL = "<|im_start|>user\nWhich ship?<|im_end|>\n"


class ParkedBackend:
    """Forwards to the tokenizer's real backend; the first encode from ``owner`` first runs
    ``other`` in a thread of its own (to the end), as if it had been scheduled right there."""

    def __init__(self, backend, owner: threading.Thread, other) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_other", other)
        object.__setattr__(self, "interleaved", 0)

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in ("encode", "encode_batch") or not callable(attr):
            return attr

        def encode(*args, **kwargs):
            if threading.current_thread() is self._owner and not self.interleaved:
                object.__setattr__(self, "interleaved", 1)
                other = threading.Thread(target=self._other)
                other.start()
                other.join(30)
            return attr(*args, **kwargs)

        return encode

    def __setattr__(self, name, value):
        setattr(self._backend, name, value)


@pytest.mark.parametrize("first, other", [("text", "markers"), ("markers", "text"), ("text", "plain call")])
def test_an_encode_keeps_its_mode_when_another_thread_tokenizes_in_between(tokenizer, monkeypatch, first, other):
    encoder = TextEncoder(tokenizer)
    alone = {"text": encoder.text(SPECIAL), "markers": encoder.markers(SPECIAL)}
    assert len(alone["text"]) > len(alone["markers"])  # the special strings split into ordinary tokens
    others = {
        "text": lambda: encoder.text("Fact 7: the keeper"),
        "markers": lambda: encoder.markers("<|im_end|>"),
        "plain call": lambda: tokenizer("Tell me about the ships.", add_special_tokens=False),
    }
    seen = {}

    def other_call():
        seen["other"] = others[other]()

    backend = ParkedBackend(tokenizer.backend_tokenizer, threading.current_thread(), other_call)
    monkeypatch.setattr(tokenizer, "_tokenizer", backend)
    got = encoder.text(SPECIAL) if first == "text" else encoder.markers(SPECIAL)
    monkeypatch.undo()
    assert got == alone[first]


def test_the_encoder_never_sets_the_tokenizers_shared_mode(tokenizer, monkeypatch):
    set_names = []

    class Recording:
        def __init__(self, backend) -> None:
            object.__setattr__(self, "_backend", backend)

        def __getattr__(self, name):
            return getattr(self._backend, name)

        def __setattr__(self, name, value):
            set_names.append(name)
            setattr(self._backend, name, value)

    encoder = TextEncoder(tokenizer)
    monkeypatch.setattr(tokenizer, "_tokenizer", Recording(tokenizer.backend_tokenizer))
    encoder.text(SPECIAL), encoder.markers(SPECIAL), encoder.text(SPECIAL)
    monkeypatch.undo()
    assert set_names == []


def test_the_encoder_gives_the_tokenizers_own_ids(tokenizer):
    encoder = TextEncoder(tokenizer)
    for text in (SPECIAL, "Fact 7: the keeper of lighthouse 7", " leading space", "a<|endoftext|>b", "héllo 漢字 🙂"):
        assert (
            list(encoder.text(text))
            == tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        )
        assert list(encoder.markers(text)) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encoder.text("") == encoder.markers("") == ()
