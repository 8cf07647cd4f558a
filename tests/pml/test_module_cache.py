"""PML modules served from the block pool (tiny models): exactness against the prefix cache,
positions of union members and arguments as the engine runs them, eviction and recompute, and
bad prompts leaving the pool intact (the schema dir is test_schema_store.py's); last, one module
as the whole prefix on the default model (SmolLM2-135M, fp32) gives the prefix cache's logits."""

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.engine.context import ContextState
from kvreuse.pml import PMLSemanticError, PMLSyntaxError
from kvreuse.pml.module_cache import MODULE_PRIORITY
from kvreuse.pml.schema_cost import SchemaTooLarge
from tests.engine_helpers import LogitsSpy

GREEDY = SamplingParams(max_tokens=6, temperature=0)
DOC = "The lighthouse keeper on Varn island logs every passing ship in a green ledger at dusk."
SINGLE = f'<schema name="one"><module name="doc">{DOC}</module></schema>'
SCHEMA = """<schema name="s">
  Intro text of the root.
  <union>
    <module name="a">Alpha.</module>
    <module name="b">Beta is the longer member of this union.</module>
  </union>
  <module name="r">The reader is <param name="who" len="4"/> today.</module>
  Closing words.
</schema>"""


def make(loaded, **kw) -> LLM:
    return LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, **kw)


