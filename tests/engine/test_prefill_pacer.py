"""engine/prefill_pacer.py: a documents or PML prompt's context pass (computed when the prompt
is assembled, outside the scheduler) lets running decodes step between its chunks, at the
scheduler's cap; unattached (the synchronous LLM) it changes nothing."""

import asyncio

from kvreuse import LLM, SamplingParams
from kvreuse.engine.async_engine import AsyncEngine
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.engine.prefill_pacer import PrefillPacer
from tests.engine_helpers import step_to_end

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0)
NO_REPAIR = {"document_blend_first_tokens": 0, "document_blend_ratio": 0.0, "document_blend_last_tokens": 0}


def test_unattached_pacer_changes_nothing():
    pacer = PrefillPacer(8)
    assert pacer.chunk_tokens(100) == 100
    pacer.between()  # no step to run
    assert pacer.steps_between == 0


def test_attached_pacer_caps_chunks_and_steps_only_while_decoding():
    steps, decoding = [], [True]
    pacer = PrefillPacer(8)
    pacer.attach(lambda: steps.append(1), lambda: decoding[0])
    assert pacer.chunk_tokens(100) == 8
    assert pacer.chunk_tokens(5) == 5  # never more than the pass's own chunk
    pacer.between()
    assert steps == [1] and pacer.steps_between == 1
    decoding[0] = False  # nothing decodes: the pass runs whole, no step
    assert pacer.chunk_tokens(100) == 100
    pacer.between()
    assert steps == [1]


def test_between_never_nests():
    pacer = PrefillPacer(4)
    seen = []

    def step():  # a context acquired inside the step (the waiting head's) runs whole
        seen.append((pacer.active, pacer.chunk_tokens(64)))
        pacer.between()

    pacer.attach(step, lambda: True)
    pacer.between()
    assert seen == [(False, 64)] and pacer.steps_between == 1


def test_uncapped_pacer_never_steps():
    pacer = PrefillPacer(None)
    pacer.attach(lambda: (_ for _ in ()).throw(AssertionError("stepped")), lambda: True)
    assert pacer.chunk_tokens(100) == 100
    pacer.between()


def _llm(tiny_llama) -> LLM:
    return LLM(
        loaded=tiny_llama,
        kv_cache_memory_gib=0.02,
        block_size=4,
        max_prefill_tokens_while_decoding=8,
        **NO_REPAIR,
    )


def test_document_pass_steps_running_decode_between_chunks(tiny_llama):
    """A 40-token document added while a request decodes: its pass in 6 chunks of <= 8 (the
    cap), a step between each two; the decoding request advances 5 tokens during the pass, and both
    requests' outputs are those of the same requests run one after the other."""
    llm = _llm(tiny_llama)
    document = list(range(100, 140))
    prompt = DocumentPrompt.of([([7, 8, 9], False), (document, True), ([11, 12], False)])
    alone = llm.generate([[5, 6, 7, 8]], LONG)[0].output_token_ids
    doc_alone = llm.generate(prompt, ONE)[0].output_token_ids

    fresh = _llm(tiny_llama)
    engine = fresh.engine
    outputs: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.pacer.attach(step, engine.scheduler.has_decoding)
    engine.add_request("a", [5, 6, 7, 8], LONG)
    step()  # the prompt: "a" decodes from here on
    assert engine.scheduler.has_decoding()
    before = len(outputs["a"])
    engine.add_prepared_request("doc", prompt, ONE)
    engine.check_integrity()
    # the pass runs the 40 document tokens after the 3 of head text: 43 = 6 chunks of <= 8
    assert engine.pacer.steps_between == 5
    assert len(outputs["a"]) == before + 5
    engine.pacer.attach(lambda: None, lambda: False)
    for rid, out in step_to_end(engine).items():
        outputs.setdefault(rid, []).extend(out.output_token_ids[len(outputs.get(rid, [])) :])
    engine.check_integrity()
    assert outputs["a"] == alone
    assert outputs["doc"] == doc_alone


def test_engine_loop_attaches_the_pacer(tiny_llama):
    """Through ``AsyncEngine``: a documents prompt sent while a stream decodes runs its pass in
    capped chunks with steps between them; both finish."""
    llm = _llm(tiny_llama)
    document = list(range(100, 140))
    prompt = DocumentPrompt.of([([7, 8, 9], False), (document, True), ([11, 12], False)])

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            stream = engine.generate([5, 6, 7, 8], params, request_id="a")
            first = await stream.__anext__()  # "a" is decoding from here on
            doc = [out async for out in engine.generate([], ONE, request_id="doc", prepared=prompt)]
            rest = [out async for out in stream]
            return first, doc, rest
        finally:
            engine.shutdown()

    first, doc, rest = asyncio.run(main())
    assert doc[-1].finished and len(doc[-1].output_token_ids) == 1
    assert rest[-1].finished and len(rest[-1].output_token_ids) == 400
    assert llm.engine.pacer.steps_between >= 1
    llm.engine.check_integrity()


