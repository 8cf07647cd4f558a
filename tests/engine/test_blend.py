"""Blend (engine/blend.py, engine/blended_context.py, BlendPass.recompute) on
tiny random models: everything recomputed equals full prefill of the concatenated prompt;
nothing recomputed equals no repair exactly; shared module blocks are never written. Last, the
deviation layer (BlendPass.seam_deviation) that ranks tokens for the ratio, and last_tokens."""

import numpy as np
import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine.blend import DEVIATION_LAYER, Blend
from kvreuse.pml import compile_prompt, parse_prompt
from tests.engine_helpers import LogitsSpy, step_to_end

GREEDY = SamplingParams(max_tokens=4, temperature=0)
SCHEMA = """<schema name="s">Notes:
<module name="a">The lighthouse keeper on Varn island logs ships in a green ledger.</module>
<module name="b">Every ledger on the island is kept in the harbour office at dusk.</module>
</schema>"""
PROMPT = '<prompt schema="s"><a/><b/>Where is the ledger kept?</prompt>'
ALL = Blend(first_tokens=10**6, ratio=1.0)


def make(loaded, **kw) -> LLM:
    return LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, **kw)


def plain_ids(llm: LLM, pml: str) -> list[int]:
    schemas = llm.engine.modules.schemas
    prompt = compile_prompt(parse_prompt(pml), schemas, llm.tokenizer)
    by_pos = {p: t for _, ts, ps in schemas[prompt.schema_name].assembled(prompt) for t, p in zip(ts, ps)}
    by_pos.update(zip(prompt.new_position_ids, prompt.new_token_ids))
    assert sorted(by_pos) == list(range(len(by_pos)))  # contiguous: the plain prompt has the same positions
    return [by_pos[p] for p in sorted(by_pos)]


def module_kv(llm: LLM) -> torch.Tensor:
    """Every cached module block's KV: ``[layers, 2, kv_heads, slots, d]``."""
    bs = llm.engine.block_size
    ids = sorted(b.block_id for b in llm.engine.pool.cached_hashes())
    slots = torch.tensor([i * bs + o for i in ids for o in range(bs)])
    return llm.engine.runner.kv_cache[:, :, :, slots].clone()


def test_policy_first_tokens_and_ratio():
    starts = np.array([0, 5, 7])
    assert Blend(2, 0.0).select(starts, 10, None).tolist() == [0, 1, 5, 6, 7, 8]
    assert Blend(0, 0.0).select(starts, 10, None).tolist() == []
    dev = np.array([0, 9, 1, 8, 0, 0, 7, 0, 0, 6], dtype=float)
    assert Blend(0, 0.3).select(starts, 10, dev).tolist() == [1, 3, 6]
    assert Blend(1, 0.2).select(starts, 10, dev).tolist() == [0, 1, 3, 5, 7]
    assert Blend(0, 1.0).select(starts, 10, dev).tolist() == list(range(10))


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"ratio": 1.5}, "blend.ratio"),
        ({"first_tokens": -1}, "blend.first_tokens"),
        ({"ratio": "x"}, "blend.ratio"),
        ({"k": 1}, "blend"),
        ([1], "blend"),
    ],
)
def test_policy_bad_values_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        Blend.from_json(bad, Blend())


def test_policy_defaults_fill_missing_fields():
    assert Blend.from_json({"ratio": 0.2}, Blend(4, 0.1)) == Blend(4, 0.2)
    assert Blend.from_json(None, Blend(4, 0.1)) == Blend(4, 0.1)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_full_repair_equals_full_prefill(arch, request):
    """first_tokens covering everything and ratio 1.0: every assembled token is recomputed
    against the assembled context, so the logits are those of full prefill (<= 1e-4)."""
    loaded = request.getfixturevalue(arch)
    llm = make(loaded)
    llm.register_schema(SCHEMA)
    ids = plain_ids(llm, PROMPT)
    before = module_kv(llm)
    spy = LogitsSpy(llm)
    out = llm.generate(PROMPT, GREEDY, blend=ALL)[0]
    context = out.num_prompt_tokens - len(llm.engine.prepare_prompt(PROMPT).token_ids)
    assert out.num_recomputed_tokens == context
    assert torch.equal(module_kv(llm), before)  # the shared module blocks are unchanged
    llm.engine.check_integrity()
    llm.engine.pool.check_integrity()
    assert llm.engine.stats().seam_repair_tokens == context

    ref = make(loaded)
    ref_spy = LogitsSpy(ref)
    full = ref.generate(ids, GREEDY)[0]
    assert full.token_ids == out.token_ids
    for a, b in zip(spy.rows, ref_spy.rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4

    none = make(loaded)
    none.register_schema(SCHEMA)
    assert (spy.rows[0] - _first_logits(none)).abs().max().item() > 1e-3  # the seams matter: repair changed them


def _first_logits(llm: LLM) -> torch.Tensor:
    spy = LogitsSpy(llm)
    llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))
    return spy.rows[0]


