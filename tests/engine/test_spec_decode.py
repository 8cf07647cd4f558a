"""Prompt-lookup speculative decoding: the drafter alone, then the engine with and without
it on tiny random models (greedy output identical, blocks never leaked, integrity after
every step)."""

import random

import numpy as np
import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.engine import spec_decode
from kvreuse.engine.spec_decode import SpecState, accepted_length, propose


def test_propose_takes_the_most_recent_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], np.int64)
    # "2 3" last occurred at index 5..6, followed by 7 8 5
    assert propose(tokens, min_n=1, max_n=3, k=3) == [7, 8, 5]
    # n=3 "5 2 3" never recurs; n=2 wins over n=1
    assert propose(tokens, min_n=2, max_n=3, k=2) == [7, 8]
    assert propose(np.array([4, 5, 6], np.int64), min_n=1, max_n=3, k=4) == []
    assert propose(tokens, min_n=1, max_n=3, k=0) == []
    # a match that runs into the suffix continues with its period (a loop drafts k tokens)
    assert propose(np.array([1, 1, 1], np.int64), min_n=1, max_n=2, k=5) == [1] * 5
    assert propose(np.array([5, 1, 2, 3, 1, 2, 3, 1, 2], np.int64), min_n=1, max_n=2, k=5) == [3, 1, 2, 3, 1]
    assert propose(np.array([7, 1, 2, 9, 1, 2], np.int64), min_n=2, max_n=2, k=5) == [9, 1, 2, 9, 1]


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
    state.record(8, 1)  # one accepted token does not pay for a verification: pause as if rejected
    assert (state.backoff, state.pause) == (1, 1)
    state.pause = 0
    state.record(1, 1)  # a one-token draft (max_tokens near) accepted whole pays
    assert state.backoff == 0
    for _ in range(8):
        state.record(5, 0)
    assert state.backoff == state.pause == 32  # the longest pause


def run(llm, prompts, params):
    """Every prompt queued at once (continuous batching), integrity checked after each step."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if isinstance(p, str):  # a PML prompt over a registered schema
            engine.add_prepared_request(f"r{i}", engine.prepare_prompt(p), sp)
        else:
            engine.add_request(f"r{i}", p, sp)
    outs, pieces, ids, lps = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
            pieces.setdefault(o.request_id, []).append(o.new_text)
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.new_logprobs or [])
        engine.check_integrity()
        for seq in engine.scheduler.running:  # blocks of rejected drafts went back at once
            assert len(seq.blocks) <= engine.kv.blocks_needed(seq.num_tokens)
            assert not seq.draft_token_ids
    assert engine.pool.num_used_blocks == 0  # nothing leaked
    for rid, o in outs.items():
        assert "".join(pieces[rid]) == o.text  # streamed pieces add up
        assert ids[rid] == o.output_token_ids
        if o.logprobs is not None:  # one per emitted token, streamed and final alike
            assert len(o.logprobs) == len(o.output_token_ids) == len(lps[rid])
            assert [lp.token_id for lp in o.logprobs] == o.output_token_ids
    return [outs[f"r{i}"] for i in range(len(prompts))]


class SettleSpy:
    """Records every verified draft as ``(drafted, accepted, kept)`` (a spy on the real engine)."""

    def __init__(self, llm):
        self.calls: list[tuple[int, int, int]] = []
        engine = llm.engine
        original = engine.outputs._settle_draft

        def settle(seq, drafted, accepted, kept):
            self.calls.append((drafted, accepted, kept))
            original(seq, drafted, accepted, kept)

        engine.outputs._settle_draft = settle

    @property
    def cut_inside_a_run(self) -> bool:
        """Some verified step ended its request before all its accepted tokens were emitted."""
        return any(kept < accepted + 1 for _, accepted, kept in self.calls)


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
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0, logprobs=2 if i % 3 == 0 else None)
        for i in range(8)
    ]
    params[5] = SamplingParams(max_tokens=30, temperature=0.8, seed=7)  # sampled: never speculates
    params[6] = SamplingParams(max_tokens=30, temperature=0, speculative=False)  # opted out
    base = run(LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4), prompts, params)
    spec_llm = LLM(
        loaded=loaded,
        kv_cache_memory_gib=0.01,
        block_size=4,
        speculative_tokens=4,
        speculative_ngram_min=1,
        speculative_ngram_max=3,
    )
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


def quoting_setup(loaded):
    """A prompt with phrases that recur (the n-gram drafter finds matches), and the tiny
    model's 40-token greedy answer to it."""
    rng = random.Random(5)
    prompt = repeating_prompt(rng, 40)
    out = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4).generate(
        prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    )[0]
    return prompt, out.output_token_ids


