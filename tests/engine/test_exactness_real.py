"""Exactness on the real models in fp32: a prefix-cache hit gives the same tokens as no
caching and the same logits within 1e-4, also when the hit ends mid-prompt at a block
boundary and past Gemma 3's 512-token sliding window."""

import pytest

from kvreuse import LLM, SamplingParams
from tests.engine_helpers import LogitsSpy, reference_logits

GREEDY = SamplingParams(max_tokens=12, temperature=0)
TEXT = (
    "The lighthouse keeper of Varnholm kept a ledger of every ship that passed. "
    "In it he wrote the name, the flag, the hour and the weather. "
) * 40


def check_model(loaded, prompt_len: int):
    tok = loaded.tokenizer
    prompt = tok.encode(TEXT)[:prompt_len]
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.25, block_size=16)
    spy = LogitsSpy(llm)
    cold = llm.generate(prompt, GREEDY)[0]
    warm = llm.generate(prompt, GREEDY)[0]
    assert warm.num_cached_tokens >= len(prompt) - 16
    assert warm.token_ids == cold.token_ids
    n = len(spy.rows) // 2
    diffs = [(a - b).abs().max().item() for a, b in zip(spy.rows[:n], spy.rows[n:])]
    assert max(diffs) <= 1e-4, diffs

    # a second prompt sharing only the first 10 blocks: the hit ends mid-prompt
    branch = prompt[:160] + tok.encode(" Then the fog came and nothing passed for a week.")
    out = llm.generate(branch, SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.num_cached_tokens == 160
    ref = reference_logits(loaded.model, branch)
    assert (spy.rows[-1] - ref[-1]).abs().max().item() <= 1e-4

    nocache = LLM(loaded=loaded, kv_cache_memory_gib=0.25, block_size=16, enable_prefix_caching=False)
    assert nocache.generate(prompt, GREEDY)[0].token_ids == cold.token_ids


def test_default_model_reuse_is_exact(default_model):
    check_model(default_model, 400)


@pytest.fixture(scope="module")
def gemma3():
    from kvreuse.models.loader import load_model

    return load_model("gemma3-270m")


def test_gemma3_reuse_is_exact_past_the_sliding_window(gemma3):
    check_model(gemma3, 700)
