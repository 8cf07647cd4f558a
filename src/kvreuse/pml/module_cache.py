"""PML module KV in the block pool: precompute, lookup, recompute after eviction, assembly.

A module's stored KV (``CompiledModule.stored_token_ids`` at its stored positions) lives in
ordinary pool blocks, chained like a prefix but keyed from a first block whose extra keys are
``("pml", model_id, schema_hash, qualified_name)``, so module blocks never match an
ordinary prompt prefix (same text, other positions) nor another schema's modules::

    register_schema(text) ── compile ──▶ for each module: ensure ──▶ release (cached, priority 90)
    prepare(prompt text)  ── compile ──▶ for each selected module: ensure (acquired)
                                          ──▶ ModuleContext(blocks, slots, positions) ──▶ Sequence

``ensure`` finds the module's chain in the pool; missing blocks (never computed, or evicted:
eviction takes chains from the tail) are loaded from the ``SchemaStore`` when one is set and
holds the schema, else recomputed in one pass at the module's schema positions attending to
itself and its scaffolds. The KV is read in place: a request's context slots point into the
module blocks, nothing is copied.

Engine thread only (it touches the pool and runs the model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.cache.block_pool import DEFAULT_PRIORITY, BlockPool, KVBlock
from kvreuse.cache.hashing import BlockHash, hash_block
from kvreuse.engine.model_runner import ModelRunner, SeqChunk
from kvreuse.pml import (
    CompiledModule,
    CompiledSchema,
    PMLSemanticError,
    compile_prompt,
    compile_schema,
    parse_prompt,
    parse_schema,
)
from kvreuse.pml.schema_store import SchemaStore, StoreMismatch

log = logging.getLogger(__name__)

MODULE_PRIORITY = 90  # retention priority of module blocks: eviction spares them unless memory requires
Progress = Callable[[int, int, str], None]  # (modules done, modules total, qualified name)


def is_pml_prompt(text: str) -> bool:
    """Whether ``text`` is PML prompt markup (starts with ``<prompt``, leading space allowed)."""
    return text.lstrip().startswith("<prompt")


class PoolBusy(ValueError):
    """The pool cannot hold a module's KV now (other requests hold the blocks); later it may."""


@dataclass(frozen=True)
class ModuleContext:
    """Assembled module KV for one request. ``blocks`` each carry one reference that the
    request owns; ``slots[i]`` holds the KV of the key at RoPE position ``positions[i]``."""

    blocks: tuple[KVBlock, ...]
    slots: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class ModulePlan:
    """Which modules a PML prompt assembles, in attention order, from which schema version;
    ``dropped`` is the index of an assembled key computed again with the new tokens (the
    highest position, when no text follows it). Enough to acquire the context again."""

    schema: CompiledSchema
    modules: tuple[str, ...]
    dropped: int | None


@dataclass(frozen=True)
class PreparedPrompt:
    """What the engine runs for a PML prompt: new tokens at explicit positions after ``context``."""

    token_ids: list[int]
    position_ids: list[int]  # ascending; the last is the highest position, so decoding follows it
    context: ModuleContext | None  # None: not acquired yet (``prepare(acquire=False)``)
    plan: ModulePlan  # to acquire the context (again, after a release under pressure)


@dataclass(frozen=True)
class SchemaInfo:
    name: str
    schema_hash: str
    length: int  # positions of the schema; prompt text starts here
    modules: tuple[str, ...]  # qualified names of the stored modules
    stored_tokens: int  # KV tokens kept for all its modules
    computed: int  # modules computed by this call
    loaded: int  # modules loaded from the schema dir by this call
    present: int  # modules already in the pool
    persisted: bool | None = None  # its file is in the schema dir; None: no schema dir

    def to_json(self) -> dict:
        return {
            "name": self.name, "schema_hash": self.schema_hash, "length": self.length,
            "modules": list(self.modules), "stored_tokens": self.stored_tokens,
            "computed": self.computed, "loaded": self.loaded, "present": self.present,
            "persisted": self.persisted,
        }