def oracle_drafts(monkeypatch, prompt: list[int], answer: list[int], wrong_every: int = 0) -> None:
    """Replace the n-gram drafter with one that drafts the greedy ``answer`` itself (so a stop
    lands inside an accepted run with accepted tokens after it, which a random model's own
    text rarely gives), every ``wrong_every``-th answer token off by one (rejected there)."""

    def propose(tokens, *, min_n, max_n, k):
        assert tokens[: len(prompt)].tolist() == prompt
        m = len(tokens) - len(prompt)
        return [
            t + 1 if wrong_every and (m + j) % wrong_every == wrong_every - 1 else t
            for j, t in enumerate(answer[m : m + k])
        ]

    monkeypatch.setattr(spec_decode, "propose", propose)


@pytest.mark.parametrize("drafter", ["ngram", "oracle", "oracle_wrong_every_5"])
def test_stop_string_and_max_tokens_cut_accepted_tokens(tiny_llama, monkeypatch, drafter):
    prompt, long = quoting_setup(tiny_llama)
    base_llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    text = base_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    cases = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 7, 23)]
    for at in range(4, len(text) - 3, max(1, len(text) // 12)):  # stop strings all along the answer
        if text[at : at + 3].strip():
            cases.append(
                SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[text[at : at + 3]], logprobs=0)
            )
    assert len(cases) > 8
    if drafter != "ngram":
        oracle_drafts(monkeypatch, prompt, long, wrong_every=5 if drafter.endswith("5") else 0)
    spec_llm = LLM(
        loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, speculative_tokens=6, speculative_ngram_min=1
    )
    spy = SettleSpy(spec_llm)
    base = run(base_llm, [prompt] * len(cases), cases)
    spec = run(spec_llm, [prompt] * len(cases), cases)
    for a, b, sp in zip(base, spec, cases):
        assert b.output_token_ids == a.output_token_ids and b.text == a.text
        assert b.finish_reason == a.finish_reason
        assert len(b.output_token_ids) <= sp.max_tokens
    stats = spec_llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if drafter != "ngram":
        assert spy.cut_inside_a_run  # a stop string ended a request inside an accepted run
    if drafter == "oracle":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if drafter.endswith("5"):  # every draft that reaches a wrong token is rejected there
        assert all(accepted < drafted for drafted, accepted, _ in spy.calls if drafted >= 5)


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_eos_or_stop_token_inside_an_accepted_run(tiny_llama, monkeypatch, how):
    """Every token of the greedy answer tried as the end token: the request ends at its first
    occurrence with or without speculation, also when that token was drafted and accepted
    with more accepted tokens after it (those are never emitted), logprobs included."""
    prompt, long = quoting_setup(tiny_llama)
    kw = dict(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    base_llm = LLM(**kw)
    oracle_drafts(monkeypatch, prompt, long)
    spec_llm = LLM(**kw, speculative_tokens=6, speculative_ngram_min=1)
    spy = SettleSpy(spec_llm)
    cut = 0
    for end in sorted(set(long[1:])):
        if how == "eos":
            base_llm.engine.outputs.eos_token_ids = spec_llm.engine.outputs.eos_token_ids = frozenset({end})
            params = SamplingParams(max_tokens=40, temperature=0, logprobs=1)
        else:
            params = SamplingParams(max_tokens=40, temperature=0, logprobs=1, stop_token_ids=[end])
        spy.calls.clear()
        (a,) = run(base_llm, [prompt], [params])
        (b,) = run(spec_llm, [prompt], [params])
        assert b.output_token_ids == a.output_token_ids == long[: long.index(end) + 1]
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason) == (a.text, "stop")
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4
        cut += spy.cut_inside_a_run
    assert cut >= 2  # end tokens sat inside accepted runs, with accepted tokens after them


def test_identical_prompts_share_blocks(tiny_llama):
    """n > 1 greedy (one sequence per choice, the same prompt): each choice registers the same
    full blocks; the later ones take the first one's copy while they verify drafts."""
    prompt, long = quoting_setup(tiny_llama)
    params = [SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)] * 3
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, speculative_tokens=5, speculative_ngram_min=1)
    outs = run(llm, [prompt] * 3, params)
    assert [o.output_token_ids for o in outs] == [long[:33]] * 3
    assert all(o.num_accepted_tokens > 0 for o in outs)
    # the blocks they registered are found by a later request: their hashes and KV are right
    again = llm.generate(prompt + long[:32], SamplingParams(max_tokens=1, temperature=0))[0]
    assert again.output_token_ids == [long[32]] and again.num_cached_tokens == 4 * ((len(prompt) + 31) // 4)
    llm.engine.check_integrity()


def test_a_draft_never_preempts_anyone(tiny_llama):
    """Under memory pressure a draft takes only the blocks left once every running request
    has its own: whenever a request is preempted, no sequence holds a block for a draft."""
    rng = random.Random(17)
    checked = 0
    for trial in range(6):
        prompts = [repeating_prompt(rng, rng.randrange(6, 25)) for _ in range(rng.randrange(3, 6))]
        params = [SamplingParams(max_tokens=rng.randrange(8, 20), temperature=0, ignore_eos=True) for _ in prompts]
        kw = dict(loaded=tiny_llama, kv_cache_memory_gib=0.00002, block_size=4, max_num_batched_tokens=32)
        base = run(LLM(**kw), prompts, params)
        llm = LLM(**kw, speculative_tokens=6, speculative_ngram_min=1)
        scheduler, kv = llm.engine.scheduler, llm.engine.kv
        original = scheduler._preempt

        def preempt(victim):
            nonlocal checked
            for seq in scheduler.running:
                assert len(seq.blocks) <= kv.blocks_needed(seq.num_tokens), "a draft's blocks forced a preemption"
            checked += 1
            original(victim)

        scheduler._preempt = preempt
        spec = run(llm, prompts, params)
        assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in base], trial
    assert checked > 0 and llm.engine.outputs.spec_accepted_tokens > 0


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


