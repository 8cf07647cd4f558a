"""Prompt-lookup speculative decoding: the drafter alone, then the engine with and without
it on tiny random models (greedy output identical, blocks never leaked, integrity after
every step)."""

import random

import numpy as np
import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.engine.spec_decode import SpecState, accepted_length, propose


def test_propose_takes_the_most_recent_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], np.int64)
    # "2 3" last occurred at index 5..6, followed by 7 8 5
    assert propose(tokens, min_n=1, max_n=3, k=3) == [7, 8, 5]
    # n=3 "5 2 3" never recurs; n=2 wins over n=1
    assert propose(tokens, min_n=2, max_n=3, k=2) == [7, 8]
    assert propose(np.array([4, 5, 6], np.int64), min_n=1, max_n=3, k=4) == []
    assert propose(tokens, min_n=1, max_n=3, k=0) == []
    # the match may run up to the suffix: only the tokens that exist are proposed
    assert propose(np.array([1, 1, 1], np.int64), min_n=1, max_n=2, k=5) == [1]


def test_accepted_length_and_backoff():
    assert accepted_length([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_length([4, 5], [4, 5, 6]) == 2
    assert accepted_length([4], [3, 1]) == 0
    state = SpecState()
    state.record(4, 0)
    assert (state.backoff, state.pause) == (1, 1)
    assert not state.ready() and state.ready()
    state.record(4, 0)
    state.record(4, 0)
    assert state.pause == 4
    state.record(3, 2)
    assert (state.backoff, state.num_draft_tokens, state.num_accepted_tokens) == (0, 15, 2)


def run(llm, prompts, params):
    """Every prompt queued at once (continuous batching), integrity checked after each step."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    outs, pieces = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
            pieces.setdefault(o.request_id, []).append(o.new_text)
        engine.check_integrity()
    assert engine.pool.num_used_blocks == 0  # nothing leaked
    for rid, o in outs.items():
        assert "".join(pieces[rid]) == o.text  # streamed pieces add up
    return [outs[f"r{i}"] for i in range(len(prompts))]


def repeating_prompt(rng: random.Random, length: int) -> list[int]:
    phrase = [rng.randrange(10, 2000) for _ in range(rng.randrange(3, 12))]
    out = []
    while len(out) < length:
        out += phrase if rng.random() < 0.6 else [rng.randrange(10, 2000)]
    return out[:length]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_greedy_output_is_identical_batched(arch, request):
    loaded = request.getfixturevalue(arch)
    rng = random.Random(3)
    prompts = [repeating_prompt(rng, rng.randrange(8, 60)) for _ in range(8)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0, logprobs=2 if i % 3 == 0 else None)
              for i in range(8)]
    params[5] = SamplingParams(max_tokens=30, temperature=0.8, seed=7)  # sampled: never speculates
    params[6] = SamplingParams(max_tokens=30, temperature=0, speculative=False)  # opted out
    base = run(LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4), prompts, params)
    spec_llm = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, speculative_tokens=4,
                   speculative_ngram_min=1, speculative_ngram_max=3)
    spec = run(spec_llm, prompts, params)
    for a, b in zip(base, spec):
        assert b.output_token_ids == a.output_token_ids
        assert b.text == a.text and b.finish_reason == a.finish_reason
        if a.logprobs is not None:
            assert [lp.token_id for lp in b.logprobs] == [lp.token_id for lp in a.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                assert abs(x.logprob - y.logprob) <= 1e-4
    stats = spec_llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0  # both kinds happened
    assert spec[5].num_draft_tokens == 0 and spec[6].num_draft_tokens == 0
    assert sum(o.num_accepted_tokens for o in spec) == stats.spec_decode_num_accepted_tokens
    # a second run of the same prompts hits the blocks the first registered: their hashes are right
    again = run(spec_llm, prompts, params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in base]


def test_stop_string_and_max_tokens_cut_accepted_tokens(tiny_llama):
    rng = random.Random(5)
    prompt = repeating_prompt(rng, 40)
    base_llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    long = base_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = long.text[len(long.text) // 2 : len(long.text) // 2 + 3]
    cases = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 7, 23)]
    if stop.strip():
        cases.append(SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))
    spec_llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, speculative_tokens=6,
                   speculative_ngram_min=1)
    base = run(base_llm, [prompt] * len(cases), cases)
    spec = run(spec_llm, [prompt] * len(cases), cases)
    for a, b, sp in zip(base, spec, cases):
        assert b.output_token_ids == a.output_token_ids and b.text == a.text
        assert len(b.output_token_ids) <= sp.max_tokens
    assert spec_llm.engine.spec_accepted_tokens > 0


def test_many_random_prompts_small_pool(tiny_llama):
    """Random prompts under memory pressure (preemption): same greedy output, no leak."""
    rng = random.Random(11)
    preempted = 0
    for trial in range(6):
        prompts = [repeating_prompt(rng, rng.randrange(4, 25)) for _ in range(rng.randrange(2, 6))]
        params = [SamplingParams(max_tokens=rng.randrange(1, 15), temperature=0, ignore_eos=True) for _ in prompts]
        kw = dict(loaded=tiny_llama, kv_cache_memory_gib=0.00002, block_size=4, max_num_batched_tokens=32)
        base = run(LLM(**kw), prompts, params)
        llm = LLM(**kw, speculative_tokens=rng.randrange(1, 8), speculative_ngram_min=1)
        spec = run(llm, prompts, params)
        assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in base], trial
        preempted += llm.engine.scheduler.num_preemptions
    assert preempted > 0  # the pool was small enough to preempt