def test_zero_repair_equals_no_repair_exactly(tiny_llama):
    a, b = make(tiny_llama), make(tiny_llama)
    for llm in (a, b):
        llm.register_schema(SCHEMA)
    sa, sb = LogitsSpy(a), LogitsSpy(b)
    oa = a.generate(PROMPT, GREEDY, blend={"first_tokens": 0, "ratio": 0})[0]
    ob = b.generate(PROMPT, GREEDY)[0]
    assert oa.token_ids == ob.token_ids and oa.num_recomputed_tokens == 0
    for x, y in zip(sa.rows, sb.rows, strict=True):
        assert torch.equal(x, y)


def test_partial_repair_keeps_modules_and_pool(tiny_llama):
    """A ratio and first-k repair: the chosen count is first-k of each module plus the
    ratio's share; module blocks are unchanged; private copies are freed at the end."""
    llm = make(tiny_llama)
    llm.register_schema(SCHEMA)
    before = module_kv(llm)
    out = llm.generate(PROMPT, GREEDY, blend={"first_tokens": 2, "ratio": 0.25})[0]
    tokens, starts = llm.engine.modules.source(llm.engine.prepare_prompt(PROMPT).plan).assembled_tokens()
    n = len(tokens)
    assert round(0.25 * n) <= out.num_recomputed_tokens <= round(0.25 * n) + 2 * len(starts)
    assert torch.equal(module_kv(llm), before)
    assert llm.engine.pool.num_used_blocks == 0  # the private copies went back to the free list
    llm.engine.check_integrity()
    llm.engine.pool.check_integrity()
    again = llm.generate(PROMPT, GREEDY, blend={"first_tokens": 2, "ratio": 0.25})[0]
    assert again.token_ids == out.token_ids  # the same repair of the same modules
    llm.engine.check_integrity()


def test_policy_huge_first_tokens_chooses_every_token():
    assert Blend(first_tokens=2**63).select(np.array([0, 3]), 5, None).tolist() == [0, 1, 2, 3, 4]


def test_a_held_repaired_context_keeps_the_pool_free_count_true(tiny_llama):
    # Repair copies a module's first block; letting go of the shared one while the rest of
    # its chain is held counted it free although the pool could not evict it.
    llm = make(tiny_llama)
    llm.register_schema(SCHEMA)
    engine, pool = llm.engine, llm.engine.pool
    engine.add_prepared_request("r", engine.prepare_prompt(PROMPT), GREEDY, blend={"first_tokens": 1})
    engine.check_integrity()
    (seq,) = engine.requests()
    assert seq.context.num_recomputed_tokens == 3  # one per segment: the schema scaffold and two modules
    n = pool.num_free_blocks
    taken = pool.allocate(n)  # every block the pool says is free can be had
    assert len(taken) == n and pool.num_free_blocks == 0
    pool.release(taken)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("blend", [{"first_tokens": 1}, {"first_tokens": 2, "ratio": 0.25}])
def test_repaired_requests_under_preemption_match_a_single_run(tiny_llama, blend):
    params = SamplingParams(max_tokens=30, temperature=0)
    alone = make(tiny_llama)
    alone.register_schema(SCHEMA)
    want = alone.generate([PROMPT], params, blend=blend)[0].token_ids
    per_block = 4 * alone.engine.runner.layout.bytes_per_token(torch.float32)
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=40 * per_block / 2**30, block_size=4)  # 40 blocks: preemption
    llm.register_schema(SCHEMA)
    outs = llm.generate([PROMPT] * 4, params, blend=blend)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [want] * 4
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