def test_module_recompute_steps_running_decode_between_chunks(tiny_llama):
    """A PML prompt whose module was evicted recomputes it when assembled: on the module grid
    (``--schema-slice-tokens`` 4), with a step of the decoding request between two chunks; the
    grid is fixed, so the prompt's reply is the one it gets when nothing else runs."""
    doc = "The lighthouse keeper on Varn island logs every passing ship in a green ledger at dusk."
    schema = f'<schema name="one"><module name="doc">{doc}</module></schema>'
    prompt = '<prompt schema="one"><doc/>Who keeps it?</prompt>'

    def make() -> LLM:
        llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4, schema_slice_tokens=4)
        llm.register_schema(schema)
        assert llm.reset_prefix_cache() > 0  # the module's blocks evicted: the prompt recomputes them
        return llm

    expected = make().generate(prompt, SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    llm = make()
    engine = llm.engine
    steps: list[int] = []

    def step():
        steps.extend(len(out.new_token_ids) for out in engine.step())

    engine.pacer.attach(step, engine.scheduler.has_decoding)
    engine.add_request("a", [5, 6, 7, 8], LONG)
    step()
    module_tokens = len(engine.modules.schemas["one"].module("doc").stored_token_ids)
    engine.add_prepared_request("p", engine.prepare_prompt(prompt), SamplingParams(max_tokens=6, temperature=0))
    engine.check_integrity()
    assert engine.pacer.steps_between == -(-module_tokens // 4) - 1  # one step between two chunks
    engine.pacer.attach(lambda: None, lambda: False)
    done = step_to_end(engine)
    engine.check_integrity()
    assert done["p"].output_token_ids == expected


def test_a_context_reacquired_inside_a_step_never_runs_a_step_inside_it(tiny_llama):
    """Review finding: a documents request that arrives while the pool is full waits with its
    context let go; a later step re-acquires it while another request decodes. That pass must
    not pace (a step inside the step acquired the same context twice and leaked its first
    hold: 11 of 40 blocks lost). Through the server's own loop (``EngineLoop._step``)."""
    from kvreuse.engine import llm_engine as le
    from kvreuse.engine.engine_loop import EngineLoop

    llm = LLM(
        loaded=tiny_llama,
        kv_cache_memory_gib=40 * 4 * 512 / 2**30,  # 40 blocks of 4 tokens (tiny Llama: 512 B a token)
        block_size=4,
        max_prefill_tokens_while_decoding=8,
        **NO_REPAIR,
    )
    engine = llm.engine
    assert engine.pool.num_blocks == 40
    loop = EngineLoop(engine)  # attaches the pacer to loop._step
    depth, deepest = [0], [0]
    real = le.LLMEngine.step

    def counted(self):
        depth[0] += 1
        deepest[0] = max(deepest[0], depth[0])
        try:
            return real(self)
        finally:
            depth[0] -= 1

    le.LLMEngine.step = counted
    try:
        engine.add_request(
            "a", [(i * 7) % 900 + 20 for i in range(120)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        )
        engine.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        while not engine.scheduler.has_decoding() or len(engine.scheduler.running) < 2:
            loop._step()
        prompt = DocumentPrompt.of([([7, 8, 9], False), (list(range(100, 140)), True), ([11, 12], False)])
        engine.add_prepared_request("doc", prompt, ONE)
        assert not engine._requests["doc"].context.blocks  # the pool is full: it waits, let go
        while engine.has_unfinished_requests():
            loop._step()
            engine.check_integrity()
    finally:
        le.LLMEngine.step = real
    assert deepest[0] == 1
    engine.reset_prefix_cache()
    assert engine.pool.num_free_blocks == 40


def test_default_cpu_cap_grows_with_the_decoding_streams_as_the_schedulers(tiny_llama):
    """No cap given on CPU: the scheduler lets a step carry max(16, 4 x its decodes) prefill
    tokens, and a context pass gets the same share. With 8 streams decoding, a 64-token pass
    (3 of head text, 61 of document) runs in 2 chunks of <= 32, one step between them."""
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_REPAIR)
    engine = llm.engine
    assert engine.scheduler.max_prefill_tokens_while_decoding == 16
    assert engine.scheduler.prefill_tokens_per_decode == 4
    engine.pacer.attach(engine.step, engine.scheduler.num_decoding)
    for i in range(8):
        engine.add_request(f"s{i}", [5 + i, 6, 7, 8], LONG)
    engine.step()  # the 8 prompts: every stream decodes from here on
    assert engine.scheduler.num_decoding() == 8
    prompt = DocumentPrompt.of([([7, 8, 9], False), (list(range(100, 161)), True), ([11, 12], False)])
    engine.add_prepared_request("doc", prompt, ONE)
    assert engine.pacer.steps_between == 1
    engine.pacer.attach(lambda: None, lambda: 0)
    step_to_end(engine)
    engine.check_integrity()
