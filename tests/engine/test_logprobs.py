"""Logprobs in the Python API (``SamplingParams(logprobs=k)``) on the tiny random Llama.

The reference is a plain transformers forward over prompt + earlier output tokens, then
``log_softmax``: what kvreuse returns is the raw model distribution, before temperature.
"""

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine import logprobs as logprobs_module
from tests.engine_helpers import reference_logits

PROMPT = [(i * 53) % 3000 + 20 for i in range(37)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]``: log_softmax at each position that produced an output token."""
    logits = reference_logits(model, prompt + output)  # [len, vocab]
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def test_greedy_token_is_the_top_logprob_and_matches_a_plain_forward(llm, tiny_llama):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = reference_logprobs(tiny_llama.model, PROMPT, out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.rank == 1 and lp.top_token_ids[0] == lp.token_id
        assert lp.logprob == max(lp.top_logprobs)
        assert len(lp.top_logprobs) == len(lp.top_token_ids) == 5
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        assert abs(lp.logprob - ref[i, lp.token_id].item()) <= 1e-4
        expected = torch.topk(ref[i], 5)
        assert list(lp.top_token_ids) == expected.indices.tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), expected.values, atol=1e-4)


def test_sampled_tokens_report_the_distribution_before_temperature(llm, tiny_llama):
    params = SamplingParams(max_tokens=5, temperature=1.7, top_k=50, seed=3, ignore_eos=True, logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    ref = reference_logprobs(tiny_llama.model, PROMPT, out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - ref[i, lp.token_id].item()) <= 1e-4
        assert lp.rank == int((ref[i] > ref[i, lp.token_id]).sum()) + 1


def test_zero_top_logprobs_still_gives_the_sampled_token(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=0))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.top_token_ids == () and lp.top_logprobs == () for lp in out.logprobs)


def test_batch_mixes_requests_with_and_without_logprobs(llm):
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=3))
    engine.add_request("b", PROMPT[:20], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "a":
                assert o.new_logprobs is not None and len(o.new_logprobs) == 1
                assert o.new_logprobs[0].token_id == o.new_token_ids[0]
            else:
                assert o.logprobs is None and o.new_logprobs is None
            final[o.request_id] = o
    assert len(final["a"].logprobs) == 3 and len(final["b"].token_ids) == 3


def test_no_logprobs_requested_means_no_log_softmax(llm, monkeypatch):
    calls = []
    monkeypatch.setattr(logprobs_module, "compute_logprobs", lambda *a: calls.append(a) or [])  # looked up there
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))[0]
    assert calls == [] and out.logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_out_of_range_logprobs_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_a_rows_top_list_does_not_depend_on_what_other_rows_asked():
    """Tied logprobs: the top list of a row asking for 5 is the same alone and beside a row
    asking for 20 (topk's choice among ties depends on k), ties in token-id order."""
    from kvreuse.engine.logprobs import compute_logprobs

    row = torch.full((1, 3000), -10.0)
    row[0, [2000, 1000, 40, 30, 20, 10]] = 5.0  # six tokens tied at the top
    alone = compute_logprobs(row, [10], [5])[0]
    beside = compute_logprobs(torch.cat([row, torch.randn(1, 3000)]), [10, 0], [5, 20])[0]
    assert alone == beside
    assert alone.top_token_ids == (10, 20, 30, 40, 1000)
