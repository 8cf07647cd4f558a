"""The sampler never fails on the numbers: a row it cannot turn into probabilities yields its
top token, and one request's sampling settings cannot fail the step it shares."""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.engine.sampler import make_generator, sample_one, top_token
from kvreuse.llm import LLM
from kvreuse.sampling_params import MIN_TOP_P, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _unchecked(**fields) -> SamplingParams:
    """Params past validation (``top_p`` below ``MIN_TOP_P``), as a caller that skipped it
    would hand the sampler: the sampler must still not produce NaN."""
    params = SamplingParams(max_tokens=6, seed=1)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 0.0])
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(top_p):
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    for seed in range(5):
        assert sample_one(logits, _unchecked(top_p=top_p), make_generator(seed, logits.device)) == 1


def test_the_smallest_valid_top_p_keeps_only_the_top_token():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    params = SamplingParams(top_p=MIN_TOP_P, seed=0)
    assert [sample_one(logits, params, make_generator(s, logits.device)) for s in range(5)] == [1] * 5


@pytest.mark.parametrize(
    ("row", "token"),
    [
        ([math.nan] * 4, 0),  # nothing to rank: the first id, never an exception
        ([0.5, math.nan, 2.0, 1.0], 2),  # the largest finite logit
        ([-math.inf] * 4, 0),
        ([0.5, math.inf, 2.0, math.nan], 1),  # +inf outranks every finite logit
    ],
)
def test_a_row_softmax_cannot_normalise_yields_its_top_token(row, token):
    logits = torch.tensor(row)
    for params in (SamplingParams(seed=3), SamplingParams(seed=3, top_p=0.5), SamplingParams(seed=3, top_k=2)):
        assert sample_one(logits, params, make_generator(3, logits.device)) == token
    assert top_token(logits) == token


def test_a_finite_row_still_samples_from_its_distribution():
    # the guard changes nothing for rows softmax can normalise: same draws as torch's own
    logits = torch.tensor([0.0, 0.1, 0.2, 0.3])
    params = SamplingParams(seed=11)
    expected = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=make_generator(11, logits.device)))
    assert sample_one(logits, params, make_generator(11, logits.device)) == expected


def test_a_request_whose_top_p_rounds_to_zero_harms_no_other_request(tiny_llama):
    """The issue's failure: ``top_p`` 5e-324 is 0 in fp32 and dropped every token (NaN, the
    step raised, the batch failed). Now that request samples its top token (greedy) and the
    greedy request beside it gets exactly what it gets alone."""
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    prompts = [list(range(10, 30)), list(range(40, 60))]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    outs = llm.generate(prompts, [_unchecked(top_p=5e-324), GREEDY])
    assert [o.token_ids for o in outs] == alone
