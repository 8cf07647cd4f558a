"""Schemas being registered on a serving engine: precomputed in slices between engine steps.

::

    POST /v1/schemas ─ ModuleCache.compile (any thread: parse, compile, cost limits) ─▶ CompiledSchema
                     ─ ModuleCache.start (engine thread) ─▶ Registration ─▶ RegistrationQueue.submit
    every LLMEngine.step ─ RegistrationQueue.run_slice ─ at most slice_tokens precompute tokens:
                           the first registration's next modules (ModuleFill), whole ones while they
                           fit, a big module one chunk per step; then the step's decode as usual
    last module in the pool ─ ModuleCache.install (swapped in, stored) ─▶ settle(SchemaInfo)

A registration holds the blocks of the module it is filling (``ModuleFill``) and nothing else:
the modules it finished are cached at the module priority, evictable like any cached block
(a request recomputes an evicted one). Its schema is invisible to prompts until every module
is in (the version registered before, if any, serves until then), so no request ever reads
a module that is still being computed. Registrations run one after another, in the order
they came in; the last of two for one name wins, as if they had come one at a time.

A registration that fails (the pool cannot hold a module and nothing runs that could free
blocks, or the model fails) is settled with the error and leaves nothing held; a pool that
is busy while requests run or wait (they free blocks when they end) only makes it wait for
a later step.

A registration reads and drives its host (the ``ModuleCache``, through the
``RegistrationHost`` protocol) by its methods only: what it runs it reports through
``record_fill``.

Engine thread only.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from kvreuse.cache.block_pool import KVBlock
from kvreuse.pml.compiled import CompiledSchema
from kvreuse.pml.module_fill import FillHost, FillSource, ModuleFill, PoolBusy

if TYPE_CHECKING:
    from kvreuse.pml.compiled import CompiledModule
    from kvreuse.pml.kv_access import ModuleKV
    from kvreuse.pml.schema_info import SchemaInfo

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]  # (modules done, modules total, qualified name)
Settle = Callable[[Any, bool], None]  # (SchemaInfo, False) when registered, (exception, True) when it failed


class RegistrationHost(FillHost, Protocol):
    """What a registration needs from the module cache that starts it (``ModuleCache``)."""

    schemas: dict[str, CompiledSchema]  # the versions serving, by name

    def demote(self, schema: CompiledSchema) -> None: ...

    def install(self, schema: CompiledSchema, pml_text: str, kv: dict[str, ModuleKV], *, save: bool) -> None: ...

    def info(self, name: str, computed: int = 0, loaded: int = 0, present: int = 0) -> SchemaInfo: ...

    def read_kv(self, module: CompiledModule, blocks: list[KVBlock]) -> ModuleKV: ...

    def record_fill(self, tokens: int, filled: FillSource | None = None) -> None: ...


class Registration:
    """One schema's modules put into the pool, a budget of precompute tokens at a time."""

    def __init__(
        self,
        cache: RegistrationHost,
        schema: CompiledSchema,
        pml_text: str,
        *,
        progress: Progress | None = None,
        settle: Settle | None = None,
    ) -> None:
        self.cache = cache
        self.schema = schema
        self.pml_text = pml_text
        self.todo = schema.precompute_modules
        self.modules_done = 0
        self.info: SchemaInfo | None = None  # set once registered
        self._progress = progress
        self._settle = settle
        self._fill: ModuleFill | None = None
        self._kv: dict[str, Any] = {}  # qualified name -> host KV, for the store (read while the blocks are held)
        self._counts: Counter[str] = Counter()
        self.tokens_computed = 0

    @property
    def finished(self) -> bool:
        return self.info is not None

    def advance(self, budget: int | None = None) -> int:
        """Fill the next modules with at most ``budget`` precompute tokens (``None``: all the
        rest, at once); a module is split only where it is larger than the budget left, one
        chunk at a time. Loading from the store counts its tokens against the budget too.
        Installs the schema and settles once the last module is in. Returns the tokens run.

        Raises ``PoolBusy`` when the pool cannot hold the next module now (nothing of it is
        held; ``advance`` may be called again later); any other error leaves the fill held
        for ``fail`` to release."""
        used = 0
        while self.modules_done < len(self.todo):
            if self._fill is None:
                if budget is not None and used >= budget:
                    return used
                self._fill = ModuleFill.begin(self.cache, self.schema, self.todo[self.modules_done], promote=True)
                used += self._fill.loaded_tokens
            fill = self._fill
            if fill.tokens_left:
                room = None if budget is None else budget - used
                if room is not None and used and fill.next_chunk > room:
                    return used  # whole modules or whole chunks only: the rest waits for the next step
                ran = fill.run(room)
                self.cache.record_fill(ran)
                used += ran
                self.tokens_computed += ran
                if fill.tokens_left:
                    return used
            self._finish_module(fill)
        self._complete()
        return used

    def fail(self, exc: BaseException) -> None:
        """Give up: release what is held, drop this version's cached blocks to the default
        priority (unless it is the version serving), settle with ``exc``."""
        if self._fill is not None:
            self._fill.abandon()
            self._fill = None
        serving = self.cache.schemas.get(self.schema.name)
        if serving is None or serving.schema_hash != self.schema.schema_hash:
            self.cache.demote(self.schema)
        self._kv.clear()
        if self._settle is not None:
            self._settle(exc, True)

    def held(self) -> list[KVBlock]:
        return [] if self._fill is None else self._fill.held()

    def _finish_module(self, fill: ModuleFill) -> None:
        blocks = fill.finish()
        self.cache.record_fill(0, fill.source)
        self._fill = None
        try:
            if self.cache.store is not None:
                self._kv[fill.module.qualified_name] = self.cache.read_kv(fill.module, blocks)
        finally:
            self.cache.pool.release(reversed(blocks))
        self._counts[fill.source.value] += 1
        self.modules_done += 1
        if self._progress is not None:
            self._progress(self.modules_done, len(self.todo), fill.module.qualified_name)

    def _complete(self) -> None:
        computed = self._counts[FillSource.COMPUTED.value]
        self.cache.install(self.schema, self.pml_text, self._kv, save=computed > 0)
        self._kv = {}
        self.info = self.cache.info(
            self.schema.name,
            computed=computed,
            loaded=self._counts[FillSource.LOADED.value],
            present=self._counts[FillSource.PRESENT.value],
        )
        if self._settle is not None:
            self._settle(self.info, False)