def test_a_repair_of_modules_over_half_the_pool_waits_and_runs(tiny_llama):
    """While the pool is busy the repaired context is not held, and the capacity check uses its
    bound: modules + at most one private copy per token the repair can choose. Modules over half
    the pool with first_tokens 1 wait and run (the old bound, twice the module blocks, refused
    them as never fitting)."""
    per_block = 4 * make(tiny_llama).engine.runner.layout.bytes_per_token(torch.float32)
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=40 * per_block / 2**30, block_size=4)  # 40 blocks
    engine = llm.engine
    words = " ".join(f"w{i}" for i in range(20))
    llm.register_schema(
        f'<schema name="big"><module name="a">{words}</module><module name="b">{words} again</module></schema>'
    )
    prompt = '<prompt schema="big"><a/><b/>Why?</prompt>'
    source = engine.modules.source(engine.prepare_prompt(prompt).plan)
    assert source.num_blocks > engine.pool.num_blocks // 2
    engine.add_request("busy", list(range(10, 10 + 4 * 30)), SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the busy request holds 31 blocks: the modules cannot be held now
    engine.check_integrity()
    engine.add_prepared_request(
        "r", engine.prepare_prompt(prompt), SamplingParams(max_tokens=2, temperature=0), blend={"first_tokens": 1}
    )
    engine.check_integrity()
    outs = step_to_end(engine)
    assert outs["r"].finished and outs["r"].num_recomputed_tokens == 2  # the two modules, one token each
    assert engine.pool.num_used_blocks == 0


def test_the_deviation_pass_runs_once_while_a_request_waits(tiny_llama, monkeypatch):
    """A repaired request that cannot acquire its copies yet waits and tries again each step;
    the selection (and the deviation pass behind it) is made once."""
    llm = make(tiny_llama)
    llm.register_schema(SCHEMA)
    engine = llm.engine
    calls = []
    real = engine.blend_pass.seam_deviation
    monkeypatch.setattr(engine.blend_pass, "seam_deviation", lambda *a, **k: calls.append(1) or real(*a, **k))
    blend = {"ratio": 0.5}
    engine.add_prepared_request("r", engine.prepare_prompt(PROMPT), GREEDY, blend=blend)
    (seq,) = engine.requests()
    source = seq.context._source
    held = seq.context._held
    for _ in range(3):  # let go and acquire again, as a waiting request does under pressure
        seq.context.release()
        engine.check_integrity()
        assert seq.context.acquire()
        engine.check_integrity()
    assert len(calls) == 1 and source._chosen is not None and held is not None
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


# Blend's ``deviation_layer`` (engine/blend.py, engine/blended_context.py,
# BlendPass.seam_deviation): the layer whose K/V deviation ranks tokens for the ratio, per
# request; the default stays CacheBlend's layer 1.
TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0)


def make_registered(loaded) -> LLM:
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4)
    llm.register_schema(SCHEMA)
    return llm


