"""After each sampled token: detokenize, cut stop strings, decide whether the request ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvreuse.sampling_params import SamplingParams


class StopState(Protocol):
    """What ``check_stop`` reads and writes of a request: the engine's ``Sequence``, or the
    router's replay of a stream (which checks stops without the engine's imports)."""

    params: SamplingParams
    output_token_ids: list[int]
    text: str


def check_stop(seq: StopState, tokenizer, eos_token_ids: frozenset[int]) -> tuple[str, str | None]:
    """Update ``seq.text`` for the token just appended; return ``(new_text, finish_reason)``.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` reached) or ``None``. A stop string and EOS are not part of the text
    (unless ``include_stop_str_in_output``). While stop strings are active, the last
    ``max(len(stop)) - 1`` characters are held back until the request ends, so the
    ``new_text`` pieces always add up to the final ``seq.text``.
    """
    params = seq.params
    token = seq.output_token_ids[-1]
    ended_by_token = token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
    ids = seq.output_token_ids[:-1] if ended_by_token else seq.output_token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    reason: str | None = "stop" if ended_by_token else None
    if params.stop:
        # a stop string can only newly appear in the tail that this token touched
        search_from = max(0, len(seq.text) - max(len(s) for s in params.stop))
        hits = [(text.find(s, search_from), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            text = text[: i + len(s)] if params.include_stop_str_in_output else text[:i]
            reason = "stop"
    if reason is None and len(seq.output_token_ids) >= params.max_tokens:
        reason = "length"
    if reason is None and text.endswith("\ufffd"):
        return "", None  # an incomplete UTF-8 character: wait for the next token
    if reason is None and params.stop:
        # Hold back a tail that could be the start of a stop string: streamed text cannot
        # be taken back if the next tokens complete the stop string (as vLLM does).
        text = text[: max(len(seq.text), len(text) - (max(len(s) for s in params.stop) - 1))]
    new_text = text[_common_prefix(text, seq.text) :]  # never re-sends what was streamed
    seq.text = text
    return new_text, reason


def _common_prefix(a: str, b: str) -> int:
    if a.startswith(b):
        return len(b)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
