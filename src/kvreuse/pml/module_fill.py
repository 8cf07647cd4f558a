"""One module's KV being put into the pool: found there, loaded from the store, or precomputed
chunk by chunk.

::

    ModuleFill.begin(host, schema, module) ── admission: cached blocks held, fresh ones for the rest
        │ all cached ─▶ PRESENT      │ the store holds it ─▶ LOADED (runner.write_kv)
        │ else ─▶ COMPUTED: scratch blocks for the context tokens, the precompute pass laid out
    run(max_tokens) ── the next chunks of that pass (a fixed grid of ``host.chunk_tokens``); returns the tokens run
    finish() ── blocks registered (priority 90), scratch released ─▶ the module's blocks, held by the caller
    abandon() ── everything the fill holds released (a failed or dropped registration)

The chunks lie on a fixed grid (token ``k * chunk_tokens`` starts one), so a pass run in one
go (a request recomputing an evicted module, ``LLM.register_schema``) and one run a chunk per
engine step (a schema registered on a serving engine) give the same KV, bit for bit. Between
``run`` calls other steps may run: the fill's blocks are held and not yet registered, so
nothing else reads, matches or evicts them.

A fill reads its host (the ``ModuleCache``, through the ``FillHost`` protocol) and never
writes it: it returns what it ran, and its caller counts it (``ModuleCache.record_fill``).

Engine thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvreuse.cache.block_pool import KVBlock
from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.kv_block import block_slots, cdiv
from kvreuse.pml import CompiledModule, CompiledSchema
from kvreuse.pml.schema_store import StoreMismatch

if TYPE_CHECKING:
    from kvreuse.cache.block_pool import BlockPool
    from kvreuse.cache.kv_cache_manager import KVCacheManager
    from kvreuse.pml.compiled import PrecomputeInput
    from kvreuse.pml.kv_access import KVAccess
    from kvreuse.pml.schema_store import SchemaStore


MODULE_PRIORITY = 90  # retention priority of module blocks: eviction spares them unless memory requires


class PoolBusy(ValueError):
    """The pool cannot hold a module's KV now (other requests hold the blocks); later it may."""


class FillSource(enum.Enum):
    PRESENT = "present"  # every block was cached
    LOADED = "loaded"  # the missing blocks came from the schema store
    COMPUTED = "computed"  # the missing blocks were precomputed


def _module_retention(index: int) -> tuple[int, None]:
    return (MODULE_PRIORITY, None)  # registration lifts every cached block of the module back


def _keep_retention(index: int) -> None:
    return None  # a request reading a module asks nothing: its blocks keep their priority (and no duration)


class FillHost(Protocol):
    """What a fill reads from the module cache that starts it (``ModuleCache`` has these)."""

    kv: KVCacheManager  # admission, allocation and registration of the module's blocks
    pool: BlockPool  # kv's pool
    store: SchemaStore | None
    runner: KVAccess
    chunk_tokens: int  # the grid precompute passes run on
    between_chunks: Callable[[], None]  # run between two chunks of a whole pass (decodes step: prefill_pacer)

    def module_hashes(
        self, schema: CompiledSchema, module: CompiledModule
    ) -> tuple[list[BlockHash], list[tuple[int, ...]]]:
        """Keys and token lists of the module's blocks (the last may be partial)."""
        ...


