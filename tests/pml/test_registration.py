"""Schemas registered in slices between engine steps (tiny Llama, one LLMEngine driven step by
step, no threads): the cost limits refuse before any work, a slice never runs more than its
budget, a running request decodes at every step the registration runs in, the KV and outputs
are bit for bit those of a registration done at once, and failures hold nothing."""

from __future__ import annotations

import pytest
import torch

from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
from kvreuse.pml.schema_cost import SchemaTooLarge
from kvreuse.sampling_params import SamplingParams

SLICE = 8  # tokens per step: every member's pass (root text + member) is split in chunks
GREEDY = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
STREAM_PROMPT = list(range(300, 340))


def union(name: str, members: int, *, tag: str = "") -> str:
    rows = "".join(
        f'<module name="f{i}">Fact {i}{tag}: lighthouse {i} logs ships at dusk.</module>' for i in range(members)
    )
    return f'<schema name="{name}"><system>Answer from the facts.</system><union>{rows}</union></schema>'


def make(tiny_llama, **config) -> LLMEngine:
    settings = {
        "kv_cache_memory_gib": 0.01,
        "block_size": 4,
        "max_model_len": 512,
        "schema_slice_tokens": SLICE,
        **config,
    }
    return LLMEngine(EngineConfig(**settings), tiny_llama)


def tick(engine: LLMEngine) -> list:
    """One turn of the engine loop (``AsyncEngine._step``): a step, then a registration slice."""
    out = engine.step()
    engine.precompute_slice()
    return out


class Settled:
    """The ``settle`` callback of a registration: what it ended with."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, bool]] = []

    def __call__(self, value, failed: bool) -> None:
        self.calls.append((value, failed))


def module_kv(engine: LLMEngine, name: str) -> dict[str, torch.Tensor]:
    """Every stored module's KV as the pool holds it now (acquired and released)."""
    cache = engine.modules
    schema = cache.schemas[name]
    out = {}
    for module in schema.precompute_modules:
        blocks = cache._ensure(schema, module)
        out[module.qualified_name] = cache.read_kv(module, blocks)
        engine.pool.release(reversed(blocks))
    return out


def run_alone(tiny_llama) -> list[int]:
    engine = make(tiny_llama)
    engine.add_request("s", STREAM_PROMPT, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    return tokens


def test_a_union_registers_in_slices_while_a_request_decodes_every_step(tiny_llama):
    text = union("facts", 12)
    engine = make(tiny_llama)
    engine.add_request("s", STREAM_PROMPT, GREEDY)
    engine.step()  # the stream's prefill
    settled = Settled()
    engine.submit_schema(text, settled)
    assert engine.stats().schemas_registering == 1 and engine.modules.tokens_computed == 0
    (job,) = engine.registrations
    cost = engine.modules.cost(job.schema)
    steps = []  # (module tokens run in the step, the stream decoded in it)
    tokens = []
    while engine.registrations.has_work():
        before = engine.modules.tokens_computed
        out = tick(engine)
        engine.check_integrity()  # the registration's held blocks are accounted for
        tokens += [t for o in out for t in o.new_token_ids]
        steps.append((engine.modules.tokens_computed - before, [o.request_id for o in out]))
        assert "facts" not in engine.modules.schemas or not engine.registrations.has_work()
    ran = [n for n, _ in steps]
    assert max(ran) <= SLICE and sum(ran) == cost.tokens == engine.modules.tokens_computed
    assert len(steps) >= cost.tokens // SLICE
    assert all(ids == ["s"] for _, ids in steps)  # one stream token per step, every step
    assert engine.registrations.slices == len(steps)
    ((info, failed),) = settled.calls
    assert not failed and info.computed == 13 and info.precompute_tokens == cost.tokens
    assert sorted(engine.modules.schemas) == ["facts"]
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == run_alone(tiny_llama)[1:]  # the stream's tokens after its first, unchanged
    stats = engine.stats()
    assert stats.tokens_computed_modules == cost.tokens
    assert stats.tokens_computed == len(STREAM_PROMPT) + 199 + cost.tokens  # module precompute counted


def test_sliced_registration_gives_the_kv_and_logits_of_one_done_at_once(tiny_llama):
    text = union("facts", 6)
    prompt = '<prompt schema="facts"><f3/><user>Which lighthouse?</user></prompt>'
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5)

    at_once = make(tiny_llama)
    at_once.modules.register(text)
    sliced = make(tiny_llama)
    sliced.add_request("s", STREAM_PROMPT, GREEDY)  # other KV written between the slices
    sliced.submit_schema(text, Settled())
    while sliced.registrations.has_work():
        tick(sliced)
    sliced.abort_request("s")
    a, b = module_kv(at_once, "facts"), module_kv(sliced, "facts")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    outs = []
    for engine in (at_once, sliced):
        engine.add_prepared_request("q", engine.prepare_prompt(prompt), params)
        while engine.has_unfinished_requests():
            final = engine.step()
        outs.append(final[0])
        engine.check_integrity()
    assert outs[0].token_ids == outs[1].token_ids
    for x, y in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        assert x == y  # exact floats


