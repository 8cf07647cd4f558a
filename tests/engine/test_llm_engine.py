"""Engine behaviour on tiny random-weight models: exactness of reuse, batching, memory
pressure, aborts. Integrity of the pool is checked after every step."""

import random

import pytest
import torch

from kvreuse import LLM, SamplingParams
from tests.engine_helpers import LogitsSpy, reference_logits

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def run_steps(llm: LLM):
    outs = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            outs[o.request_id] = o
        llm.engine.check_integrity()  # the pool's checks and every reference owned by a request
    return outs


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_prefix_hit_is_exact(arch, request):
    loaded = request.getfixturevalue(arch)
    prompt = [(i * 37) % 4000 + 10 for i in range(45)]  # crosses the tiny Gemma window (8)
    cached = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4)
    spy = LogitsSpy(cached)
    first = cached.generate(prompt, GREEDY)[0]
    second = cached.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 44  # all full blocks but the one holding the last token
    assert second.token_ids == first.token_ids
    n = len(spy.rows) // 2
    for a, b in zip(spy.rows[:n], spy.rows[n:]):
        assert (a - b).abs().max().item() <= 1e-4
    ref = reference_logits(loaded.model, prompt)
    assert (spy.rows[n] - ref[-1]).abs().max().item() <= 1e-4

    uncached = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, enable_prefix_caching=False)
    assert uncached.generate(prompt, GREEDY)[0].token_ids == first.token_ids


def test_hit_ending_mid_prompt_at_block_boundary(tiny_gemma3):
    llm = LLM(loaded=tiny_gemma3, kv_cache_memory_gib=0.01, block_size=4)
    spy = LogitsSpy(llm)
    base = list(range(300, 337))
    llm.generate(base, GREEDY)
    other = base[:20] + list(range(900, 913))  # shares 5 full blocks then diverges
    out = llm.generate(other, SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.num_cached_tokens == 20
    ref = reference_logits(tiny_gemma3.model, other)
    assert (spy.rows[-1] - ref[-1]).abs().max().item() <= 1e-4


def test_chunked_prefill_matches_single_pass(tiny_llama):
    prompt = list(range(500, 563))
    whole = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    chunked = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, max_num_batched_tokens=10)
    assert whole.generate(prompt, GREEDY)[0].token_ids == chunked.generate(prompt, GREEDY)[0].token_ids


def test_concurrent_batch_equals_one_by_one(tiny_llama):
    prompts = [list(range(100 + 7 * i, 120 + 9 * i)) for i in range(12)]
    one = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    alone = [one.generate(p, GREEDY)[0].token_ids for p in prompts]
    batch = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    together = [o.token_ids for o in batch.generate(prompts, GREEDY)]
    assert together == alone


def test_memory_pressure_queues_and_preempts_without_crash(tiny_llama):
    # 40 blocks of 4 tokens: 8 requests of ~30 tokens + 16 generated cannot all run at once
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=40 * bytes_per_block / 2**30, block_size=4)
    assert llm.engine.pool.num_blocks == 40
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [list(range(1000 + 50 * i, 1030 + 50 * i)) for i in range(8)]
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    outs = run_steps(llm)
    assert all(len(outs[f"r{i}"].token_ids) == 16 for i in range(8))
    roomy = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    assert [outs[f"r{i}"].token_ids for i in range(8)] == [o.token_ids for o in roomy.generate(prompts, params)]
    assert llm.engine.pool.num_used_blocks == 0


