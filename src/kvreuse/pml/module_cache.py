"""PML module KV in the block pool: precompute, lookup, recompute after eviction, assembly.

A module's stored KV (``CompiledModule.stored_token_ids`` at its stored positions) lives in
ordinary pool blocks, chained like a prefix but keyed from a first block whose extra keys are
``("pml", model_id, schema_hash, qualified_name)``, so module blocks never match an
ordinary prompt prefix (same text, other positions) nor another schema's modules::

    register(schema text) ── compile ──▶ for each module: ensure ──▶ release (cached, priority 90)
    prepared.plan (prepare_prompt, at the edge) ──▶ source(plan).acquire(): each module ensured
                                          ──▶ ModuleContext(blocks, slots, positions) ──▶ PromptContext

``ensure`` finds the module's chain in the pool; missing blocks (never computed, or evicted:
eviction takes chains from the tail) are loaded from the ``SchemaStore`` when one is set and
holds the schema, else recomputed at the module's schema positions attending to itself and
its scaffolds (``ModuleFill``, pml/module_fill.py). The KV is read in place: a request's
context slots point into the module blocks, nothing is copied.

``register`` does a whole schema at once (``LLM.register_schema``, the CLI, the schema dir at
start); a serving engine registers in slices between its steps instead: ``compile`` (any
thread; cost limits, pml/schema_cost.py) then ``start`` (a ``Registration``,
pml/registration.py, that the engine advances a budget of tokens per step).

What is here is keys, blocks and the store. The KV itself is the ``KVAccess``'s (the model
runner, passed in by the engine): it runs the precompute forward and copies KV between the
store's tensors and the slots named here; this module never looks inside them.

Engine thread only (it touches the pool and, through ``KVAccess``, runs the model).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kvreuse.cache.block_pool import DEFAULT_PRIORITY, KVBlock
from kvreuse.cache.hashing import BlockHash, extend_chain
from kvreuse.cache.kv_block import block_slots, cdiv
from kvreuse.cache.kv_cache_manager import KVCacheManager
from kvreuse.pml import (
    CompiledModule,
    CompiledSchema,
    PMLSemanticError,
    compile_prompt,
    compile_schema,
    parse_prompt,
    parse_schema,
)
from kvreuse.pml.kv_access import KVAccess, ModuleKV  # KVAccess re-exported
from kvreuse.pml.module_fill import MODULE_PRIORITY, FillSource, ModuleFill, PoolBusy  # noqa: F401 - re-exported
from kvreuse.pml.module_source import ModuleSource  # re-exported (was defined here)
from kvreuse.pml.prepared import (
    ModuleContext,
    ModulePlan,
    PreparedPrompt,
    is_pml_prompt,  # noqa: F401 - re-exported (server routes)
    prepare_prompt,
)
from kvreuse.pml.registration import Progress, Registration, Settle
from kvreuse.pml.schema_cost import SchemaCost, SchemaLimits, check_cost
from kvreuse.pml.schema_info import SchemaInfo  # re-exported (llm, engine)
from kvreuse.pml.schema_store import SchemaStore

log = logging.getLogger(__name__)


def _no_step() -> None:
    return None  # no engine loop (the synchronous LLM): a pass runs whole


class ModuleCache:
    """Registered schemas and their module blocks in ``kv``'s pool, which they enter through
    its admission path. Engine thread only, except ``compile`` (any thread)."""

    def __init__(
        self,
        kv: KVCacheManager,
        runner: KVAccess,
        tokenizer,
        *,
        model_id: str,
        hash_algorithm: str = "sha256",
        chunk_tokens: int = 8192,
        store: SchemaStore | None = None,
        src_dir: str | Path | None = None,
        max_model_len: int | None = None,
        limits: SchemaLimits = SchemaLimits(),
        kv_bytes_per_token: int = 0,
    ) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.max_model_len = max_model_len  # a schema must leave room for a prompt; None: no check
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.hash_algorithm = hash_algorithm
        self.chunk_tokens = chunk_tokens  # the grid module precompute passes run on (module_fill.py)
        self.between_chunks: Callable[[], None] = _no_step  # the engine's pacer: decodes step between chunks
        self.store = store
        self.src_dir = src_dir  # default folder for <module src=...> (HTTP, restarts)
        self.limits = limits
        self.kv_bytes_per_token = kv_bytes_per_token  # for the cost in bytes (0: unknown, counted as 0)
        self.schemas: dict[str, CompiledSchema] = {}
        self._sources: dict[str, str] = {}  # schema name -> PML text, for the store
        self._costs: dict[str, SchemaCost] = {}  # schema name -> cost of the version registered (info)
        self.tokens_computed = 0  # module precompute tokens run (registrations and recomputes)
        self.modules_filled: Counter[str] = Counter()  # modules put into the pool, by FillSource value

    # ------------------------------------------------------------------ schemas
    def compile(self, pml_text: str, *, src_dir: str | Path | None = None) -> CompiledSchema:
        """Parse and compile a schema and check what registering it costs, before anything is
        computed. Reads only fixed settings (tokenizer, limits, pool size): safe on any thread
        (the server runs it off the engine thread). ``src_dir`` (default: the cache's own,
        ``--schema-src-dir``) is where ``<module src=...>`` files are read. Raises
        ``PMLError`` (a ``ValueError``) for bad markup, a schema as long as the context, or
        one over a limit (``SchemaTooLarge``, naming the setting)."""
        src_dir = self.src_dir if src_dir is None else src_dir
        schema = compile_schema(parse_schema(pml_text, src_dir=src_dir), self.tokenizer, tokenizer_id=self.model_id)
        if self.max_model_len is not None and schema.length >= self.max_model_len:
            raise PMLSemanticError(
                f"schema {schema.name!r} spans {schema.length} positions but the model's context is "
                f"{self.max_model_len}: no prompt over it could run (shorten it or raise --max-model-len)"
            )
        check_cost(schema, self.cost(schema), self.limits, self.pool.num_blocks)
        return schema

    def cost(self, schema: CompiledSchema) -> SchemaCost:
        return SchemaCost.of(schema, self.pool.block_size, self.kv_bytes_per_token)

    def start(
        self, schema: CompiledSchema, pml_text: str, *, progress: Progress | None = None, settle: Settle | None = None
    ) -> Registration:
        """A registration of ``schema`` (from ``compile``; ``pml_text`` is kept for the
        store), nothing computed yet: ``advance`` it, or hand it to the engine's queue.
        ``settle(info, False)`` / ``settle(exc, True)`` is called when it ends."""
        return Registration(self, schema, pml_text, progress=progress, settle=settle)

    def register(
        self, pml_text: str, *, src_dir: str | Path | None = None, progress: Progress | None = None
    ) -> SchemaInfo:
        """Compile and precompute every module of a schema now (replacing one of the same
        name), in one call. Raises ``PMLError`` (a ``ValueError``) for bad markup or a
        schema over a limit, ``PoolBusy`` (a ``ValueError``) when the pool cannot hold a module."""
        job = self.start(self.compile(pml_text, src_dir=src_dir), pml_text, progress=progress)
        try:
            job.advance(None)
        except BaseException as exc:
            job.fail(exc)  # the schema registered before (if any) stays in service
            raise
        assert job.info is not None
        return job.info

    def install(self, schema: CompiledSchema, pml_text: str, kv: dict[str, ModuleKV], *, save: bool) -> None:
        """Put ``schema`` in service (every module is in the pool): it replaces the version of
        the same name, whose blocks drop to the default priority. With a store, ``kv`` (each
        module's host KV) is written when ``save`` or when no file holds this version yet."""
        old = self.schemas.get(schema.name)
        if old is not None and old.schema_hash != schema.schema_hash:
            self.demote(old)
        # Every module it put in the pool is at the module priority now, even one a DELETE of
        # this same version dropped to the default while the rest were still being computed.
        self._set_priority(schema, MODULE_PRIORITY, only_changed=True)
        self.schemas[schema.name] = schema
        self._sources[schema.name] = pml_text
        self._costs.pop(schema.name, None)
        if self.store is not None and (save or not self.store.path(schema).exists()):
            try:
                self.store.save(schema, pml_text, kv)
            except OSError as exc:
                # The store is a cache: the schema serves from the pool all the same.
                log.warning(
                    "schema dir: cannot save schema %r (%s): it serves now but will not be restored after a restart",
                    schema.name,
                    exc,
                )

    def load_store(self) -> list[SchemaInfo]:
        """Register every schema persisted for this model (restart); never raises. A file
        that no longer matches is refused (one warning, counted in ``store.refused``) and its
        schema recomputed; one that does not compile is skipped with a warning."""
        if self.store is None:
            return []
        out = []
        for text in self.store.sources():
            try:
                info = self.register(text)
            except Exception as exc:  # noqa: BLE001 - a start must never fail on the cache
                log.warning("schema dir: skipping a stored schema that cannot be restored: %s", exc)
                continue
            log.info(
                "schema dir: restored schema %r (%d modules: %d loaded, %d computed)",
                info.name,
                len(info.modules),
                info.loaded,
                info.computed,
            )
            out.append(info)
        return out

    def remove(self, name: str) -> bool:
        """Forget schema ``name``; its blocks fall to the default priority (evicted like any
        other cached block) and its file in the store is deleted, so it stays gone after a
        restart. Requests using them keep them until they end. ``False`` if unknown."""
        schema = self.schemas.pop(name, None)
        self._sources.pop(name, None)
        self._costs.pop(name, None)
        if schema is None:
            return False
        self.demote(schema)
        if self.store is not None:
            self.store.delete(name)
        return True

    def info(self, name: str, computed: int = 0, loaded: int = 0, present: int = 0) -> SchemaInfo:
        """Raises ``KeyError`` for an unknown schema."""
        schema = self.schemas[name]
        mods = schema.precompute_modules
        cost = self._costs.get(name)
        if cost is None:
            cost = self._costs[name] = self.cost(schema)
        return SchemaInfo(
            schema.name,
            schema.schema_hash,
            schema.length,
            tuple(m.qualified_name for m in mods),
            sum(len(m.stored_token_ids) for m in mods),
            cost.tokens,
            cost.bytes,
            computed,
            loaded,
            present,
            None if self.store is None else self.store.path(schema).exists(),
        )

    # ------------------------------------------------------------------ requests
    def prepare(self, pml_text: str, *, acquire: bool = True) -> PreparedPrompt:
        """``prepare_prompt`` over the registered schemas and (``acquire``) the KV of every
        module it selects (recomputing evicted ones); the caller owns one reference per
        context block. Without ``acquire`` the context is ``None``.

        Raises ``PMLError`` naming line/column or the module, ``PoolBusy`` (a ``ValueError``)
        when the pool cannot hold the modules now."""
        prepared = prepare_prompt(pml_text, self.schemas, self.tokenizer)
        if not acquire:
            return prepared
        return PreparedPrompt(
            prepared.token_ids,
            prepared.position_ids,
            self.acquire(prepared.plan),
            prepared.plan,
            prepared.next_position,
        )

    def source(self, plan: ModulePlan) -> ModuleSource:
        """``plan`` bound to this cache: the ``engine.context.ContextSource`` of a request's context."""
        return ModuleSource(self, plan)

    def release(self, context: ModuleContext) -> None:
        """Drop the references ``acquire`` gave (tail first; the blocks stay cached)."""
        self.pool.release(reversed(context.blocks))

    def blocks_of(self, plan: ModulePlan) -> int:
        """Blocks ``plan``'s modules take in the pool (what ``acquire`` holds once it returns)."""
        bs = self.pool.block_size
        return sum(cdiv(len(plan.schema.module(name).stored_token_ids), bs) for name in plan.modules)

    def peak_blocks_of(self, plan: ModulePlan) -> int:
        """The blocks ``acquire`` needs at once for ``plan``, whatever the pool holds now: while
        it fills a module it holds the modules before it, that module's blocks and, when the
        module must be computed, the scratch of the text its pass attends to but does not keep
        (``ModuleFill``; one that finds more room may hold more, the scratch for a part of the
        chain still cached). The capacity check's peak for a PML request."""
        bs = self.pool.block_size
        held = peak = 0
        for name in plan.modules:
            module = plan.schema.module(name)
            blocks = cdiv(len(module.stored_token_ids), bs)
            run = plan.schema.precompute_input(name)
            scratch = cdiv(len(run.token_ids) - sum(run.store), bs)  # ModuleFill._lay_out with no block cached
            peak = max(peak, held + blocks + scratch)
            held += blocks
        return peak

    def acquire(self, plan: ModulePlan) -> ModuleContext:
        """The KV of ``plan``'s modules, one reference per block for the caller; evicted
        blocks are loaded or recomputed (the plan keeps its schema version even if the
        schema was replaced or deleted since). Raises ``ValueError`` when the pool cannot
        hold them now (nothing is held then)."""
        schema, bs = plan.schema, self.pool.block_size
        held: list[KVBlock] = []
        slots: list[int] = []
        positions: list[int] = []
        try:
            for name in plan.modules:
                module = schema.module(name)
                blocks = self._ensure(schema, module)
                held += blocks
                slots += block_slots([b.block_id for b in blocks], 0, len(module.stored_token_ids), bs)
                positions += module.stored_position_ids
        except BaseException:
            self.pool.release(reversed(held))
            raise
        if plan.dropped is not None:  # that key is computed with the new tokens instead
            del slots[plan.dropped], positions[plan.dropped]
        return ModuleContext(tuple(held), tuple(slots), tuple(positions))

    def prompt_end(self, pml_text: str) -> int:
        """Where decoding of this prompt would start (its context length). Raises ``PMLError``."""
        return compile_prompt(parse_prompt(pml_text), self.schemas, self.tokenizer).next_position

    # ------------------------------------------------------------------ blocks
    def module_hashes(
        self, schema: CompiledSchema, module: CompiledModule
    ) -> tuple[list[BlockHash], list[tuple[int, ...]]]:
        """Keys and token lists of the module's blocks (the last may be partial)."""
        tokens = module.stored_token_ids
        bs = self.pool.block_size
        extra: tuple = ("pml", self.model_id, schema.schema_hash, module.qualified_name)
        hashes = extend_chain([], tokens, bs, root_extra=extra, algorithm=self.hash_algorithm, partial_tail=True)
        return hashes, [tokens[i : i + bs] for i in range(0, len(tokens), bs)]

    def _ensure(self, schema: CompiledSchema, module: CompiledModule) -> list[KVBlock]:
        """The module's blocks, each acquired once by the caller; missing ones are loaded or
        computed now, in one go. Raises ``PoolBusy`` (a ``ValueError``) if the pool cannot
        hold them now; nothing is held then."""
        fill = ModuleFill.begin(self, schema, module)
        try:
            ran = fill.run()
            self.record_fill(ran)
            blocks = fill.finish()
        except BaseException:
            fill.abandon()
            raise
        self.record_fill(0, fill.source)
        return blocks

    def record_fill(self, tokens: int, filled: FillSource | None = None) -> None:
        """Count ``tokens`` of module precompute run and, once a module is in the pool,
        where it came from (``filled``). Its fills and registrations report here."""
        self.tokens_computed += tokens
        if filled is not None:
            self.modules_filled[filled.value] += 1

    def read_kv(self, module: CompiledModule, blocks: list[KVBlock]) -> ModuleKV:
        """The module's stored KV, for the store (a host copy, through the runner)."""
        slots = block_slots([b.block_id for b in blocks], 0, len(module.stored_token_ids), self.pool.block_size)
        return self.runner.read_kv(slots)

    def demote(self, schema: CompiledSchema) -> None:
        """Drop a schema's cached module blocks to the default priority."""
        self._set_priority(schema, DEFAULT_PRIORITY)

    def _set_priority(self, schema: CompiledSchema, priority: int, *, only_changed: bool = False) -> None:
        """Every cached block of the schema's modules at ``priority`` (no duration);
        ``only_changed``: blocks already there are not touched (their place in the eviction
        order stays)."""
        for module in schema.precompute_modules:
            for h in self.module_hashes(schema, module)[0]:
                block = self.pool.get_cached(h)
                if block is not None and not (only_changed and block.priority == priority):
                    self.pool.set_retention(block, priority, None)
