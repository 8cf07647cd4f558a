"""The seams of the module wing: a PML prompt compiled once at the edge (``prepare_prompt``),
the module cache driving KV only through ``KVAccess`` (the runner's precompute / write_kv /
read_kv), and the ``PromptContext`` handle a sequence keeps for its module KV."""

from __future__ import annotations

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.kv_block import KVBlock
from kvreuse.cache.kv_cache_manager import KVCacheManager
from kvreuse.engine.context import ContextState, PromptContext
from kvreuse.pml.module_cache import ModuleCache
from kvreuse.pml.prepared import ModuleContext
from tests.pml.pml_helpers import CharTokenizer

GREEDY = SamplingParams(max_tokens=5, temperature=0)
SCHEMA = '<schema name="s">Hi. <module name="m">abcdefghij</module></schema>'


# ---------------------------------------------------------------------- the handle
class FakeSource:
    """A context source whose pool may be busy; records what it hands out and gets back."""

    def __init__(self, held: ModuleContext) -> None:
        self.held, self.busy, self.log = held, False, []

    @property
    def num_blocks(self) -> int:
        return 7  # what the plan would take; only asked while nothing is held

    @property
    def num_tokens(self) -> int:
        return len(self.held.slots)

    def acquire(self):
        self.log.append("acquire")
        return None if self.busy else self.held

    def release(self, held) -> None:
        self.log.append(("release", held.slots))


def test_prompt_context_moves_between_held_and_released():
    held = ModuleContext((KVBlock(3), KVBlock(5), KVBlock(3)), (12, 13, 20), (0, 1, 2))
    source = FakeSource(held)
    source.busy = True
    ctx = PromptContext(source)
    assert not ctx.acquire()  # the pool is busy: still released, nothing held
    assert ctx.state is ContextState.RELEASED and not ctx.admissible
    assert (ctx.slots, ctx.positions, ctx.blocks) == ((), (), ())
    assert ctx.num_tokens == 3 and ctx.num_blocks == 7  # the plan's, not what is held
    source.busy = False
    assert ctx.acquire() and ctx.state is ContextState.HELD and ctx.admissible
    assert ctx.acquire()  # held already: nothing asked
    assert (ctx.slots, ctx.positions) == ((12, 13, 20), (0, 1, 2))
    assert ctx.num_blocks == 2  # distinct blocks held
    ctx.release()
    ctx.release()  # released already: nothing handed back twice
    assert ctx.state is ContextState.RELEASED and ctx.num_tokens == 3
    assert source.log == ["acquire", "acquire", ("release", (12, 13, 20))]


