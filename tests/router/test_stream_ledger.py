"""``StreamLedger`` over the real SmolLM2 tokenizer: a reply cut where a character's bytes are
split across tokens is continued to exactly the text of the whole reply (decoding the
continuation's tokens alone would give replacement characters). The first executor's
chunks are made as the engine makes them: ``check_stop`` per token, a chunk whenever it
gives text, carrying the ids sampled since the last chunk."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvreuse.engine.stop_checker import check_stop
from kvreuse.router.sse import SSE_DONE, encode, payload
from kvreuse.router.stream_ledger import StreamLedger
from kvreuse.router.stream_request import StreamRequest
from kvreuse.sampling_params import SamplingParams

TEXT = "Grüße aus 東京, 🙂 und Zürich"
PROMPT = [1, 2, 3]
EOS = frozenset({2})


@dataclass
class _Seq:
    params: SamplingParams
    output_token_ids: list[int]
    text: str = ""


@pytest.fixture(scope="module")
def tokenizer():
    from kvreuse.models.tiny import _load_tokenizer, tokenizer_dir

    return _load_tokenizer(str(tokenizer_dir()))


def _chunk(text: str, ids: list[int], first: bool, reason: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if first:
        choice["prompt_token_ids"] = PROMPT
    choice["token_ids"] = ids
    return encode({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": [choice]})


def _engine_chunks(tokenizer, ids: list[int], upto: int) -> list[bytes]:
    """The first executor's chunks for the first ``upto`` tokens of ``ids``."""
    seq = _Seq(SamplingParams(max_tokens=len(ids)), [])
    chunks, pending = [], []
    for token in ids[:upto]:
        seq.output_token_ids.append(token)
        pending.append(token)
        text, reason = check_stop(seq, tokenizer, EOS)
        if text or reason:
            chunks.append(_chunk(text, pending, not chunks, reason))
            pending = []
    return chunks


def test_a_character_split_across_tokens_at_the_cut_comes_out_whole(tokenizer):
    ids = tokenizer.encode(TEXT)
    split = [c for c in range(1, len(ids)) if tokenizer.decode(ids[:c]).endswith("\ufffd")]
    assert split, "the text must have a character whose bytes span tokens"
    request = StreamRequest.of(False, {"prompt": PROMPT, "stream": True, "max_tokens": len(ids)})
    for cut in range(1, len(ids)):
        ledger = StreamLedger(request)
        for event in _engine_chunks(tokenizer, ids, cut):
            ledger.relay(event)
        sent = len(ledger.output_ids)  # the ids behind the text sent; the next executor samples the rest again
        assert ledger.prompt_ids == PROMPT and ids[:sent] == ledger.output_ids
        ledger.continue_with(request.stop_params(len(ids)), tokenizer, EOS)
        client_text = ledger.text
        for i, token in enumerate(ids[sent:]):  # the continuation's own text is of its tokens alone
            last = sent + i == len(ids) - 1
            out = ledger.translate(_chunk(tokenizer.decode([token]), [token], i == 0, "length" if last else None))
            for event in (out or b"").split(b"\n\n"):
                body = payload(event + b"\n\n")
                if body is not None:
                    assert "token_ids" not in body["choices"][0]  # the client did not ask for ids
                    client_text += body["choices"][0]["text"]
        assert client_text == TEXT, f"cut after {cut} tokens"
        assert ledger.finish_reason == "length" and ledger.done and out.endswith(SSE_DONE)
        assert ledger.usage()["completion_tokens"] == len(ids) and ledger.usage()["prompt_tokens"] == len(PROMPT)
    assert tokenizer.decode(ids[: split[0]]) + tokenizer.decode(ids[split[0] :]) != TEXT  # what decoding apart gives
