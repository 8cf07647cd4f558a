"""Blend's ``deviation_layer`` (engine/blend.py, engine/blended_context.py,
BlendPass.seam_deviation): the layer whose K/V deviation ranks tokens for the ratio, per
request; the default stays CacheBlend's layer 1."""

import numpy as np
import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.engine.blend import DEVIATION_LAYER, Blend

GREEDY = SamplingParams(max_tokens=2, temperature=0)
SCHEMA = """<schema name="s">Notes:
<module name="a">The lighthouse keeper on Varn island logs ships in a green ledger.</module>
<module name="b">Every ledger on the island is kept in the harbour office at dusk.</module>
</schema>"""
PROMPT = '<prompt schema="s"><a/><b/>Where is the ledger kept?</prompt>'


def make(loaded) -> LLM:
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


@pytest.mark.parametrize("blend, layer", [({"ratio": 0.5}, DEVIATION_LAYER), ({"ratio": 0.5, "deviation_layer": 3}, 3),
                                          ({"ratio": 0.3, "first_tokens": 1, "deviation_layer": 2}, 2)])
def test_the_requested_layer_ranks_the_tokens(tiny_gemma3, monkeypatch, blend, layer):
    """The deviation pass runs at the request's layer, and the recomputed tokens are the ones
    its scores rank highest (plus first_tokens)."""
    llm = make(tiny_gemma3)
    engine = llm.engine
    calls = []
    real = engine.blend_pass.seam_deviation

    def spy(token_ids, positions, slots, layer=DEVIATION_LAYER, shifts=None):
        calls.append((layer, real(token_ids, positions, slots, layer=layer, shifts=shifts)))
        return calls[-1][1]

    monkeypatch.setattr(engine.blend_pass, "seam_deviation", spy)
    out = llm.generate(PROMPT, GREEDY, blend=blend)[0]
    (got_layer, deviation), = calls
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
    llm = make(request.getfixturevalue(arch))
    engine = llm.engine
    runner = engine.runner
    scores = {}
    real = engine.blend_pass.seam_deviation

    def grab(token_ids, positions, slots, layer=DEVIATION_LAYER, shifts=None):
        for each in range(1, runner.layout.num_layers):
            scores[each] = real(token_ids, positions, slots, layer=each, shifts=shifts)
        return scores[layer]

    engine.blend_pass.seam_deviation = grab
    llm.generate(PROMPT, GREEDY, blend={"ratio": 0.5})
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
    llm = make(tiny_llama)
    engine = llm.engine
    out = llm.generate(PROMPT, GREEDY, blend={"last_tokens": 1})[0]
    assert out.num_recomputed_tokens == 3
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0
    every = llm.generate(PROMPT, GREEDY, blend={"last_tokens": 10**6})[0]
    full = llm.generate(PROMPT, GREEDY, blend={"ratio": 1.0})[0]
    assert every.num_recomputed_tokens == full.num_recomputed_tokens and every.token_ids == full.token_ids