class ModuleFill:
    """The blocks of one module, held from ``begin`` to ``finish`` or ``abandon``."""

    def __init__(
        self,
        cache: FillHost,
        schema: CompiledSchema,
        module: CompiledModule,
        hashes: list[BlockHash],
        pieces: list[tuple[int, ...]],
        blocks: list[KVBlock],
        num_hits: int,
    ) -> None:
        self.cache = cache
        self.schema = schema
        self.module = module
        self._hashes = hashes
        self._pieces = pieces
        self.blocks = blocks  # held: the module's blocks in token order (hits first)
        self._num_hits = num_hits
        self.scratch: list[KVBlock] = []  # held while computing: context tokens whose KV is not kept
        self.source = FillSource.PRESENT
        self.loaded_tokens = 0  # stored tokens written from the store
        self._run: PrecomputeInput | None = None
        self._slots: list[int] = []  # [len(run.token_ids)] where each token of the pass writes its KV
        self._next = 0  # tokens of the pass done so far

    @classmethod
    def begin(
        cls,
        cache: FillHost,
        schema: CompiledSchema,
        module: CompiledModule,
        *,
        promote: bool = False,
        use_cached: bool = True,
    ) -> ModuleFill:
        """Hold the module's blocks and fill what the pool or the store can; what is left to
        compute is ``tokens_left``. ``promote`` (registration) lifts blocks already cached
        back to the module priority. ``use_cached=False``: take no cached block of the chain
        (all fresh). Raises ``PoolBusy`` (a ``ValueError``) when the pool cannot hold them
        now; nothing is held then.

        A chain cached in part (eviction takes its tail) is recomputed whole all the same, its
        cached part into scratch beside the cached blocks; when that does not fit, the cached
        part is let go and the whole chain computed into fresh blocks (the same pass, so the
        same KV), which needs only the module's blocks and the scratch of the text it attends
        to (``ModuleCache.peak_blocks_of``): a pool that cannot hold both copies of the
        cached part must not keep a request waiting for ever."""
        hashes, pieces = cache.module_hashes(schema, module)
        admission = cache.kv.admit_blocks(
            hashes,
            pieces,
            num_blocks=len(hashes),
            max_hits=None if use_cached else 0,
            retention=_module_retention if promote else _keep_retention,
        )
        if admission is None:
            needed = len(hashes) - len(cache.pool.match_prefix(hashes, pieces))
            raise PoolBusy(
                f"the KV pool has {cache.pool.num_free_blocks} free blocks but module {module.qualified_name!r} "
                f"needs {needed}: retry later or raise --kv-cache-memory"
            )
        fill = cls(cache, schema, module, hashes, pieces, list(admission.blocks), admission.num_hits)
        if admission.num_hits == len(hashes):
            return fill
        try:
            if cache.store is not None and fill._load():
                fill.source = FillSource.LOADED
            else:
                fill._lay_out()
                fill.source = FillSource.COMPUTED
        except PoolBusy:
            fill.abandon()
            if not admission.num_hits:
                raise
            return cls.begin(cache, schema, module, promote=promote, use_cached=False)
        except BaseException:
            fill.abandon()
            raise
        return fill

    @property
    def tokens_left(self) -> int:
        """Tokens of the precompute pass still to run (0: ``finish`` may be called)."""
        return 0 if self._run is None else len(self._run.token_ids) - self._next

    @property
    def next_chunk(self) -> int:
        """Tokens the next chunk runs (0 when nothing is left)."""
        return min(self.cache.chunk_tokens, self.tokens_left)

    def run(self, max_tokens: int | None = None) -> int:
        """Run the next chunks of the pass, at least one, while they fit in ``max_tokens``
        (``None``: all of them, with ``between_chunks`` between two); returns the tokens run
        (the caller counts them). The chunk grid is fixed, so the KV is the same either way."""
        done = 0
        step = self.cache.chunk_tokens
        while self.tokens_left and (done == 0 or max_tokens is None or done + self.next_chunk <= max_tokens):
            run, start = self._run, self._next
            end = min(start + step, len(run.token_ids))  # type: ignore[union-attr]  # tokens_left implies a run
            self.cache.runner.precompute_chunk(run.token_ids, run.position_ids, self._slots, start, end)  # type: ignore[union-attr]  # tokens_left implies a run
            self._next = end
            done += end - start
            if max_tokens is None and self.tokens_left:
                self.cache.between_chunks()
        return done

    def finish(self) -> list[KVBlock]:
        """Register the module's blocks (priority 90) and let the scratch go; returns the
        blocks, one reference each now owned by the caller (release them tail first; it
        counts the module as filled from ``source``). Call once ``tokens_left`` is 0."""
        assert self.tokens_left == 0, "finish() before the precompute pass ran"
        self._release_scratch()
        if self._num_hits < len(self._hashes):
            self.cache.kv.register_blocks(
                self.blocks,
                self._hashes,
                self._pieces,
                self._num_hits,
                len(self.blocks),
                default_priority=MODULE_PRIORITY,
            )
        blocks, self.blocks = self.blocks, []
        return blocks

    def abandon(self) -> None:
        """Release everything held (the fresh blocks go back unregistered). Idempotent."""
        self._release_scratch()
        blocks, self.blocks = self.blocks, []
        self.cache.pool.release(reversed(blocks))

    def held(self) -> list[KVBlock]:
        """Every block the fill holds a reference to (``check_integrity``)."""
        return [*self.blocks, *self.scratch]

    # ------------------------------------------------------------------ filling
    def _release_scratch(self) -> None:
        scratch, self.scratch = self.scratch, []
        self.cache.pool.release(reversed(scratch))

    def _new_slots(self) -> list[int]:
        """Slots of the stored tokens from block ``num_hits`` on (those below are cached)."""
        bs = self.cache.pool.block_size
        lo = self._num_hits * bs
        return block_slots(
            [b.block_id for b in self.blocks[self._num_hits :]], 0, len(self.module.stored_token_ids) - lo, bs
        )

    def _load(self) -> bool:
        """Fill the fresh blocks from the store; False (compute instead) when the file is
        absent or refused, or its tensor does not fit the module (the runner's ``ValueError``)."""
        store = self.cache.store
        kv = store.load_module(self.schema, self.module.qualified_name)  # type: ignore[union-attr]  # _load runs only with a store
        if kv is None:
            return False
        lo = self._num_hits * self.cache.pool.block_size  # stored tokens below this are already in the pool
        slots = self._new_slots()
        try:
            self.cache.runner.write_kv(slots, kv, first_token=lo)
        except ValueError as exc:
            store.refuse(self.schema, StoreMismatch(f"module {self.module.qualified_name!r}: {exc}", "shape"))  # type: ignore[union-attr]  # _load runs only with a store
            return False
        self.loaded_tokens = len(slots)
        return True

    def _lay_out(self) -> None:
        """Where each token of ``precompute_input`` writes its KV: stored tokens from block
        ``num_hits`` on into the fresh blocks, everything else (scaffolds, slots, the part
        already cached) into scratch blocks held until ``finish``. Raises ``PoolBusy``."""
        bs = self.cache.pool.block_size
        run = self.schema.precompute_input(self.module.qualified_name)
        lo = self._num_hits * bs
        new_slots = self._new_slots()
        targets: list[int | None] = []
        j = 0
        for keep in run.store:
            targets.append(new_slots[j - lo] if keep and j >= lo else None)
            j += keep
        num_scratch = sum(t is None for t in targets)
        n = cdiv(num_scratch, bs)
        if not self.cache.pool.can_allocate(n):
            raise PoolBusy(
                f"the KV pool has {self.cache.pool.num_free_blocks} free blocks but precomputing module "
                f"{self.module.qualified_name!r} needs {n}: retry later or raise --kv-cache-memory"
            )
        self.scratch = self.cache.kv.allocate(n)  # through the manager: what it evicts goes to the host tier first
        free = iter(block_slots([b.block_id for b in self.scratch], 0, num_scratch, bs))
        self._slots = [t if t is not None else next(free) for t in targets]
        self._run = run