def test_abort_frees_blocks(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    llm.engine.add_request("a", list(range(10, 60)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    assert llm.engine.pool.num_used_blocks > 0
    llm.engine.abort_request("a")
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_requests_that_can_never_run_are_value_errors(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.0001, block_size=4)
    with pytest.raises(ValueError, match="max_model_len|context"):
        llm.generate(list(range(5000)), GREEDY)
    with pytest.raises(ValueError, match="kv-cache-memory"):
        llm.generate(list(range(100, 1100)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)


def test_sampling_seed_stop_strings_and_max_tokens(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate("hello world", p)[0]
    b = llm.generate(["x y z", "hello world"], p)[1]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12 and a.finish_reason == "length"
    stop = a.text[3:6]
    c = llm.generate("hello world", SamplingParams(**{**p.__dict__, "stop": (stop,)}))[0]
    assert c.finish_reason == "stop" and stop not in c.text and a.text.startswith(c.text)


def test_cache_salt_isolates(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    prompt = list(range(700, 740))
    llm.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 36


def test_retention_config_sets_block_priorities_and_reuse_overwrites(tiny_llama):
    from kvreuse.cache.retention import KvCacheRetentionConfig

    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    pool = llm.engine.pool
    prompt = list(range(800, 818))  # 4 full blocks + 2 tokens; the 5th block holds generated tokens too
    cfg = KvCacheRetentionConfig.from_dict(
        {
            "token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 80}],
            "decode_retention_priority": 10,
        }
    )
    out = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), retention=cfg)[0]
    pool.check_integrity()
    tokens = prompt + out.token_ids[:-1]  # the last sampled token was never computed
    from kvreuse.cache.hashing import hash_token_blocks

    keys = hash_token_blocks(tokens, 4, model_id=llm.engine.model_id)
    assert [pool.get_cached(k).priority for k in keys] == [80, 80, 35, 35, 35]  # block 4 starts in the prompt
    # a reuse with another priority overwrites the reused blocks' priority
    cfg2 = KvCacheRetentionConfig.from_dict(
        {"token_range_retention_configs": [{"token_start": 0, "token_end": None, "priority": 60}]}
    )
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), retention=cfg2)
    pool.check_integrity()
    assert [pool.get_cached(k).priority for k in keys[:4]] == [60, 60, 60, 60]


def test_event_buffer_from_config(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, event_buffer_max_size=100)
    llm.generate(list(range(900, 910)), GREEDY)
    events = llm.get_kv_cache_events(timeout=0)
    assert [e["event_id"] for e in events] == list(range(len(events)))
    kinds = [e["data"]["type"] for e in events]
    assert kinds[0] == "created" and "stored" in kinds


def _pool_llm(loaded, blocks: int) -> LLM:
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4  # tiny llama fp32, block size 4
    llm = LLM(loaded=loaded, kv_cache_memory_gib=blocks * bytes_per_block / 2**30, block_size=4)
    assert llm.engine.pool.num_blocks == blocks
    return llm


def test_block_aligned_prompt_again_shares_its_last_block(tiny_llama):
    """The last block of a block-aligned prompt is never a hit (one token must be computed);
    computed again, it is a duplicate of the cached one: the sequence takes the cached
    block and frees its copy, so every held block stays referenced and the chain whole."""
    llm = _pool_llm(tiny_llama, 4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two blocks
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    cached_ids = sorted(b.block_id for b in llm.engine.pool.blocks if b.block_hash is not None)
    assert len(cached_ids) == 2
    llm.engine.add_request("again", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    llm.engine.step()  # prefill of the last token: registers the duplicate of block 2
    llm.engine.pool.check_integrity()
    seq = llm.engine._requests["again"]
    assert sorted(b.block_id for b in seq.blocks[:2]) == cached_ids
    assert all(b.ref_count == 1 for b in seq.blocks)
    outs = run_steps(llm)  # 8 tokens: the pool of 4 blocks is full at the end
    assert outs["again"].token_ids[0] == first.token_ids[0] and len(outs["again"].token_ids) == 8
    assert llm.engine.pool.num_used_blocks == 0


def test_duplicate_block_computed_in_one_step_is_shared(tiny_llama):
    """Two prompts sharing a first block prefilled in the same step: the second's copy is
    dropped for the first's, and a later request sharing both chains still hits."""
    llm = _pool_llm(tiny_llama, 7)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.engine.add_request("x", [1, 2, 3, 4, 9], params)
    llm.engine.add_request("y", [1, 2, 3, 4, 5, 6, 7, 8, 9], params)
    run_steps(llm)
    pool = llm.engine.pool
    assert sum(b.block_hash is not None for b in pool.blocks) == 2  # one copy of the shared block
    llm.generate([list(range(50, 74))], params)  # 6 of 7 blocks: evicts one leaf, the second block
    pool.check_integrity()
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], params)[0]
    pool.check_integrity()
    assert out.num_cached_tokens == 4


@pytest.mark.parametrize(
    "stop, include",
    [(("op he",), False), (("op he",), True), (("o",), False), (("zzz", "ld, st"), False), (("never",), False)],
)
def test_streamed_pieces_add_up_to_the_text_with_stop_strings(tiny_llama, stop, include):
    """A stop string spanning tokens: nothing streamed is taken back or sent twice."""
    from kvreuse.engine.sequence import Sequence
    from kvreuse.engine.stop_checker import check_stop

    tokenizer = tiny_llama.tokenizer
    ids = tokenizer.encode("hello world, stop here please", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=stop, include_stop_str_in_output=include)
    seq = Sequence("r", [1], params)
    pieces, reason = [], None
    for token in ids:
        seq.output_token_ids.append(token)
        piece, reason = check_stop(seq, tokenizer, frozenset())
        pieces.append(piece)
        if reason:
            break
    full = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [full.find(s) for s in stop if s in full]
    if hits:
        i = min(hits)
        s = next(s for s in stop if full.find(s) == i)
        expected = full[: i + len(s)] if include else full[:i]
    else:
        expected = full
    assert "".join(pieces) == seq.text == expected
    assert reason == ("stop" if hits else "length")


def test_request_filling_the_pool_exactly_runs(tiny_llama):
    """Prompt 12 + 5 generated tokens in 4 blocks of 4: the last sampled token is never
    fed back, so 16 slots hold it all; one token more can never fit."""
    llm = _pool_llm(tiny_llama, 4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out = llm.generate([list(range(1, 13))], params)[0]
    assert len(out.output_token_ids) == 5 and llm.engine.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        llm.generate([list(range(1, 13))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))


def test_preempted_prefill_does_not_count_its_own_blocks_as_hits(tiny_llama):
    llm = LLM(
        loaded=tiny_llama,
        kv_cache_memory_gib=8 * 2 * 2 * 2 * 16 * 4 * 4 / 2**30,
        block_size=4,
        max_num_batched_tokens=5,
    )
    prompts = [[5, 6, 7, 8, 9], list(range(100, 124))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.num_preemptions >= 1  # the setting is what the test is about
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # a cold cache: nothing was reused
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (29, 0)


def test_retention_as_a_mapping_or_a_bad_type(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    retention = {"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 80}]}
    llm.generate([list(range(1, 13))], SamplingParams(max_tokens=1, temperature=0), retention=retention)
    assert llm.engine.pool.blocks_by_priority() == {80: 2, 35: 1}
    with pytest.raises(ValueError, match="kv_cache_retention_config"):
        llm.generate([list(range(1, 13))], SamplingParams(max_tokens=1), retention=80)
    with pytest.raises(ValueError, match="kv_cache_retention_config.decode_retention_priority"):
        llm.generate([list(range(1, 13))], SamplingParams(max_tokens=1), retention={"decode_retention_priority": 101})
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_explicit_positions_without_context_respect_the_sliding_window(tiny_gemma3):
    """A PML prompt that selects no module: its tokens sit at positions from the schema's
    length on, with no context. Sliding-window layers (window 8) mask by those positions,
    in one pass or chunked (transformers' own mask follows indices, which agree with
    contiguous positions); gapped positions give the same logits in one pass and chunked."""
    from kvreuse.models.tiny import tiny_model

    ref = tiny_model("gemma3", seed=0, attn_implementation="eager").model
    prompt = list(range(300, 320))
    contiguous, gapped = list(range(100, 120)), [0, 1, 2, 3, 20, 21, 22, 23] + list(range(40, 52))
    last = {}
    for chunk in (8192, 6):
        llm = LLM(loaded=tiny_gemma3, kv_cache_memory_gib=0.01, block_size=4, max_num_batched_tokens=chunk)
        for positions in (contiguous, gapped):
            spy = LogitsSpy(llm)
            llm.engine.add_request(
                f"p{positions[4]}", prompt, SamplingParams(max_tokens=1, temperature=0), prompt_positions=positions
            )
            run_steps(llm)
            last[chunk, positions[4]] = spy.rows[-1]
    with torch.inference_mode():
        want = (
            ref(input_ids=torch.tensor([prompt]), position_ids=torch.tensor([contiguous]), use_cache=False)
            .logits[0, -1]
            .float()
        )
    for chunk in (8192, 6):
        assert (last[chunk, 104] - want).abs().max().item() <= 1e-4
    assert (last[8192, 20] - last[6, 20]).abs().max().item() <= 1e-5


def test_tiny_temperature_is_greedy_and_harms_no_other_request(tiny_llama):
    """1 / 1e-38 overflows to inf (NaN probabilities): such a request samples greedily,
    as vLLM does, instead of failing the whole step."""
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    prompts = [list(range(10, 30)), list(range(40, 60))]
    tiny, sampled = (
        SamplingParams(max_tokens=6, temperature=1e-38),
        SamplingParams(max_tokens=6, temperature=0.7, seed=3),
    )
    outs = llm.generate(prompts, [tiny, sampled])
    assert outs[0].token_ids == llm.generate([prompts[0]], GREEDY)[0].token_ids[:6]
    assert len(outs[1].token_ids) == 6


def test_engine_integrity_catches_a_reference_no_request_owns(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    llm.generate([list(range(1, 13))], SamplingParams(max_tokens=1, temperature=0))
    llm.engine.check_integrity()
    cached = next(b for b in llm.engine.pool.blocks if b.block_hash is not None)
    llm.engine.pool.acquire([cached])  # held, but by nobody the engine knows
    with pytest.raises(RuntimeError, match=f"block {cached.block_id} has ref_count 1 but live requests hold 0"):
        llm.engine.check_integrity()
    llm.engine.pool.check_integrity()  # the pool alone cannot see it


# Mixed plain + PML requests on a small pool (preemption, chunked
# prefill, contexts released and re-acquired), integrity after every step, and every sampled
# logits row of every request equal (<= 1e-4, fp32) to the request run alone on a roomy pool.
# Token equality alone is weak on tiny random models (greedy output often repeats one token).
def _words(n, tag):
    return " ".join(f"w{tag}x{i}" for i in range(n))


SCHEMAS = [
    f'<schema name="a"><module name="m">{_words(8, "a")}</module><module name="n">{_words(5, "n")}</module></schema>',
    f'<schema name="b">Root words here. <module name="m">{_words(7, "b")}</module></schema>',
]
PML = [
    '<prompt schema="a"><m/><n/> tail q</prompt>',
    '<prompt schema="a"><n/><m/></prompt>',
    '<prompt schema="b"><m/>hello there</prompt>',
    '<prompt schema="a"><m/></prompt>',
]


class RowsByRequest:
    """Logits rows per request id (the engine's forward gets the plan and its chunks in order)."""

    def __init__(self, llm):
        self.rows = {}
        eng = llm.engine
        forward = eng._forward

        def spy_forward(plan, chunks):
            logits = forward(plan, chunks)
            ids = [item.seq.request_id for item, c in zip(plan, chunks) if c.sample]
            assert len(ids) == logits.shape[0]
            for rid, row in zip(ids, logits):
                self.rows.setdefault(rid, []).append(row.clone())
            return logits

        eng._forward = spy_forward


def _make(loaded, num_blocks, **kw):
    s = loaded.shape
    bpb = s.num_layers * 2 * s.num_kv_heads * s.head_dim * 4 * 4
    llm = LLM(loaded=loaded, kv_cache_memory_gib=num_blocks * bpb / 2**30, block_size=4, **kw)
    for schema in SCHEMAS:
        llm.register_schema(schema)
    return llm


@pytest.mark.parametrize("arch,seed", [("tiny_llama", 1), ("tiny_gemma3", 3)])
def test_pressured_mixed_workload_logits_equal_alone(arch, seed, request):
    loaded = request.getfixturevalue(arch)
    rng = random.Random(seed)
    small = _make(loaded, 22, max_num_seqs=3, max_num_batched_tokens=12)
    spy = RowsByRequest(small)
    eng = small.engine
    base = list(range(100, 140))
    reqs = []
    for i in range(8):
        p = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True)
        if rng.random() < 0.5:
            n = rng.choice([4, 8, 12, 13, 16, 20, 7])
            ids = base[:n] if rng.random() < 0.7 else [rng.randint(50, 300) for _ in range(n)]
            reqs.append((f"r{i}", ids, p))
        else:
            reqs.append((f"r{i}", rng.choice(PML), p))
    outs, pending, steps = {}, list(reqs), 0
    while pending or eng.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            rid, prompt, p = pending.pop(0)
            if isinstance(prompt, str):
                eng.add_prepared_request(rid, eng.prepare_prompt(prompt), p)
            else:
                eng.add_request(rid, prompt, p)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.check_integrity()
        steps += 1
        assert steps < 3000
    assert eng.scheduler.num_preemptions > 0  # the pool really was under pressure
    for rid, prompt, p in reqs:
        roomy = _make(loaded, 2000)
        ref = RowsByRequest(roomy)
        alone = roomy.generate(prompt, p)[0]
        assert alone.token_ids == outs[rid].token_ids
        a, b = torch.stack(ref.rows[alone.request_id]), torch.stack(spy.rows[rid])
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-4
    assert eng.pool.num_used_blocks == 0


def test_prefill_cap_keeps_outputs_under_preemption_and_speculation(tiny_llama):
    # The decode-first cap (3 prefill tokens per step while anyone decodes) in a 24-block pool
    # with prompt-lookup drafts: every request's greedy tokens are those of an uncapped roomy
    # engine, the pool stays consistent after every step, and no decoding step carries more
    # than 3 prompt tokens.
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [list(range(1000 + 50 * i, 1030 + 50 * i)) if i % 2 else [7, 8, 9, 10, 11] * 6 for i in range(6)]

    def staggered(llm: LLM) -> list[list[int]]:
        outs = {}
        for i, prompt in enumerate(prompts):  # each arrives while the earlier ones decode
            llm.engine.add_request(f"r{i}", prompt, params)
            for _ in range(2):
                outs |= {o.request_id: o for o in llm.engine.step()}
                llm.engine.check_integrity()
        outs |= run_steps(llm)
        return [outs[f"r{i}"].token_ids for i in range(len(prompts))]

    roomy = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, max_prefill_tokens_while_decoding=0)
    capped = LLM(
        loaded=tiny_llama,
        kv_cache_memory_gib=24 * bytes_per_block / 2**30,
        block_size=4,
        max_prefill_tokens_while_decoding=3,
        speculative_tokens=3,
    )
    prompt_tokens: list[int] = []  # per step that decodes: the prompt tokens beside its decodes
    execute = capped.engine.runner.execute

    def spy(chunks):
        if any(len(c.token_ids) == c.num_logits for c in chunks):  # a decode or a draft verification
            prompt_tokens.append(sum(len(c.token_ids) for c in chunks if len(c.token_ids) > c.num_logits))
        return execute(chunks)

    capped.engine.runner.execute = spy
    assert staggered(capped) == staggered(roomy)
    stats = capped.engine.stats()
    assert stats.num_preemptions == 1 and stats.spec_decode_num_draft_tokens == 25
    assert max(prompt_tokens) == 3
    assert capped.engine.pool.num_used_blocks == 0
