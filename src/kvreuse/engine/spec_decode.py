"""Prompt-lookup (n-gram) drafting for speculative decoding, as vLLM's ``ngram`` method and
llama.cpp's lookup decoding: no draft model, the context itself proposes the next tokens.

Pure functions and a small per-request state; no tensors, no engine. ``draft_for`` gives the
running requests their drafts before a step; the engine (``llm_engine.py``) verifies a draft
in one forward (the last token plus the draft as a short prefill chunk) and the output
processor (``output_processor.py``) keeps the longest prefix the model agrees with, plus the
model's own next token, so a greedy request's output is exactly what it is without speculation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

MAX_BACKOFF_STEPS = 32  # longest pause (decode steps) after drafts that kept not paying
# A verification costs about 2-2.5 decode steps on CPU (docs/benchmarks.md): it pays from this
# many accepted tokens; a draft accepted less counts as rejected for the pause.
MIN_PAYING_ACCEPTED = 2


def propose(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last ``n``
    tokens of ``tokens`` (``[L]`` int64), for ``n`` from ``max_n`` down to ``min_n``; ``[]``
    when no n-gram recurs (or ``k < 1``). The suffix itself is not a match. A match that
    overlaps the suffix (a loop, ``x y x y``) continues with its period past the end
    (``x y``), so a repetition drafts ``k`` tokens, not only the few already there."""
    length = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = length - n  # candidate match starts 0..starts-1 (each has a token after it)
        hit = tokens[:starts] == tokens[length - n]  # [starts]
        for j in range(1, n):
            hit &= tokens[j : starts + j] == tokens[length - n + j]
        found = np.flatnonzero(hit)
        if len(found):
            i = int(found[-1]) + n
            draft = tokens[i : i + k].tolist()
            period = length - i  # the draft's token j + period is its token j (the match repeats)
            while len(draft) < k:
                draft.append(draft[len(draft) - period])
            return draft
    return []


@dataclass
class SpecState:
    """One request's speculation: its tokens as an array (grown, never rebuilt), counters,
    and the adaptive pause: after a draft of which fewer than ``MIN_PAYING_ACCEPTED`` tokens
    were accepted the request skips drafting for ``backoff`` steps (doubling up to
    ``MAX_BACKOFF_STEPS``; a draft that pays resets it), so text that does not quote its
    context pays one verification every ``MAX_BACKOFF_STEPS`` steps or so."""

    num_draft_tokens: int = 0  # drafted tokens sent to verification
    num_accepted_tokens: int = 0  # of those, accepted
    backoff: int = 0  # steps to pause after the next fully rejected draft
    pause: int = 0  # steps left before drafting again
    _tokens: np.ndarray = field(default_factory=lambda: np.zeros(256, np.int64), repr=False)  # [capacity]
    _num_tokens: int = 0

    def tokens(self, token_ids_between, num_tokens: int) -> np.ndarray:
        """``[num_tokens]`` view of the request's tokens; ``token_ids_between(start, end)``
        supplies the ones not copied yet."""
        if num_tokens > len(self._tokens):
            grown = np.zeros(max(num_tokens, 2 * len(self._tokens)), np.int64)
            grown[: self._num_tokens] = self._tokens[: self._num_tokens]
            self._tokens = grown
        if num_tokens > self._num_tokens:
            self._tokens[self._num_tokens : num_tokens] = token_ids_between(self._num_tokens, num_tokens)
        self._num_tokens = num_tokens
        return self._tokens[:num_tokens]

    def ready(self) -> bool:
        """Whether to draft this step (counts a paused step down)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: ``accepted`` of ``drafted`` tokens kept."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if accepted >= min(MIN_PAYING_ACCEPTED, drafted):
            self.backoff = 0
        else:
            self.backoff = min(MAX_BACKOFF_STEPS, max(1, 2 * self.backoff))
            self.pause = self.backoff


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many leading ``draft`` tokens equal the model's greedy ``targets`` (``targets[i]``:
    the model's token after the last token and ``draft[:i]``; ``len(draft) + 1`` of them)."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a


class Drafting(Protocol):
    """What ``draft_for`` reads and writes of a running request (``engine.sequence.Sequence``)."""

    spec: SpecState | None
    num_computed_tokens: int
    draft_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...
    @property
    def params(self) -> _MaxTokens: ...
    def token_ids_between(self, start: int, end: int) -> list[int]: ...


class _MaxTokens(Protocol):
    @property
    def max_tokens(self) -> int: ...


def draft_for(running: Iterable[Drafting], *, k_max: int, min_n: int, max_n: int) -> None:
    """Prompt lookup: give each greedy decoding request that speculates (``seq.spec``) a draft
    (``propose``) of at most ``k_max`` tokens, never past its ``max_tokens`` (the model's own
    next token always follows the accepted ones). Every other running request's draft is
    cleared: a draft lives one step, a stale one is never verified."""
    for seq in running:
        spec = seq.spec
        seq.draft_token_ids = []
        if spec is None or seq.num_computed_tokens != seq.num_tokens - 1 or not spec.ready():
            continue
        k = min(k_max, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        if k < 1:
            continue
        tokens = spec.tokens(seq.token_ids_between, seq.num_tokens)
        seq.draft_token_ids = propose(tokens, min_n=min_n, max_n=max_n, k=k)
