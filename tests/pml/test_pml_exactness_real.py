"""PML exactness on the default model (SmolLM2-135M, fp32): a prompt selecting one module
used as a plain prefix gives the prefix cache's logits (<= 1e-4) at every step."""

from kvreuse import LLM, SamplingParams
from tests.engine_helpers import LogitsSpy

DOC = ("The observatory on Mount Kell was built in 1911 by the engineer Ada Varga. Its main telescope has a "
       "mirror of 1.2 metres and is used every clear night from October to March. ") * 3
# The module is the whole prefix: a module attends only to itself (and its scaffolds), so
# anything before it in the schema (a system turn) would not be seen, unlike a plain prefix.
SCHEMA = f'<schema name="kell"><module name="doc">{DOC}</module></schema>'
PROMPT = '<prompt schema="kell"><doc/> Question: who built the observatory? Answer:</prompt>'


def test_single_module_matches_prefix_cache_on_default_model(default_model):
    params = SamplingParams(max_tokens=4, temperature=0)
    pml = LLM(loaded=default_model, kv_cache_memory_gib=0.05)
    pml.register_schema(SCHEMA)
    schema = pml.engine.modules.schemas["kell"]
    prepared = pml.engine.modules.prepare(PROMPT)
    pml.engine.pool.release(reversed(prepared.context.blocks))
    prefix = list(schema.module("").stored_token_ids) + list(schema.module("doc").stored_token_ids)
    plain = prefix + prepared.token_ids
    assert prepared.position_ids == list(range(len(prefix), len(plain)))
    spy = LogitsSpy(pml)
    out = pml.generate(PROMPT, params)[0]
    assert out.num_cached_tokens == len(prefix)

    ref = LLM(loaded=default_model, kv_cache_memory_gib=0.05)
    ref.generate(plain, params)
    ref_spy = LogitsSpy(ref)
    again = ref.generate(plain, params)[0]
    assert again.num_cached_tokens >= len(prefix) - 16
    assert again.token_ids == out.token_ids
    for a, b in zip(spy.rows, ref_spy.rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