def test_cost_limits_refuse_before_any_work(tiny_llama):
    text = union("facts", 40)
    probe = make(tiny_llama)
    cost = probe.modules.cost(probe.modules.compile(text))
    for config, setting in (
        ({"schema_max_tokens": cost.tokens - 1}, "--schema-max-tokens"),
        ({"schema_max_bytes": cost.bytes - 1}, "--schema-max-bytes"),
        ({"kv_cache_memory_gib": (cost.blocks - 1) * 4 * probe.kv_bytes_per_token / 2**30}, "--kv-cache-memory"),
    ):
        engine = make(tiny_llama, **config)
        free = engine.pool.num_free_blocks
        with pytest.raises(SchemaTooLarge) as refused:
            engine.submit_schema(text, Settled())
        assert refused.value.setting == setting and setting in str(refused.value)
        assert not engine.registrations.has_work() and engine.modules.tokens_computed == 0
        assert engine.pool.num_free_blocks == free and engine.pool.num_cached_blocks == 0
    at_limit = make(tiny_llama, schema_max_tokens=cost.tokens, schema_max_bytes=cost.bytes)
    assert at_limit.modules.register(text).precompute_tokens == cost.tokens


def test_a_busy_pool_makes_a_registration_wait_while_requests_run_and_fail_when_none_can_free(tiny_llama):
    engine = make(tiny_llama, kv_cache_memory_gib=0.0002)  # ~100 blocks of 4
    free = engine.pool.num_free_blocks
    hog = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("hog", list(range(100, 100 + 4 * (free - 2))), hog)
    engine.step()  # it holds all but 2 blocks until it ends (all but 1 once it decodes)
    settled = Settled()
    engine.submit_schema(union("facts", 2), settled)
    tick(engine)  # no room for the root's 3 blocks: waits
    assert engine.registrations.has_work() and not settled.calls and engine.modules.tokens_computed == 0
    engine.check_integrity()
    while engine.has_unfinished_requests():
        tick(engine)
    ((info, failed),) = settled.calls  # the hog ended and freed its blocks: registered
    assert not failed and info.computed == 3

    # The queue's other branch: nothing runs that could free blocks (here the caller says so;
    # the engine says so when no request is running or waiting), so the registration fails, holding nothing.
    engine.add_request("hog2", list(range(100, 100 + 4 * (free - 2))), hog)
    engine.step()
    settled = Settled()
    engine.submit_schema(union("other", 2, tag="b"), settled)
    assert engine.registrations.run_slice(can_wait=False) == 0
    ((exc, failed),) = settled.calls
    assert failed and "free blocks" in str(exc) and "--kv-cache-memory" in str(exc)
    assert not engine.registrations.has_work() and "other" not in engine.modules.schemas
    engine.check_integrity()


def test_two_registrations_of_one_name_run_in_order_and_the_last_wins(tiny_llama):
    engine = make(tiny_llama)
    first, second = Settled(), Settled()
    engine.submit_schema(union("facts", 3), first)
    engine.submit_schema(union("facts", 3, tag="v2"), second)
    assert [j.schema.name for j in engine.registrations] == ["facts", "facts"]
    while engine.has_unfinished_requests():
        tick(engine)
        engine.check_integrity()
    assert not first.calls[0][1] and not second.calls[0][1]
    assert engine.modules.schemas["facts"].schema_hash == second.calls[0][0].schema_hash
    assert first.calls[0][0].schema_hash != second.calls[0][0].schema_hash