class ModuleCache:
    """Registered schemas and their module blocks in ``pool``. Not thread-safe."""

    def __init__(
        self,
        pool: BlockPool,
        runner: ModelRunner,
        tokenizer,
        *,
        model_id: str,
        hash_algorithm: str = "sha256",
        chunk_tokens: int = 8192,
        store: SchemaStore | None = None,
        src_dir: str | Path | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.pool = pool
        self.max_model_len = max_model_len  # a schema must leave room for a prompt; None: no check
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.hash_algorithm = hash_algorithm
        self.chunk_tokens = chunk_tokens
        self.store = store
        self.src_dir = src_dir  # default folder for <module src=...> (HTTP, restarts)
        self.schemas: dict[str, CompiledSchema] = {}
        self._sources: dict[str, str] = {}  # schema name -> PML text, for the store
        self._counts = {"computed": 0, "loaded": 0, "present": 0}

    # ------------------------------------------------------------------ schemas
    def register(self, pml_text: str, *, src_dir: str | Path | None = None, progress: Progress | None = None) -> SchemaInfo:
        """Parse, compile and precompute every module of a schema (replacing one of the same
        name). ``src_dir`` (default: the cache's own, ``--schema-src-dir``) is where
        ``<module src=...>`` files are read. Raises ``PMLError`` (a ``ValueError``) for bad
        markup, ``ValueError`` when the pool cannot hold a module."""
        src_dir = self.src_dir if src_dir is None else src_dir
        schema = compile_schema(parse_schema(pml_text, src_dir=src_dir), self.tokenizer, tokenizer_id=self.model_id)
        if self.max_model_len is not None and schema.length >= self.max_model_len:
            raise PMLSemanticError(
                f"schema {schema.name!r} spans {schema.length} positions but the model's context is "
                f"{self.max_model_len}: no prompt over it could run (shorten it or raise --max-model-len)"
            )
        old = self.schemas.get(schema.name)  # keeps serving until the new one is complete
        replaces = old is not None and old.schema_hash != schema.schema_hash
        self._counts = {"computed": 0, "loaded": 0, "present": 0}
        todo = schema.precompute_modules
        kv: dict[str, torch.Tensor] = {}  # for the store, read while the blocks are held
        try:
            for i, module in enumerate(todo):
                blocks = self._ensure(schema, module, promote=True)
                if self.store is not None:
                    kv[module.qualified_name] = self._read_kv(module, blocks)
                self.pool.release(reversed(blocks))
                if progress is not None:
                    progress(i + 1, len(todo), module.qualified_name)
        except BaseException:
            # The schema registered before (if any) stays in service; what this attempt
            # cached goes back to the default priority.
            if old is None or replaces:
                self._demote(schema)
            raise
        if replaces:
            self._demote(old)
        self.schemas[schema.name] = schema  # swapped in only once every module is in the pool
        self._sources[schema.name] = pml_text
        if self.store is not None and (self._counts["computed"] or not self.store.path(schema).exists()):
            try:
                self.store.save(schema, pml_text, kv)
            except OSError as exc:
                # The store is a cache: the schema serves from the pool all the same.
                log.warning("schema dir: cannot save schema %r (%s): it serves now but will not be "
                            "restored after a restart", schema.name, exc)
        return self.info(schema.name, **self._counts)

    def load_store(self) -> list[SchemaInfo]:
        """Register every schema persisted for this model (restart). A file that no longer
        matches is reported (warning) and its schema recomputed; one that does not compile is
        skipped with a warning."""
        if self.store is None:
            return []
        out = []
        for text in self.store.sources():
            try:
                out.append(self.register(text))
            except (ValueError, OSError) as exc:  # a start must never fail on the cache
                log.warning("schema dir: skipping a stored schema that cannot be restored: %s", exc)
        return out

    def remove(self, name: str) -> bool:
        """Forget schema ``name``; its blocks fall to the default priority (evicted like any
        other cached block) and its file in the store is deleted, so it stays gone after a
        restart. Requests using them keep them until they end. ``False`` if unknown."""
        schema = self.schemas.pop(name, None)
        self._sources.pop(name, None)
        if schema is None:
            return False
        self._demote(schema)
        if self.store is not None:
            self.store.delete(name)
        return True

    def info(self, name: str, computed: int = 0, loaded: int = 0, present: int = 0) -> SchemaInfo:
        """Raises ``KeyError`` for an unknown schema."""
        schema = self.schemas[name]
        mods = schema.precompute_modules
        return SchemaInfo(
            schema.name, schema.schema_hash, schema.length, tuple(m.qualified_name for m in mods),
            sum(len(m.stored_token_ids) for m in mods), computed, loaded, present,
            None if self.store is None else self.store.path(schema).exists(),
        )

    # ------------------------------------------------------------------ requests
    def prepare(self, pml_text: str, *, acquire: bool = True) -> PreparedPrompt:
        """Compile a ``<prompt schema=...>`` and (``acquire``) acquire the KV of every module
        it selects (recomputing evicted ones); the caller owns one reference per context
        block. Without ``acquire`` the context is ``None``: call ``acquire(plan)`` later.

        Raises ``PMLError`` naming line/column or the module, ``PoolBusy`` (a ``ValueError``)
        when the pool cannot hold the modules now."""
        tree = parse_prompt(pml_text)
        prompt = compile_prompt(tree, self.schemas, self.tokenizer)
        schema = self.schemas[prompt.schema_name]
        assembled = schema.assembled(prompt)
        tokens = [t for _, stored, _ in assembled for t in stored]
        positions = [p for _, _, stored in assembled for p in stored]
        new_tokens, new_positions = list(prompt.new_token_ids), list(prompt.new_position_ids)
        dropped = None
        if positions and (not new_positions or max(positions) > new_positions[-1]):
            # The highest position is assembled (no trailing text): compute that one token
            # again so its logits exist and decoding continues right after it.
            dropped = max(range(len(positions)), key=positions.__getitem__)
            new_tokens.append(tokens[dropped])
            new_positions.append(positions[dropped])
        plan = ModulePlan(schema, tuple(name for name, _, _ in assembled), dropped)
        return PreparedPrompt(new_tokens, new_positions, self.acquire(plan) if acquire else None, plan)

    def blocks_of(self, plan: ModulePlan) -> int:
        """Blocks ``plan``'s modules take in the pool (what ``acquire`` holds)."""
        bs = self.pool.block_size
        return sum(-(-len(plan.schema.module(name).stored_token_ids) // bs) for name in plan.modules)

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
                slots += [blocks[j // bs].block_id * bs + j % bs for j in range(len(module.stored_token_ids))]
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
    def module_hashes(self, schema: CompiledSchema, module: CompiledModule) -> tuple[list[BlockHash], list[tuple[int, ...]]]:
        """Keys and token lists of the module's blocks (the last may be partial)."""
        tokens = module.stored_token_ids
        bs = self.pool.block_size
        extra: tuple = ("pml", self.model_id, schema.schema_hash, module.qualified_name)
        hashes: list[BlockHash] = []
        pieces = [tokens[i : i + bs] for i in range(0, len(tokens), bs)]
        parent = None
        for piece in pieces:
            parent = hash_block(parent, piece, extra, self.hash_algorithm)
            hashes.append(parent)
            extra = ()
        return hashes, pieces

    def _ensure(self, schema: CompiledSchema, module: CompiledModule, promote: bool = False) -> list[KVBlock]:
        """The module's blocks, each acquired once by the caller; missing ones are loaded or
        computed. ``promote`` (registration) lifts blocks already cached back to the module
        priority (a schema deleted and registered again). Raises ``ValueError`` if the pool
        cannot hold them now."""
        hashes, pieces = self.module_hashes(schema, module)
        hits = self.pool.match_prefix(hashes, pieces)
        self.pool.acquire(hits)
        if promote:
            for block in hits:
                self.pool.set_retention(block, MODULE_PRIORITY, None)
        if len(hits) == len(hashes):
            self._counts["present"] += 1
            return hits
        try:
            new = self._fill(schema, module, len(hits))
        except BaseException:
            self.pool.release(reversed(hits))
            raise
        blocks = hits + new
        for b in range(len(hits), len(blocks)):
            kept = self.pool.register(
                blocks[b], hashes[b], hashes[b - 1] if b else None, pieces[b], depth=b, priority=MODULE_PRIORITY
            )
            if kept is not blocks[b]:  # cannot happen with leaves-only eviction; stay correct anyway
                self.pool.acquire([kept])
                self.pool.release([blocks[b]])
                blocks[b] = kept
        return blocks

    def _allocate(self, n: int, what: str) -> list[KVBlock]:
        if not self.pool.can_allocate(n):
            raise PoolBusy(
                f"the KV pool has {self.pool.num_free_blocks} free blocks but {what} needs {n}: "
                "retry later or raise --kv-cache-memory"
            )
        return self.pool.allocate(n)

    def _fill(self, schema: CompiledSchema, module: CompiledModule, num_hits: int) -> list[KVBlock]:
        """Blocks ``num_hits..`` of the module, allocated and filled (from the store or by a forward pass)."""
        bs = self.pool.block_size
        num_stored = len(module.stored_token_ids)
        new = self._allocate(-(-num_stored // bs) - num_hits, f"module {module.qualified_name!r}")
        try:
            if self.store is not None and self._load(schema, module, num_hits, new):
                self._counts["loaded"] += 1
            else:
                self._compute(schema, module, num_hits, new)
                self._counts["computed"] += 1
        except BaseException:
            self.pool.release(reversed(new))
            raise
        return new

    def _load(self, schema: CompiledSchema, module: CompiledModule, num_hits: int, new: list[KVBlock]) -> bool:
        try:
            kv = self.store.load_module(schema, module.qualified_name)  # type: ignore[union-attr]
        except StoreMismatch as exc:
            log.warning("schema dir: %s; recomputing", exc)
            return False
        if kv is None:
            return False
        bs = self.pool.block_size
        lo = num_hits * bs
        slots = [new[(j - lo) // bs].block_id * bs + (j - lo) % bs for j in range(lo, len(module.stored_token_ids))]
        cache = self.runner.kv_cache  # [layers, 2, kv_heads, slots, head_dim]
        index = torch.tensor(slots, dtype=torch.long, device=cache.device)
        # files hold [layers, 2, tokens, kv_heads, head_dim]
        cache[:, :, :, index] = kv[:, :, lo:].transpose(2, 3).to(cache.device, cache.dtype)
        return True

    def _compute(self, schema: CompiledSchema, module: CompiledModule, num_hits: int, new: list[KVBlock]) -> None:
        """One causal pass over ``precompute_input`` (chunked); stored tokens from block
        ``num_hits`` on land in ``new``, everything else (scaffolds, slots, the part already
        cached) in scratch blocks released at the end."""
        bs = self.pool.block_size
        run = schema.precompute_input(module.qualified_name)
        lo = num_hits * bs  # stored tokens below this are already in the pool
        targets: list[int | None] = []
        j = 0
        for keep in run.store:
            targets.append(new[(j - lo) // bs].block_id * bs + (j - lo) % bs if keep and j >= lo else None)
            j += keep
        num_scratch = sum(t is None for t in targets)
        scratch = self._allocate(-(-num_scratch // bs), f"precomputing module {module.qualified_name!r}")
        try:
            free = (b.block_id * bs + k for b in scratch for k in range(bs))
            slots = [t if t is not None else next(free) for t in targets]
            ids, pos = list(run.token_ids), list(run.position_ids)
            for start in range(0, len(ids), self.chunk_tokens):
                end = start + self.chunk_tokens
                self.runner.execute([SeqChunk.from_slots(ids[start:end], pos[start:end], slots[start:end],
                                                         slots[:start], pos[:start], sample=False)])
        finally:
            self.pool.release(reversed(scratch))

    def _read_kv(self, module: CompiledModule, blocks: list[KVBlock]) -> torch.Tensor:
        """The module's stored KV ``[layers, 2, tokens, kv_heads, head_dim]`` (CPU copy)."""
        bs = self.pool.block_size
        slots = [blocks[j // bs].block_id * bs + j % bs for j in range(len(module.stored_token_ids))]
        cache = self.runner.kv_cache  # [layers, 2, kv_heads, slots, head_dim]
        index = torch.tensor(slots, dtype=torch.long, device=cache.device)
        return cache[:, :, :, index].transpose(2, 3).contiguous().cpu()

    def _demote(self, schema: CompiledSchema) -> None:
        """Drop a schema's cached module blocks to the default priority."""
        for module in schema.precompute_modules:
            for h in self.module_hashes(schema, module)[0]:
                block = self.pool.get_cached(h)
                if block is not None:
                    self.pool.set_retention(block, DEFAULT_PRIORITY, None)