def test_default_layer_is_cacheblends_and_json_fills_it():
    assert DEVIATION_LAYER == 1 and Blend().deviation_layer == 1
    assert Blend.from_json({"ratio": 0.2}, Blend(1, 0.1)) == Blend(1, 0.2, 1)
    assert Blend.from_json({"deviation_layer": 3}, Blend(1, 0.1)) == Blend(1, 0.1, 3)
    assert Blend.from_json({"first_tokens": 2}, Blend(0, 0.1, 4)) == Blend(2, 0.1, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_layer_names_the_field(bad):
    with pytest.raises(ValueError, match="blend.deviation_layer"):
        Blend.from_json({"deviation_layer": bad}, Blend())


def test_the_layer_does_not_change_what_first_tokens_choose():
    starts = np.array([0, 5, 7])
    assert Blend(2, 0.0, 3).select(starts, 10, None).tolist() == Blend(2, 0.0).select(starts, 10, None).tolist()


@pytest.mark.parametrize(
    "blend, layer",
    [
        ({"ratio": 0.5}, DEVIATION_LAYER),
        ({"ratio": 0.5, "deviation_layer": 3}, 3),
        ({"ratio": 0.3, "first_tokens": 1, "deviation_layer": 2}, 2),
    ],
)
def test_the_requested_layer_ranks_the_tokens(tiny_gemma3, monkeypatch, blend, layer):
    """The deviation pass runs at the request's layer, and the recomputed tokens are the ones
    its scores rank highest (plus first_tokens)."""
    llm = make_registered(tiny_gemma3)
    engine = llm.engine
    calls = []
    real = engine.blend_pass.seam_deviation

    def spy(token_ids, positions, slots, layer=DEVIATION_LAYER, shifts=None):
        calls.append((layer, real(token_ids, positions, slots, layer=layer, shifts=shifts)))
        return calls[-1][1]

    monkeypatch.setattr(engine.blend_pass, "seam_deviation", spy)
    out = llm.generate(PROMPT, TWO_TOKENS, blend=blend)[0]
    ((got_layer, deviation),) = calls
    assert got_layer == layer
    _, starts = engine.modules.source(engine.prepare_prompt(PROMPT).plan).assembled_tokens()
    want = Blend.from_json(blend, Blend()).select(starts, len(deviation), deviation)
    assert out.num_recomputed_tokens == len(want)
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_deviation_at_each_layer_is_zero_on_the_exact_prefix(arch, request):
    """The schema's leading text is encoded where it sits, after nothing: its K/V is exact at
    every layer. Layer 0's K/V is the token's and position's alone (zero everywhere: why it is
    refused); from layer 1 on, the modules (encoded apart) deviate, each layer differently."""
    llm = make_registered(request.getfixturevalue(arch))
    engine = llm.engine
    runner = engine.runner
    scores = {}
    real = engine.blend_pass.seam_deviation

    def grab(token_ids, positions, slots, layer=DEVIATION_LAYER, shifts=None):
        for each in range(1, runner.layout.num_layers):
            scores[each] = real(token_ids, positions, slots, layer=each, shifts=shifts)
        return scores[layer]

    engine.blend_pass.seam_deviation = grab
    llm.generate(PROMPT, TWO_TOKENS, blend={"ratio": 0.5})
    _, starts = engine.modules.source(engine.prepare_prompt(PROMPT).plan).assembled_tokens()
    head = int(starts[1])
    assert len(scores) == runner.layout.num_layers - 1 >= 1
    for each, dev in scores.items():
        assert np.all(dev[:head] <= 1e-8), each
        assert dev[head:].max() > 1e-6, each
    if len(scores) > 1:
        assert not np.allclose(scores[1], scores[len(scores)])  # the layers score differently


def test_last_tokens_choose_the_end_of_every_segment():
    starts = np.array([0, 5, 7])  # segments [0, 5), [5, 7), [7, 10)
    assert Blend(last_tokens=1).select(starts, 10, None).tolist() == [4, 6, 9]
    assert Blend(last_tokens=2).select(starts, 10, None).tolist() == [3, 4, 5, 6, 8, 9]
    assert Blend(1, last_tokens=1).select(starts, 10, None).tolist() == [0, 4, 5, 6, 7, 9]
    assert Blend(last_tokens=2**63).select(starts, 10, None).tolist() == list(range(10))
    dev = np.array([0, 9, 1, 8, 0, 0, 7, 0, 0, 6], dtype=float)
    assert Blend(0, 0.2, last_tokens=1).select(starts, 10, dev).tolist() == [1, 3, 4, 6, 9]
    assert Blend(last_tokens=1).enabled and not Blend().enabled
    assert Blend(2, 0.0, last_tokens=3).most_by_position(3, 10) == 10
    assert Blend(1, 0.0, last_tokens=1).most_by_position(3, 10) == 6


def test_last_tokens_from_json_and_bad_values():
    assert Blend.from_json({"last_tokens": 2}, Blend(1, 0.1)) == Blend(1, 0.1, last_tokens=2)
    assert Blend.from_json({"ratio": 0.3}, Blend(last_tokens=1)) == Blend(0, 0.3, last_tokens=1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="blend.last_tokens"):
            Blend.from_json({"last_tokens": bad}, Blend())


def test_last_tokens_recompute_the_end_of_each_module(tiny_llama):
    """One per segment (the schema scaffold and two modules), module blocks untouched, the
    private copies freed; ``last_tokens`` covering everything is full prefill's first token."""
    llm = make_registered(tiny_llama)
    engine = llm.engine
    out = llm.generate(PROMPT, TWO_TOKENS, blend={"last_tokens": 1})[0]
    assert out.num_recomputed_tokens == 3
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0
    every = llm.generate(PROMPT, TWO_TOKENS, blend={"last_tokens": 10**6})[0]
    full = llm.generate(PROMPT, TWO_TOKENS, blend={"ratio": 1.0})[0]
    assert every.num_recomputed_tokens == full.num_recomputed_tokens and every.token_ids == full.token_ids
