"""The asyncio face of the engine: the engine's typed front door, over one engine thread.

Routes and the CLI call only the named methods here (``generate``, ``prepare_pml``,
``module_blocks``, ``register_schema``, ``list_schemas``, ``remove_schema``,
``reset_prefix_cache``, ``kv_snapshot``, ``fresh_stats``, ``check_integrity``...), each with
typed arguments; each runs its work on the engine thread (``engine/engine_loop.py``), the only
thread that touches the ``LLMEngine``, between steps. ``call`` (any function of the engine)
is for tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvreuse.engine.engine_loop import (
    Abort,
    Add,
    Call,
    EngineDeadError,
    EngineError,
    EngineLoop,
    RequestFailedError,
    Stop,
    Stream,
)
from kvreuse.sampling_params import SamplingParams
from kvreuse.tiers.tier_stats import store_stats

if TYPE_CHECKING:
    from kvreuse.cache.retention import KvCacheRetentionConfig
    from kvreuse.engine.blend import BlendOverride
    from kvreuse.engine.document_cache import DocumentPrompt
    from kvreuse.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
    from kvreuse.engine.schema_service import SchemaListing
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.events.records import KVSnapshot
    from kvreuse.pml.module_cache import SchemaInfo
    from kvreuse.pml.prepared import PreparedPrompt

# the errors are engine_loop's, raised to callers here
__all__ = ["AsyncEngine", "EngineDeadError", "EngineError", "RequestFailedError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ExecutorFacts:
    """What an executor is, fixed once its engine is built (``/v1/kvreuse/info``)."""

    model_name: str
    model_id: str
    model_path: Path | None
    hash_algorithm: str
    enable_prefix_caching: bool
    num_blocks: int
    cache_levels: tuple[str, ...]  # the device pool's level, then the tiers below it
    object_store: str | None  # the object store's identity (endpoint, bucket, prefix; hashed), or None
    eos_token_ids: tuple[int, ...]  # sorted: what ends a request
    kv_cache_dtype: str = "auto"  # the KV pool's format (engine/kv_quant.py), never "auto" once built
    deterministic: bool = False  # the batch-invariant forward (--deterministic, resolved), in model_id

    @classmethod
    def of(cls, engine: LLMEngine) -> ExecutorFacts:
        return cls(
            engine.model_name,
            engine.model_id,
            engine.loaded.path,
            engine.config.hash_algorithm,
            engine.config.enable_prefix_caching,
            engine.pool.num_blocks,
            tuple(pool.cache_level for pool in engine.cache.pools()),
            engine.cache.object_store_id,
            tuple(sorted(engine.eos_token_ids)),
            engine.runner.kv_format.name,
            engine.runner.deterministic,
        )


def _loop_future() -> tuple[asyncio.Future, Callable[[Any, bool], None]]:
    """A future on the running loop and ``settle(value, failed)``, callable from any thread,
    that completes it (ignored once the caller was cancelled or its loop closed)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle_in_loop(value: Any, failed: bool) -> None:
        if future.done():  # the caller was cancelled
            return
        if failed:
            future.set_exception(value)
        else:
            future.set_result(value)

    def settle(value: Any, failed: bool) -> None:
        try:
            loop.call_soon_threadsafe(settle_in_loop, value, failed)
        except RuntimeError:
            logger.warning("caller's event loop closed before its engine call returned")

    return future, settle


