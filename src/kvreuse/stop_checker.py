"""After each sampled token: detokenize, cut stop strings, decide whether the request ends."""

from __future__ import annotations

from kvreuse.sequence import Sequence


def check_stop(seq: Sequence, tokenizer, eos_token_ids: frozenset[int]) -> tuple[str, str | None]:
    """Update ``seq.text`` for the token just appended; return ``(new_text, finish_reason)``.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` reached) or ``None``. A stop string and EOS are not part of the text
    (unless ``include_stop_str_in_output``).
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
    new_text = text[len(seq.text) :] if text.startswith(seq.text) else text
    seq.text = text
    return new_text, reason
