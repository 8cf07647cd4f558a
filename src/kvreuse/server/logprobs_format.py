"""OpenAI's two ``logprobs`` shapes, built from the engine's ``TokenLogprobs``.

Completions (``logprobs: k``), per choice::

    {"tokens": ["Paris", ...], "token_logprobs": [-0.3, ...],
     "top_logprobs": [{"Paris": -0.3, " Lyon": -2.1}, ...], "text_offset": [0, 5, ...]}

``top_logprobs[i]`` holds the ``k`` most likely tokens, most likely first, plus the sampled
token when it is not among them (OpenAI: "up to logprobs + 1 elements"); two ids that decode
to the same string share one key. ``text_offset[i]`` is where token ``i``'s string starts,
counting the echoed prompt and every earlier token string.

Chat (``logprobs: true, top_logprobs: k``), per choice::

    {"content": [{"token": "Paris", "logprob": -0.3, "bytes": [80, ...],
                  "top_logprobs": [{"token": "Paris", "logprob": -0.3, "bytes": [...]}, ...]}]}

with exactly ``k`` entries in each ``top_logprobs``, most likely first.

Both: the raw model distribution (``log_softmax`` of the logits before temperature, top-k
and top-p), as vLLM returns by default. A token's string is its id decoded alone, special
tokens kept (an EOS that ended the request is listed too). ``-inf`` becomes ``-9999.0``,
as in vLLM, because JSON has no infinity. Streaming chunks carry the entries of the tokens
their text came from, so concatenated chunks equal the whole response.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvreuse.engine.logprobs import TokenLogprobs

_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _FLOOR)


class TokenStrings:
    """Token id -> its string (decoded alone, special tokens kept); memoised per response."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class CompletionLogprobs:
    """Builds one completions choice's ``logprobs`` object, chunk by chunk: ``text_offset``
    continues from the previous ``build``. Start with ``text_offset`` = the echoed text's length."""

    def __init__(self, tokenizer: Any, text_offset: int = 0) -> None:
        self._strings = TokenStrings(tokenizer)
        self._offset = text_offset

    def build(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in entries:
            text = self._strings(lp.token_id)
            tokens.append(text)
            token_logprobs.append(_clamp(lp.logprob))
            ranked = {self._strings(t): _clamp(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            ranked.setdefault(text, _clamp(lp.logprob))
            top.append(ranked)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class ChatLogprobs:
    """Builds one chat choice's ``logprobs`` object (``{"content": [...]}``) for some tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self._strings = TokenStrings(tokenizer)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._strings(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

    def build(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)],
                }
                for lp in entries
            ]
        }