class AsyncEngine:
    """Serves ``generate`` calls from any asyncio loop over one engine thread.

    ``start()`` launches the thread (idempotent); ``shutdown()`` stops it, failing whatever
    is still in flight with ``EngineDeadError``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Read-only facts, safe to share: they never change after the engine is built.
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.block_size: int = engine.block_size
        self.pool_tokens: int = engine.pool.num_blocks * engine.block_size  # tokens the device pool holds
        self.vocab_size: int = engine.loaded.shape.vocab_size
        self.event_buffer: EventBuffer | None = engine.events  # thread-safe; None: events off
        self.facts = ExecutorFacts.of(engine)
        self._loop = EngineLoop(engine)
        # the disk / remote stores count on their writer thread and breaker clock, between
        # steps too: stats() reads their (thread-safe) counters live, not from the snapshot
        self._stores = engine.stores
        self._thread: threading.Thread | None = None
        engine.cache.watch_stores(self._loop.wake.set)  # finished disk / remote writes wake an idle loop

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._loop.running = True
        self._thread = threading.Thread(target=self._loop.run, name="kvreuse-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; in-flight requests get ``EngineDeadError``. Then the
        queued disk / remote writes are finished (``LLMEngine.close``)."""
        if self._thread is None:
            return
        self._loop.send(Stop())
        self._thread.join(timeout)
        self._thread = None
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._loop.running and self._thread is not None and self._thread.is_alive()

    @property
    def remote_store(self) -> str | None:
        """The remote store's identity (no credentials), or None; read live, not a fact: a
        Redis Cluster unreachable at start has a stand-in until it answers
        (``RemoteStore.provisional``)."""
        return self.engine.cache.remote_store_id

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | None = None,
        prepared: PreparedPrompt | DocumentPrompt | None = None,
        blend: BlendOverride | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative text/tokens plus the new delta) until one
        has ``finished``. With ``prepared`` (a PML prompt from ``prepare_pml``, or a
        ``DocumentPrompt``) the prompt is that, and ``prompt_token_ids`` is ignored; ``blend``
        (parsed at the edge) is its blend.

        Raises ``ValueError`` when the engine rejects the request (message names the field),
        ``EngineError`` if the engine fails while serving it (``RequestFailedError`` when it
        failed this request alone: ``LLMEngine.step``). If the consumer stops early
        (client disconnect: ``GeneratorExit`` or ``CancelledError``) the request is aborted
        and its blocks freed.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._loop.send(Add(request_id, list(prompt_token_ids), params, cache_salt, retention, stream, prepared, blend))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread has already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._loop.send(Abort(request_id, stream))

    def document_context_blocks(self, prompt: DocumentPrompt, blend: BlendOverride | None = None) -> int:
        """Blocks a documents prompt's context holds once acquired (``PromptIntake.context_blocks``).
        Pure, any thread: reads fixed settings only."""
        return self.engine.intake.context_blocks(prompt, blend)

    async def prepare_pml(self, pml_text: str) -> PreparedPrompt:
        """Compile a PML ``<prompt>`` over the registered schemas, on the engine thread (where
        they live). The result is frozen: pass it to ``generate(prepared=...)``. Raises ``PMLError``."""
        return await self._on_engine(lambda engine: engine.prepare_prompt(pml_text))

    async def module_blocks(self, prompt: PreparedPrompt) -> int:
        """Blocks the modules of a prepared PML prompt take in the pool."""
        return await self._on_engine(lambda engine: engine.schemas.module_blocks(prompt))

    # ------------------------------------------------------------------ schemas
    async def register_schema(self, pml_text: str) -> SchemaInfo:
        """Register a PML schema without stopping the requests in flight: compiled and checked
        against the cost limits in a worker thread (``PMLError`` at once, nothing computed),
        then precomputed on the engine thread a slice per step, between the requests' steps
        (``LLMEngine.submit_schema``). Returns once the schema serves. Raises ``PMLError``,
        ``PoolBusy`` (a ``ValueError``) when the pool cannot hold it, ``EngineDeadError``.
        Cancelling the caller does not stop the registration (it completes on its own)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        compiled = await asyncio.to_thread(self.engine.schemas.compile, pml_text)  # fixed settings only
        future, settle = _loop_future()

        def settle_failure(value: Any, failed: bool) -> None:
            if failed:  # queued: the registration settles when it ends
                settle(value, True)

        self._loop.send(Call(lambda e: e.submit_schema(pml_text, settle, compiled=compiled), settle_failure))
        return await future

    async def list_schemas(self) -> SchemaListing:
        """The registered schemas and the registrations in progress."""
        return await self._on_engine(lambda engine: engine.schemas.listing())

    async def remove_schema(self, name: str) -> bool:
        """Forget a registered schema; ``False`` if it is not registered."""
        return await self._on_engine(lambda engine: engine.schemas.remove(name))

    # ------------------------------------------------------------------ caches and introspection
    async def reset_prefix_cache(self) -> int:
        """``LLMEngine.reset_prefix_cache``: cached blocks not in use dropped; returns how many."""
        return await self._on_engine(lambda engine: engine.reset_prefix_cache())

    async def kv_snapshot(self) -> KVSnapshot:
        """``LLMEngine.kv_snapshot``, between steps. Raises ``RuntimeError`` when events are off."""
        return await self._on_engine(lambda engine: engine.kv_snapshot())

    def kv_snapshot_blocking(self, timeout: float | None = None) -> KVSnapshot:
        """``kv_snapshot`` for plain threads (the ZMQ publisher). Raises ``TimeoutError`` after
        ``timeout`` seconds, ``EngineDeadError``."""
        return self.call_blocking(lambda engine: engine.kv_snapshot(), timeout)

    async def fresh_stats(self) -> EngineStats:
        """``LLMEngine.stats`` taken now, between steps (``stats`` returns the last published)."""
        return await self._on_engine(lambda engine: engine.stats())

    def stats(self) -> EngineStats:
        """The snapshot taken by the engine thread after its latest step (never blocks on it),
        with the disk / remote stores' counters read now."""
        snapshot = self._loop.latest_stats
        if self._stores is None:
            return snapshot
        live = store_stats(self._stores)  # per level: the stores' counters now, over the step's ledger counts
        return replace(snapshot, tiers=snapshot.tiers | {lv: snapshot.tiers.get(lv, {}) | c for lv, c in live.items()})

    @property
    def integrity_error(self) -> str | None:
        """The message of the latest failed idle integrity check, or ``None`` if it passed."""
        return self._loop.integrity_error

    async def check_integrity(self) -> None:
        """Run the engine's ``check_integrity()`` (pool and request references) in the engine
        thread; raises its ``RuntimeError``."""
        await self._on_engine(lambda engine: engine.check_integrity())

    # ------------------------------------------------------------------ any function (tests)
    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between steps and return its result (or
        raise its exception). For tests; routes use the named methods above."""
        return await self._on_engine(fn)

    def call_blocking(self, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        """``call`` for plain threads. Raises ``fn``'s exception, ``TimeoutError`` after
        ``timeout`` seconds, ``EngineDeadError``."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def settle(value: Any, failed: bool) -> None:
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)

        self._loop.send(Call(fn, settle))
        return future.result(timeout)

    async def _on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        future, settle = _loop_future()
        self._loop.send(Call(fn, settle))
        return await future