def test_fail_all_releases_what_a_registration_holds(tiny_llama):
    engine = make(tiny_llama)
    settled = Settled()
    engine.submit_schema(union("facts", 4), settled)
    tick(engine)
    assert engine.registrations.held()  # mid-module: its blocks and scratch are held
    engine.registrations.fail_all(RuntimeError("stopping"))
    ((exc, failed),) = settled.calls
    assert failed and str(exc) == "stopping"
    assert engine.pool.num_used_blocks == 0 and "facts" not in engine.modules.schemas
    assert 90 not in engine.pool.blocks_by_priority()  # what it cached is not kept at the module priority
    engine.check_integrity()


def module_priorities(engine: LLMEngine, name: str) -> list[int | None]:
    """The priority of every block of the schema's modules (``None``: not cached)."""
    cache = engine.modules
    schema = cache.schemas[name]
    return [
        None if (b := engine.pool.get_cached(h)) is None else b.priority
        for m in schema.precompute_modules
        for h in cache.module_hashes(schema, m)[0]
    ]


def test_a_delete_during_the_registration_of_the_same_version_leaves_it_serving_at_the_module_priority(tiny_llama):
    """DELETE (``ModuleCache.remove``) acts on the registered version; the same version still
    registering completes and serves (docs/pml.md), with every module block at priority 90,
    not the ones finished before the DELETE at the default 35."""
    text = union("facts", 6)
    engine = make(tiny_llama)
    engine.modules.register(text)
    engine.reset_prefix_cache()  # every module evicted: the registration below recomputes them all
    settled = Settled()
    engine.submit_schema(text, settled)
    for _ in range(8):
        tick(engine)
    (job,) = engine.registrations
    assert job.modules_done == 3
    assert engine.modules.remove("facts")  # the route's DELETE
    while engine.registrations.has_work():
        tick(engine)
        engine.check_integrity()
    ((info, failed),) = settled.calls
    assert not failed and info.computed == 7 and sorted(engine.modules.schemas) == ["facts"]
    assert module_priorities(engine, "facts") == [90] * 21


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_a_registration_waits_for_a_waiting_request_that_holds_its_modules_kv(tiny_llama):
    """Nothing runs, but a waiting PML request holds its context KV (a registration's module
    in flight kept it out): once the module is in, the request runs and frees that KV, so
    the next module, which does not fit beside it, waits for it instead of failing."""
    engine = make(tiny_llama, kv_cache_memory_gib=0.0002)
    assert engine.pool.num_free_blocks == 104
    engine.modules.register(f'<schema name="ctx"><module name="m">{words("c", 70)}</module></schema>')  # 50 blocks
    settled = Settled()
    engine.submit_schema(
        f'<schema name="new"><module name="a">{words("a", 13)}</module>'  # 29 tokens, 8 blocks
        f'<module name="b">{words("b", 84)}</module></schema>',
        settled,
    )  # 61 blocks
    tick(engine)  # a: 8 of its 29 tokens; its 8 blocks held
    prompt = engine.prepare_prompt(f'<prompt schema="ctx"><m/>{words("q", 70)}</prompt>')  # 200 tokens: 50 blocks
    engine.add_prepared_request("w", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    (seq,) = engine.requests()
    assert len(seq.context.blocks) == 50  # held while it waits
    for _ in range(3):  # 50 + 50 + a's 8 > 104: it waits; a's last chunk, then b (61 + 50 > 104) does not fit
        assert tick(engine) == [] and not engine.scheduler.running and engine.scheduler.waiting
    assert not settled.calls and engine.registrations.has_work()  # b waits for the request
    (job,) = engine.registrations
    assert job.modules_done == 1 and engine.modules.tokens_computed == 200 + 29  # ctx, then a
    engine.check_integrity()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += tick(engine)
        engine.check_integrity()
    assert [len(o.new_token_ids) for o in outputs] == [1, 1] and outputs[-1].finished
    ((info, failed),) = settled.calls
    assert not failed and info.computed == 2 and "new" in engine.modules.schemas