class ChunkSpy:
    """Records the chunks the engine hands the real runner (positions, context)."""

    def __init__(self, llm: LLM):
        self.chunks = []
        runner = llm.engine.runner
        original = runner.execute

        def execute(chunks):
            self.chunks.extend(chunks)
            return original(chunks)

        runner.execute = execute


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_single_module_matches_prefix_cache(arch, request):
    """A prompt selecting one module is the plain prompt (module text + question): the
    logits of every step equal those of the prefix-cache path (<= 1e-4, fp32)."""
    loaded = request.getfixturevalue(arch)
    pml = make(loaded)
    pml.register_schema(SINGLE)
    prompt = '<prompt schema="one"><doc/> Who keeps the ledger?</prompt>'
    prepared = pml.engine.modules.prepare(prompt)
    pml.engine.pool.release(reversed(prepared.context.blocks))
    schema = pml.engine.modules.schemas["one"]
    plain_ids = list(schema.module("doc").stored_token_ids) + prepared.token_ids
    assert prepared.position_ids == list(range(len(schema.module("doc").stored_token_ids), len(plain_ids)))

    spy = LogitsSpy(pml)
    out = pml.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == len(schema.module("doc").stored_token_ids)
    assert out.num_prompt_tokens == len(plain_ids)

    ref = make(loaded)
    ref.generate(plain_ids, GREEDY)
    ref_spy = LogitsSpy(ref)
    again = ref.generate(plain_ids, GREEDY)[0]
    assert again.num_cached_tokens > 0  # the reference really is the prefix cache
    assert again.token_ids == out.token_ids
    for a, b in zip(spy.rows, ref_spy.rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def test_union_member_and_argument_positions(tiny_llama):
    llm = make(tiny_llama)
    info = llm.register_schema(SCHEMA)
    schema = llm.engine.modules.schemas["s"]
    a, b, r = schema.module("a"), schema.module("b"), schema.module("r")
    assert a.start == b.start  # members share their start
    slot = r.slot("who")
    spy = ChunkSpy(llm)
    prompt = '<prompt schema="s"><b/><r who="Ana"/>Who reads?</prompt>'
    out = llm.generate(prompt, GREEDY)[0]
    prefill, decode = spy.chunks[0], spy.chunks[1]
    context = set(prefill.context_positions)
    assert set(b.stored_position_ids) <= context and not set(a.stored_position_ids) & (
        context - set(b.stored_position_ids)
    )
    assert set(r.stored_position_ids) <= context and not context & set(range(slot.start, slot.end))
    arg = [p for p in prefill.positions if p < schema.length]
    assert arg == list(range(slot.start, slot.start + len(arg))) and 1 <= len(arg) <= slot.length
    text = [p for p in prefill.positions if p >= schema.length]
    assert text == list(range(schema.length, schema.length + len(text)))
    assert decode.positions == [text[-1] + 1]
    stored = sum(len(schema.module(n).stored_token_ids) for n in ("", "b", "r"))
    assert out.num_cached_tokens == stored
    assert info.present == 0 and info.computed == len(info.modules)


def test_module_blocks_are_kept_at_high_priority_and_recomputed_after_eviction(tiny_llama):
    llm = make(tiny_llama)
    info = llm.register_schema(SCHEMA)
    blocks = llm.engine.pool.blocks_by_priority()
    assert blocks == {
        MODULE_PRIORITY: sum(
            -(-len(llm.engine.modules.schemas["s"].module(m).stored_token_ids) // 4) for m in info.modules
        )
    }
    prompt = '<prompt schema="s"><a/><r who="Bo"/>Go on.</prompt>'
    first = llm.generate(prompt, GREEDY)[0]
    assert llm.reset_prefix_cache() > 0  # every module block evicted
    assert llm.engine.pool.blocks_by_priority() == {}
    spy = LogitsSpy(llm)
    second = llm.generate(prompt, GREEDY)[0]
    assert second.token_ids == first.token_ids and second.num_cached_tokens == first.num_cached_tokens
    again = llm.register_schema(SCHEMA)
    assert again.present == len(info.modules) - 1 and again.computed == 1  # "b" was not needed
    assert spy.rows


def test_bad_prompts_raise_and_leave_the_pool_intact(tiny_llama):
    llm = make(tiny_llama)
    with pytest.raises(PMLSyntaxError) as bad:
        llm.register_schema('<schema name="x">\n  <module name="m">oops</modul>\n</schema>')
    assert bad.value.line == 2
    llm.register_schema(SCHEMA)
    free = llm.engine.pool.num_free_blocks
    with pytest.raises(PMLSemanticError, match="nope"):
        llm.generate('<prompt schema="s"><nope/>Hi</prompt>', GREEDY)
    with pytest.raises(PMLSemanticError, match="who"):
        llm.generate('<prompt schema="s"><r/>Hi</prompt>', GREEDY)
    with pytest.raises(PMLSemanticError, match="unknown schema"):
        llm.generate('<prompt schema="zzz">Hi</prompt>', GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate('<prompt schema="s"><b/>Hi</prompt>', SamplingParams(max_tokens=10**6))
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_free_blocks == free
    assert llm.engine.pool.num_used_blocks == 0


def test_prompt_without_text_decodes_after_the_last_module(tiny_llama):
    llm = make(tiny_llama)
    llm.register_schema(SINGLE)
    spy = ChunkSpy(llm)
    out = llm.generate('<prompt schema="one"><doc/></prompt>', GREEDY)[0]
    doc = llm.engine.modules.schemas["one"].module("doc")
    assert spy.chunks[0].positions == [doc.stored_position_ids[-1]]
    assert spy.chunks[1].positions == [doc.stored_position_ids[-1] + 1]
    assert out.num_cached_tokens == len(doc.stored_token_ids) - 1


def test_failed_replace_keeps_the_working_schema(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.0002, block_size=4)  # ~100 blocks
    llm.register_schema(SINGLE)
    free = llm.engine.pool.num_free_blocks
    huge = f'<schema name="one"><module name="doc">{" ".join(["word"] * (4 * free + 40))}</module></schema>'
    assert 4 * free + 40 < llm.engine.max_model_len  # too big for the pool, not for the context
    with pytest.raises(SchemaTooLarge, match=r"needs \d+ KV blocks .* but the pool has \d+.*--kv-cache-memory"):
        llm.register_schema(huge)  # refused before any work
    # One that fits the pool but not what a running request leaves: its first module is
    # computed, the second cannot be held, the registration fails mid-way.
    engine = llm.engine
    engine.add_request("hog", list(range(100, 100 + 4 * (free - 20))), SamplingParams(max_tokens=1))
    engine.scheduler.schedule()  # admitted: it holds its blocks
    first = f'<module name="a">{" ".join(["alpha"] * 8)}</module>'
    second = f'<module name="b">{" ".join(["beta"] * 4 * 30)}</module>'
    with pytest.raises(ValueError, match="free blocks"):
        llm.register_schema(f'<schema name="one">{first}{second}</schema>')
    engine.abort_request("hog")
    engine.check_integrity()
    assert sorted(llm.engine.modules.schemas) == ["one"]
    out = llm.generate('<prompt schema="one"><doc/> Who keeps the ledger?</prompt>', GREEDY)[0]
    assert out.num_cached_tokens == len(llm.engine.modules.schemas["one"].module("doc").stored_token_ids)
    # what the failed attempt cached (module "a") does not squat at the module priority
    schema_blocks = -(-out.num_cached_tokens // 4)
    assert llm.engine.pool.blocks_by_priority()[MODULE_PRIORITY] == schema_blocks


def test_registering_again_after_removal_restores_the_module_priority(tiny_llama):
    llm = make(tiny_llama)
    info = llm.register_schema(SCHEMA)
    held = llm.engine.pool.blocks_by_priority()
    assert llm.remove_schema("s") and not llm.remove_schema("s")
    assert MODULE_PRIORITY not in llm.engine.pool.blocks_by_priority()
    again = llm.register_schema(SCHEMA)
    assert again.present == len(info.modules) and again.computed == 0
    assert llm.engine.pool.blocks_by_priority() == held
    llm.engine.pool.check_integrity()


def test_schema_longer_than_the_context_is_refused_at_registration(tiny_llama):
    llm = make(tiny_llama, max_model_len=64)
    text = f'<schema name="long"><module name="m">{" ".join(["word"] * 80)}</module></schema>'
    with pytest.raises(PMLSemanticError, match="context is 64"):
        llm.register_schema(text)
    assert llm.engine.modules.schemas == {}
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_waiting_requests_holding_module_kv_never_deadlock_the_pool(tiny_llama):
    """Two schemas whose modules fill most of a small pool; one request at a time runs.
    The waiting requests hold their module KV, so the first cannot be admitted and nothing
    runs: the ones behind it let their module KV go (acquired again, recomputed if evicted,
    when their turn comes). Every request finishes with the tokens it gets alone."""
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    small = LLM(loaded=tiny_llama, kv_cache_memory_gib=40 * bytes_per_block / 2**30, block_size=4, max_num_seqs=1)
    roomy = make(tiny_llama)

    def words(n, tag):
        return " ".join(f"w{tag}x{i}" for i in range(n))

    for llm in (small, roomy):
        for name in ("a", "b"):
            llm.register_schema(f'<schema name="{name}"><module name="m">{words(20, name)}</module></schema>')
    assert sum(small.engine.pool.blocks_by_priority().values()) > 30  # of 40 blocks
    prompts = [f'<prompt schema="{s}"><m/>{words(6, q)}</prompt>' for s, q in (("a", "q"), ("b", "r"), ("a", "s"))]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = small.engine
    for i, prompt in enumerate(prompts):
        engine.add_prepared_request(f"r{i}", engine.prepare_prompt(prompt), params)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 1000, "the engine made no progress"
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    alone = [roomy.generate(p, params)[0].token_ids for p in prompts]
    assert [outs[f"r{i}"].token_ids for i in range(3)] == alone
    assert engine.pool.num_used_blocks == 0


def test_pml_request_arriving_when_the_pool_is_busy_waits_instead_of_failing(tiny_llama):
    """Its modules were evicted and running requests hold the pool: the request is queued
    and acquires (recomputes) its module KV when its turn comes, like any request that
    waits for memory; it is not refused."""
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    small = LLM(loaded=tiny_llama, kv_cache_memory_gib=40 * bytes_per_block / 2**30, block_size=4)
    roomy = make(tiny_llama)
    schema = f'<schema name="a"><module name="m">{" ".join(f"wax{i}" for i in range(20))}</module></schema>'
    prompt = '<prompt schema="a"><m/>and then what happened</prompt>'
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for llm in (small, roomy):
        llm.register_schema(schema)
    engine = small.engine
    engine.add_request("hog", list(range(100, 220)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()  # the hog holds 30 of 40 blocks; part of the module's 13 blocks were evicted for it
    engine.add_prepared_request(
        "pml", engine.prepare_prompt(prompt), params
    )  # used to raise "the KV pool has N free blocks"
    assert engine._requests["pml"].context.state is ContextState.RELEASED  # it really had to wait for its module KV
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    assert outs["pml"].token_ids == roomy.generate(prompt, params)[0].token_ids
    assert engine.pool.num_used_blocks == 0


INTRO = " ".join(f"rule{i}" for i in range(24))  # the root's text every member is encoded after
LONG = f"""<schema name="long">{INTRO}
  <union>
    <module name="m">{" ".join(f"wax{i}" for i in range(30))}</module>
    <module name="n">Short.</module>
  </union>
</schema>"""


def _evict_tail(llm: LLM, schema_name: str, module: str) -> None:
    """Forget the last cached block of a module's chain (eviction takes chains from the tail)."""
    modules = llm.engine.modules
    schema = modules.schemas[schema_name]
    last = modules.module_hashes(schema, schema.module(module))[0][-1]
    llm.engine.pool.remove_cached([llm.engine.pool.get_cached(last)])


class PeakSpy:
    """The most blocks the pool has in use while a module's precompute pass runs."""

    def __init__(self, llm: LLM) -> None:
        self.peak = 0
        runner, pool = llm.engine.modules.runner, llm.engine.pool
        precompute = runner.precompute_chunk

        def counted(*args, **kwargs):
            self.peak = max(self.peak, pool.num_used_blocks)
            return precompute(*args, **kwargs)

        runner.precompute_chunk = counted


def test_a_module_plan_counts_the_scratch_of_its_recompute(tiny_llama):
    """``ModuleSource.num_blocks`` is what an acquisition needs at once: a member recomputed
    after an eviction holds the root's blocks, its own and the scratch of the root's text it
    attends to but does not keep, more than the blocks it keeps (``held_blocks``). With room,
    a member whose chain lost only its last block recomputes its cached part into scratch too."""
    llm = make(tiny_llama)
    llm.register_schema(LONG)
    plan = llm.engine.prepare_prompt('<prompt schema="long"><m/> Go on.</prompt>').plan
    source = llm.engine.modules.source(plan)
    assert source.held_blocks == llm.engine.modules.blocks_of(plan)
    for evict, expected in (
        (lambda: llm.reset_prefix_cache(), "exact"),
        (lambda: _evict_tail(llm, "long", "m"), "more"),
    ):
        evict()
        spy = PeakSpy(llm)
        held = source.acquire()
        assert held is not None and len(held.blocks) == source.held_blocks
        assert spy.peak > source.held_blocks  # the scratch mattered
        if expected == "exact":
            assert spy.peak == source.num_blocks
        else:
            assert spy.peak > source.num_blocks  # the pool had room for the scratch of the cached part
        source.release(held)
        llm.engine.check_integrity()


def test_a_chain_cached_in_part_that_cannot_be_recomputed_beside_itself_is_recomputed_whole(tiny_llama):
    """A pool with room for the request's peak but not for recomputing "m"'s cached part into
    scratch beside it (its tail was evicted): the fill lets the cached part go and computes the
    chain whole (it used to wait for ever, nothing else running to free a block), with the
    tokens a roomy engine gives."""
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    prompt = '<prompt schema="long"><m/> Go on.</prompt>'
    params = SamplingParams(max_tokens=2, temperature=0)
    roomy = make(tiny_llama)
    roomy.register_schema(LONG)
    source = roomy.engine.modules.source(roomy.engine.prepare_prompt(prompt).plan)
    pool_blocks = source.num_blocks + 2
    _evict_tail(roomy, "long", "m")
    spy = PeakSpy(roomy)
    expected = roomy.generate(prompt, params)[0]
    assert spy.peak > pool_blocks  # recomputed beside its cached part, it would not fit
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=pool_blocks * bytes_per_block / 2**30, block_size=4)
    assert llm.engine.pool.num_blocks == pool_blocks
    llm.register_schema(LONG)
    _evict_tail(llm, "long", "m")
    llm.engine.add_prepared_request("pml", llm.engine.prepare_prompt(prompt), params)
    outs = []
    for _ in range(20):
        outs += llm.engine.step()
        if not llm.engine.has_unfinished_requests():
            break
    assert outs and outs[-1].finished and outs[-1].token_ids == expected.token_ids
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


def test_a_pml_request_whose_recompute_cannot_fit_is_refused_up_front(tiny_llama):
    """A pool that holds the modules and the request's own blocks but not the scratch of
    recomputing "m" after its tail was evicted: the request could never run (it used to be
    queued and wait forever), so it is a ValueError naming the blocks, whatever the pool holds
    at arrival."""
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    prompt = '<prompt schema="long"><m/> Go on.</prompt>'
    probe = make(tiny_llama)
    probe.register_schema(LONG)
    pool_blocks = probe.engine.modules.blocks_of(probe.engine.prepare_prompt(prompt).plan) + 4  # + the request's 2
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=pool_blocks * bytes_per_block / 2**30, block_size=4)
    assert llm.engine.pool.num_blocks == pool_blocks
    llm.register_schema(LONG)
    _evict_tail(llm, "long", "m")
    # max_tokens is not what is too big, so the message says what is
    with pytest.raises(
        ValueError,
        match=rf"context needs \d+ KV blocks at once .* but the pool has {pool_blocks}: "
        "use fewer or shorter modules",
    ):
        llm.engine.add_prepared_request(
            "pml", llm.engine.prepare_prompt(prompt), SamplingParams(max_tokens=2, temperature=0)
        )
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


def test_a_pml_request_whose_peak_overflows_is_never_told_to_lower_max_tokens(tiny_llama):
    """The acquisition's peak alone is over the pool: whatever max_tokens asks (even one whose
    blocks held beside the modules are more than that peak), no max_tokens makes the request
    fit, so the message names the context, never 'lower max_tokens'."""
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    prompt = '<prompt schema="long"><m/> Go on.</prompt>'
    probe = make(tiny_llama)
    probe.register_schema(LONG)
    source = probe.engine.modules.source(probe.engine.prepare_prompt(prompt).plan)
    pool_blocks = source.held_blocks + 4
    assert source.num_blocks > pool_blocks
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=pool_blocks * bytes_per_block / 2**30, block_size=4)
    llm.register_schema(LONG)
    for max_tokens in (2, 4 * source.num_blocks):  # held below the peak, then well above it
        with pytest.raises(
            ValueError,
            match=rf"context needs \d+ KV blocks at once .* but the pool has {pool_blocks}: "
            "use fewer or shorter modules",
        ):
            llm.engine.add_prepared_request(
                f"r{max_tokens}",
                llm.engine.prepare_prompt(prompt),
                SamplingParams(max_tokens=max_tokens, temperature=0),
            )
    assert not llm.engine.has_unfinished_requests()


def test_a_repaired_pml_request_counts_its_copies_beside_what_the_modules_keep(tiny_llama):
    """Seam repair's private copies are made once the modules' acquisition returned (its scratch
    gone): a pool with room for the recompute's peak, or for the modules, their copies and the
    request's own blocks, runs a repaired request whose "m" lost its tail (the copies were
    counted on top of the peak, refusing it)."""
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4
    prompt = '<prompt schema="long"><m/> Go on.</prompt>'
    blend = {"first_tokens": 1, "ratio": 0.5}
    probe = make(tiny_llama)
    probe.register_schema(LONG)
    source = probe.engine.modules.source(probe.engine.prepare_prompt(prompt).plan)
    held = source.held_blocks
    pool_blocks = max(source.num_blocks, 2 * held) + 3
    assert source.num_blocks + held > pool_blocks  # the peak plus a copy per module block does not fit
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=pool_blocks * bytes_per_block / 2**30, block_size=4)
    llm.register_schema(LONG)
    _evict_tail(llm, "long", "m")
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.engine.add_prepared_request("pml", llm.engine.prepare_prompt(prompt), params, blend=blend)
    outs = []
    for _ in range(20):
        outs += llm.engine.step()
        if not llm.engine.has_unfinished_requests():
            break
    assert outs and outs[-1].finished and outs[-1].num_recomputed_tokens > 0
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


# PML exactness on the default model (SmolLM2-135M, fp32): a prompt selecting one module
# used as a plain prefix gives the prefix cache's logits (<= 1e-4) at every step.
KELL_DOC = (
    "The observatory on Mount Kell was built in 1911 by the engineer Ada Varga. Its main telescope has a "
    "mirror of 1.2 metres and is used every clear night from October to March. "
) * 3
# The module is the whole prefix: a module attends only to itself (and its scaffolds), so
# anything before it in the schema (a system turn) would not be seen, unlike a plain prefix.
KELL_SCHEMA = f'<schema name="kell"><module name="doc">{KELL_DOC}</module></schema>'
KELL_PROMPT = '<prompt schema="kell"><doc/> Question: who built the observatory? Answer:</prompt>'


def test_single_module_matches_prefix_cache_on_default_model(default_model):
    params = SamplingParams(max_tokens=4, temperature=0)
    pml = LLM(loaded=default_model, kv_cache_memory_gib=0.05)
    pml.register_schema(KELL_SCHEMA)
    schema = pml.engine.modules.schemas["kell"]
    prepared = pml.engine.modules.prepare(KELL_PROMPT)
    pml.engine.pool.release(reversed(prepared.context.blocks))
    prefix = list(schema.module("").stored_token_ids) + list(schema.module("doc").stored_token_ids)
    plain = prefix + prepared.token_ids
    assert prepared.position_ids == list(range(len(prefix), len(plain)))
    spy = LogitsSpy(pml)
    out = pml.generate(KELL_PROMPT, params)[0]
    assert out.num_cached_tokens == len(prefix)

    ref = LLM(loaded=default_model, kv_cache_memory_gib=0.05)
    ref.generate(plain, params)
    ref_spy = LogitsSpy(ref)
    again = ref.generate(plain, params)[0]
    assert again.num_cached_tokens >= len(prefix) - 16
    assert again.token_ids == out.token_ids
    for a, b in zip(spy.rows, ref_spy.rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