def test_python_api(tiny_llama):
    """``LLM(speculative_tokens=...)``: generate and chat give the same greedy answers with
    speculation on and off (``SamplingParams.speculative``), the outputs count the drafts,
    and bad values are refused naming the field or flag."""
    prompt, long = quoting_setup(tiny_llama)
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, speculative_tokens=5, speculative_ngram_min=1)
    on, off = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative=False),
        ],
    )
    assert on.output_token_ids == off.output_token_ids == long
    assert on.num_draft_tokens >= on.num_accepted_tokens > 0 and off.num_draft_tokens == off.num_accepted_tokens == 0
    stats = llm.engine.stats()
    assert (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (
        on.num_draft_tokens,
        on.num_accepted_tokens,
    )
    messages = [{"role": "user", "content": "alpha bravo charlie delta alpha bravo charlie delta echo"}]
    chat_on = llm.chat(messages, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    chat_off = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4).chat(
        messages, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )[0]
    assert chat_on.text == chat_off.text and chat_on.num_accepted_tokens > 0
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")
    with pytest.raises(ValueError, match="--speculative-tokens"):
        LLM(loaded=tiny_llama, speculative_tokens=-1)
    with pytest.raises(ValueError, match="--speculative-ngram-min"):
        LLM(loaded=tiny_llama, speculative_ngram_min=3, speculative_ngram_max=2)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_pml_prompt_with_module_context(arch, request, monkeypatch):
    """A PML prompt (module KV assembled in front, explicit RoPE positions, sliding windows on
    Gemma 3): drafts verified after the module context give the answer it gets without them
    (drafts from the answer itself, every 4th token wrong: accepted and rejected runs)."""
    loaded = request.getfixturevalue(arch)
    schema = (
        '<schema name="s">Intro text.<module name="doc">The keeper logs every ship in a green ledger; '
        'every ship, every night, in a green ledger.</module><module name="r">The reader is '
        '<param name="who" len="4"/> today.</module> Closing words.</schema>'
    )
    prompt = '<prompt schema="s"><doc/><r who="Ann"/> say green ledger green ledger green</prompt>'
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    outs = []
    for spec in (0, 4):
        llm = LLM(
            loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, speculative_tokens=spec, speculative_ngram_min=1
        )
        llm.register_schema(schema)
        if spec:
            first = outs[0][0]
            oracle_drafts(monkeypatch, first.prompt_token_ids, first.output_token_ids, wrong_every=4)
        outs.append(run(llm, [prompt, prompt], [params, params]))
        llm.engine.check_integrity()
    (a, a2), (b, b2) = outs
    assert b.output_token_ids == a.output_token_ids == a2.output_token_ids == b2.output_token_ids
    assert b.text == a.text and b.num_cached_tokens == a.num_cached_tokens > 0
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) <= 1e-4
    assert b.num_draft_tokens > b.num_accepted_tokens > 0
