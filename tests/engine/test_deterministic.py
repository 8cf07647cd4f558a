"""``deterministic=True`` (``--deterministic``): a temperature-0 request gets the same tokens,
and the same log-probabilities to the bit, on a prefix-cache miss, on a hit, on a second hit,
inside a batch of four, and with prompt-lookup speculation; on a bf16 int4 tiny Llama (the
default's kernels: a miss of 300 tokens takes the many-row path the fast default switches to)
and, slow, on the default model. The default (None) turns it on exactly where kvreuse's int4
and attention kernels make it about free, and the mode is part of the model identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.models.kernels import native_kernels
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
    """Tokens and top-5 log-probabilities to the bit, with 48-token prefill chunks and with
    prompt-lookup speculation, as in one chunk without speculation."""
    prompts = _prompts(tiny_int4.tokenizer, 300)
    whole = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True)
    ref = _answers(whole, prompts, 24)
    # prefill in chunks of 48 tokens (7 steps for a 300-token prompt), 4 prompts sharing steps
    chunked = LLM(
        loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True, max_num_batched_tokens=48
    )
    assert _answers(chunked, prompts, 24) == ref
    spec = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=True, speculative_tokens=4)
    assert _answers(spec, prompts, 24) == ref
    for llm in (whole, chunked, spec):
        llm.engine.pool.check_integrity()


def test_deterministic_refuses_a_model_without_the_llama_forward():
    gemma = tiny_model("gemma3", seed=0)
    with pytest.raises(ValueError, match="--deterministic needs a plain Llama model"):
        LLM(loaded=gemma, kv_cache_memory_gib=0.01, deterministic=True)


@pytest.mark.skipif(native_kernels() is None, reason="kvreuse's kernels are not built on this machine")
def test_the_default_is_on_where_kvreuses_kernels_make_it_free(tiny_int4):
    """No ``deterministic`` argument: on for a Llama whose projections are all on kvreuse's int4
    kernels (bf16, CPU), off for fp32 and for another family (no refusal); the mode is folded
    into model_id, so a deterministic engine's blocks never meet another arithmetic's."""
    auto = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16)
    assert auto.engine.runner.deterministic
    off = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.05, block_size=16, deterministic=False)
    assert not off.engine.runner.deterministic
    assert auto.engine.model_id != off.engine.model_id
    assert off.engine.model_id == tiny_int4.model_id  # the fast forward keeps the ids it always had
    fp32 = LLM(loaded=tiny_model("llama", seed=0, quantization="int4"), kv_cache_memory_gib=0.05)
    assert not fp32.engine.runner.deterministic
    gemma = LLM(loaded=tiny_model("gemma3", seed=0, dtype="bfloat16", quantization="int4"), kv_cache_memory_gib=0.01)
    assert not gemma.engine.runner.deterministic
    _miss_hit_batch(auto, _prompts(tiny_int4.tokenizer, 300), max_tokens=8)
    auto.engine.pool.check_integrity()


@pytest.mark.slow
def test_default_model_same_answer_on_miss_hit_and_in_a_batch():
    llm = LLM("default", kv_cache_memory_gib=0.25)  # the defaults: int4 weights, bf16, deterministic where free
    assert llm.engine.runner.deterministic == (native_kernels() is not None)
    _miss_hit_batch(llm, _prompts(llm.tokenizer, 600), max_tokens=16)


@pytest.mark.skipif(native_kernels() is None, reason="kvreuse's kernels are not built on this machine")
def test_a_pool_in_another_float_dtype_turns_the_mode_off_or_is_refused(tiny_int4):
    """A float16 / float32 pool under the bf16 model: keys were read through the kernels on a miss
    and through the torch path on a hit, and a hit answered differently. The default turns the mode
    off for such a pool (the start-up promise is not made); asking for it names the setting."""
    for dtype in ("float16", "float32"):
        llm = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.02, block_size=16, kv_cache_dtype=dtype)
        assert not llm.engine.runner.deterministic
        assert "batch-invariant" not in llm.engine.model_id
        with pytest.raises(ValueError, match=f"--deterministic needs --kv-cache-dtype auto, int8 or fp8 .*got {dtype}"):
            LLM(loaded=tiny_int4, kv_cache_memory_gib=0.02, block_size=16, kv_cache_dtype=dtype, deterministic=True)
    for dtype in ("bfloat16", "int8"):
        llm = LLM(loaded=tiny_int4, kv_cache_memory_gib=0.02, block_size=16, kv_cache_dtype=dtype)
        assert llm.engine.runner.deterministic
        _miss_hit_batch(llm, _prompts(tiny_int4.tokenizer, 300), max_tokens=8)
        llm.engine.pool.check_integrity()
