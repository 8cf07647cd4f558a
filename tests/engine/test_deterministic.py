"""``deterministic=True`` (``--deterministic``): a temperature-0 request gets the same tokens,
and the same log-probabilities to the bit, on a prefix-cache miss, on a hit, on a second hit,
inside a batch of four, and with prompt-lookup speculation; on a bf16 int4 tiny Llama (the
default's kernels: a miss of 300 tokens takes the many-row path the fast default switches to)
and, slow, on the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.models.tiny import tiny_model

TEXT = (Path(__file__).parent.parent / "data" / "perplexity_text.txt").read_text()


def _answers(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[tuple]]]:
    """Each prompt's greedy tokens and, per token, its top-5 log-probabilities (exact floats)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    return [
        (list(o.token_ids), [(lp.top_token_ids, lp.top_logprobs) for lp in o.logprobs])
        for o in llm.generate(prompts, params)
    ]


def _miss_hit_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> None:
    llm.reset_prefix_cache()
    (miss,) = _answers(llm, prompts[:1], max_tokens)
    (hit,) = _answers(llm, prompts[:1], max_tokens)
    (hit_again,) = _answers(llm, prompts[:1], max_tokens)
    assert hit == miss
    assert hit_again == miss
    llm.reset_prefix_cache()
    batch = _answers(llm, prompts, max_tokens)  # four misses sharing every step
    assert batch[0] == miss
    batched_hits = _answers(llm, prompts[::-1], max_tokens)  # four hits, in another order
    assert batched_hits[-1] == miss
    assert batched_hits[::-1] == batch


@pytest.fixture(scope="module")
def tiny_int4():
    return tiny_model("llama", seed=0, dtype="bfloat16", quantization="int4")


def _prompts(tokenizer, length: int) -> list[list[int]]:
    ids = tokenizer(TEXT * 4).input_ids
    return [ids[i * 7 : i * 7 + length] for i in range(4)]


def test_tiny_bf16_int4_same_answer_on_miss_hit_and_in_a_batch(tiny_int4):
    llm = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True)
    assert llm.engine.runner.deterministic
    _miss_hit_batch(llm, _prompts(tiny_int4.tokenizer, 300), max_tokens=8)
    llm.engine.pool.check_integrity()


def test_tiny_chunked_prefill_and_speculation_keep_the_answer(tiny_int4):
    prompts = _prompts(tiny_int4.tokenizer, 300)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    whole = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True)
    ref = [list(o.token_ids) for o in whole.generate(prompts, params)]
    # prefill in chunks of 48 tokens (7 steps for a 300-token prompt), 4 prompts sharing steps
    chunked = LLM(
        loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True, max_num_batched_tokens=48
    )
    assert [list(o.token_ids) for o in chunked.generate(prompts, params)] == ref
    spec = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True, speculative_tokens=4)
    assert [list(o.token_ids) for o in spec.generate(prompts, params)] == ref


def test_deterministic_refuses_a_model_without_the_llama_forward():
    gemma = tiny_model("gemma3", seed=0)
    with pytest.raises(ValueError, match="--deterministic needs a plain Llama model"):
        LLM(loaded=gemma, kv_cache_memory_gib=0.01, deterministic=True)


@pytest.mark.slow
def test_default_model_same_answer_on_miss_hit_and_in_a_batch():
    llm = LLM("default", kv_cache_memory_gib=0.25, deterministic=True)  # auto: int4 weights, bf16 on this CPU
    _miss_hit_batch(llm, _prompts(llm.tokenizer, 600), max_tokens=16)