# ---------------------------------------------------------------------- module cache <-> runner
class FakeKV:
    """A ``KVAccess`` with no model: records calls; read_kv returns a token naming its slots."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def precompute_chunk(self, token_ids, positions, slots, start, end) -> None:
        self.calls.append(
            ("precompute", list(token_ids[start:end]), list(positions[start:end]), list(slots[start:end]), start)
        )

    def write_kv(self, slots, kv, first_token=0) -> None:
        self.calls.append(("write_kv", list(slots), kv, first_token))

    def read_kv(self, slots):
        self.calls.append(("read_kv", list(slots)))
        return f"kv@{slots[0]}"


class FakeStore:
    """A schema store holding opaque KV values (the module cache never looks inside)."""

    class _Path:
        def __init__(self, store) -> None:
            self.store = store

        def exists(self) -> bool:
            return bool(self.store.saved)

    def __init__(self) -> None:
        self.saved: dict[str, object] = {}

    def path(self, schema):
        return self._Path(self)

    def save(self, schema, source, kv) -> None:
        self.saved = dict(kv)

    def load_module(self, schema, qualified_name):
        return self.saved.get(qualified_name)

    def sources(self) -> list[str]:
        return []


def test_module_cache_drives_kv_only_through_kv_access():
    """Block size 4, a fresh pool of 8: the root ("Hi.", positions 0-2) lands in block 0;
    module m (" abcdefghij", 3-13) in blocks 1-3 and is computed attending to the root text,
    whose scratch copy goes to block 4; its pass runs in chunks of 6 on a fixed grid, each
    after the keys of the ones before. The KV crosses as opaque values, by slot."""
    kv, store = FakeKV(), FakeStore()
    pool = BlockPool(8, 4)
    cache = ModuleCache(KVCacheManager(pool), kv, CharTokenizer(), model_id="m", chunk_tokens=6, store=store)
    info = cache.register(SCHEMA)
    assert (info.computed, info.loaded, info.present) == (2, 0, 0)
    m_tokens = [ord(c) for c in " abcdefghij"]
    assert kv.calls == [
        ("precompute", [72, 105, 46], [0, 1, 2], [0, 1, 2], 0),
        ("read_kv", [0, 1, 2]),
        ("precompute", [72, 105, 46, *m_tokens[:3]], list(range(6)), [16, 17, 18, 4, 5, 6], 0),
        ("precompute", m_tokens[3:9], list(range(6, 12)), list(range(7, 13)), 6),
        ("precompute", m_tokens[9:], [12, 13], [13, 14], 12),
        ("read_kv", list(range(4, 15))),
    ]
    assert store.saved == {"": "kv@0", "m": "kv@4"}
    assert pool.num_used_blocks == 0  # registration holds nothing

    # Both modules leave the pool; acquiring loads them from the store into fresh blocks:
    # never-used blocks 5-7 first, then block 4 (evicted blocks queue behind them).
    pool.evict_all_cached()
    kv.calls.clear()
    prepared = cache.prepare('<prompt schema="s"><m/>xy</prompt>')
    assert (prepared.token_ids, prepared.position_ids, prepared.next_position) == ([120, 121], [14, 15], 16)
    ctx = prepared.context
    m_slots = [*range(24, 32), 16, 17, 18]
    assert kv.calls == [("write_kv", [20, 21, 22], "kv@0", 0), ("write_kv", m_slots, "kv@4", 0)]
    assert ctx.slots == (20, 21, 22, *m_slots) and ctx.positions == tuple(range(14))
    assert [b.block_id for b in ctx.blocks] == [5, 6, 7, 4] and pool.num_used_blocks == 4
    cache.release(ctx)
    pool.check_integrity()
    assert pool.num_used_blocks == 0


# ---------------------------------------------------------------------- the runner's KV methods
def test_runner_writes_reads_and_precomputes_kv(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    runner = llm.engine.runner
    layers, _, heads, _, dim = runner.kv_cache.shape
    kv = torch.arange(layers * 2 * 5 * heads * dim, dtype=torch.float32).reshape(layers, 2, 5, heads, dim)
    runner.write_kv([9, 3, 40], kv, first_token=2)  # tokens 2, 3, 4 of the store's layout
    assert torch.equal(runner.read_kv([9, 3, 40]), kv[:, :, 2:])
    assert torch.equal(runner.kv_cache[:, :, :, 3], kv[:, :, 3])  # [layers, 2, heads, dim]

    ids, pos = list(range(30, 41)), list(range(5, 16))
    runner.precompute(ids, pos, list(range(100, 111)), chunk_tokens=64)  # one pass
    runner.precompute(ids, pos, list(range(200, 211)), chunk_tokens=4)  # three chunks
    for start in (0, 4, 8):  # the same chunks one call each (a schema registered a slice per step)
        runner.precompute_chunk(ids, pos, list(range(300, 311)), start, start + 4)
    one, chunked = runner.read_kv(range(100, 111)), runner.read_kv(range(200, 211))
    assert one.shape == (layers, 2, 11, heads, dim)
    assert torch.allclose(one, chunked, atol=1e-5)
    assert torch.equal(runner.read_kv(range(300, 311)), chunked)  # bit for bit


# ---------------------------------------------------------------------- the engine's side
def _llm(tiny_llama) -> LLM:
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    llm.register_schema(SCHEMA)
    return llm


def test_generate_compiles_a_pml_prompt_once(tiny_llama, monkeypatch):
    import kvreuse.pml.prepared as prepared_mod

    llm = _llm(tiny_llama)
    calls = []
    real = prepared_mod.compile_prompt
    monkeypatch.setattr(prepared_mod, "compile_prompt", lambda *a: calls.append(a[0]) or real(*a))
    out = llm.generate('<prompt schema="s"><m/>xy</prompt>', GREEDY)[0]
    assert len(calls) == 1
    modules = llm.engine.modules.schemas["s"].precompute_modules
    assembled = sum(len(m.stored_token_ids) for m in modules)
    new = len(llm.tokenizer.encode("xy", add_special_tokens=False))
    assert (out.num_prompt_tokens, out.num_cached_tokens) == (assembled + new, assembled)
    llm.engine.check_integrity()


def test_a_rejected_prepared_request_lets_its_context_go(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    prepared = engine.prepare_prompt('<prompt schema="s"><m/>xy</prompt>')
    assert prepared.context is None
    try:
        engine.add_prepared_request("r", prepared, SamplingParams(max_tokens=10**6))
    except ValueError:
        pass
    else:
        raise AssertionError("a request over the context must be refused")
    assert engine.pool.num_used_blocks == 0
    engine.check_integrity()


def test_a_prepared_request_holds_its_modules_until_it_ends(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    prepared = engine.prepare_prompt('<prompt schema="s"><m/>xy</prompt>')
    engine.add_prepared_request("a", prepared, GREEDY)
    engine.add_prepared_request("b", prepared, GREEDY)  # one compile serves several requests
    seq_a, seq_b = engine._requests["a"].context, engine._requests["b"].context
    assert seq_a.state is seq_b.state is ContextState.HELD
    assert seq_a.slots == seq_b.slots and seq_a.blocks == seq_b.blocks
    assert [b.ref_count for b in seq_a.blocks] == [2] * len(seq_a.blocks)  # one reference per request
    engine.check_integrity()
    engine.abort_request("a")
    assert seq_a.state is ContextState.RELEASED and seq_a.blocks == ()
    assert [b.ref_count for b in seq_b.blocks] == [1] * len(seq_b.blocks)
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert seq_b.state is ContextState.RELEASED and engine.pool.num_used_blocks == 0


def test_a_prompt_prepared_before_its_schema_is_removed_still_runs(tiny_llama):
    """The plan keeps the schema version it was compiled against (docs/pml.md)."""
    llm = _llm(tiny_llama)
    text = '<prompt schema="s"><m/>xy</prompt>'
    expected = llm.generate(text, GREEDY)[0].token_ids
    prepared = llm.engine.prepare_prompt(text)
    assert llm.remove_schema("s")
    llm.engine.add_prepared_request("late", prepared, GREEDY)
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.engine.step()})
        llm.engine.check_integrity()
    assert outs["late"].token_ids == expected