class RegistrationQueue:
    """Registrations waiting for precompute, first come first served. ``run_slice`` is the
    engine's once-per-step call; ``slice_tokens`` (``--schema-slice-tokens``) bounds it."""

    def __init__(self, slice_tokens: int) -> None:
        if slice_tokens < 1:
            raise ValueError(f"--schema-slice-tokens must be >= 1, got {slice_tokens}")
        self.slice_tokens = slice_tokens
        self._jobs: deque[Registration] = deque()
        self.slices = 0  # run_slice calls that ran or loaded something (stats, tests)

    def submit(self, job: Registration) -> None:
        self._jobs.append(job)

    def has_work(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator[Registration]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def run_slice(self, *, can_wait: bool) -> int:
        """Advance the registrations in order with at most ``slice_tokens`` precompute tokens
        in all; returns the tokens computed. Never raises: a registration that fails is
        settled with its error and dropped. ``can_wait``: requests are running or waiting
        (a waiting PML request holds its modules' KV), so a pool too full for the next module
        now may have room at a later step (the registration waits); otherwise that is a
        failure."""
        used = computed = 0
        while self._jobs and used < self.slice_tokens:
            job = self._jobs[0]
            before = job.tokens_computed
            try:
                used += job.advance(self.slice_tokens - used)
            except PoolBusy as exc:
                if can_wait:
                    break
                self._drop(job, exc)
            except Exception as exc:  # logged: one bad schema must not stop serving
                log.exception("registering schema %r failed", job.schema.name)
                self._drop(job, exc)
            computed += job.tokens_computed - before
            if job.finished:
                self._jobs.popleft()
            elif self._jobs and self._jobs[0] is job:
                break  # the budget is used up (or the next chunk does not fit in what is left)
        if used or computed:
            self.slices += 1
        return computed

    def fail_all(self, exc: BaseException) -> None:
        """Settle every registration with ``exc`` (the engine is stopping)."""
        while self._jobs:
            self._drop(self._jobs[0], exc)

    def held(self) -> list[KVBlock]:
        """Blocks the registrations hold (``LLMEngine.check_integrity``)."""
        return [b for job in self._jobs for b in job.held()]

    def _drop(self, job: Registration, exc: BaseException) -> None:
        self._jobs.remove(job)
        job.fail(exc)
