"""The asyncio face of the engine: one background thread owns the ``LLMEngine``.

::

    asyncio callers ──generate()──▶ inbox (thread-safe) ──▶ engine thread: add / abort / step
          ▲                                                        │
          └──── per-request asyncio.Queue ◀── loop.call_soon_threadsafe ◀──┘

The engine thread is the only thread that touches the engine, its block pool and the
model. It drains the inbox, steps while there is work and otherwise sleeps on an event;
whenever it goes idle it runs ``pool.check_integrity()`` and logs loudly on failure.

Failure containment: a ``ValueError`` from ``add_request`` reaches only that caller (as
``ValueError``); any other exception while adding or delivering fails only that request;
an exception from ``step()`` fails every in-flight request with ``EngineError`` and aborts
them so their blocks return to the pool. The loop itself keeps running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvreuse.engine.sampling_params import SamplingParams
from kvreuse.tiers.setup import store_stats

if TYPE_CHECKING:
    from kvreuse.cache.retention import KvCacheRetentionConfig
    from kvreuse.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
    from kvreuse.pml.module_cache import SchemaInfo
    from kvreuse.engine.document_cache import DocumentPrompt
    from kvreuse.pml.prepared import PreparedPrompt

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while serving a request (an internal error, HTTP 500)."""


class EngineDeadError(EngineError):
    """The engine thread is not running (never started, or shut down)."""


@dataclass(frozen=True, slots=True)
class _Stream:
    """Where one request's outputs go: an asyncio queue living on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: RequestOutput, or an exception to raise in the caller

    def put(self, item: Any) -> None:
        """Called from the engine thread. Raises ``RuntimeError`` if the loop is closed."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    retention: KvCacheRetentionConfig | None
    stream: _Stream
    prepared: PreparedPrompt | DocumentPrompt | None = None  # PML or documents (built at the edge); KV assembled here
    blend: dict | None = None  # its seam repair (LLMEngine.add_prepared_request); None: the engine's default


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    stream: _Stream  # whose request: a rejected duplicate id must not abort the one in flight


@dataclass(frozen=True, slots=True)
class _Call:
    """Run ``fn(engine)`` in the engine thread and hand ``settle(value, failed)`` the result."""

    fn: Callable[[Any], Any]
    settle: Callable[[Any, bool], None]  # must be safe to call from the engine thread


class _Stop:
    pass


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
        self.document_context_blocks = engine.document_context_blocks  # pure: reads fixed settings only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stats_lock = threading.Lock()
        self._stats: EngineStats = engine.stats()  # latest snapshot, replaced under the lock
        # the disk / remote stores count on their writer thread and breaker clock, between
        # steps too: stats() reads their (thread-safe) counters live, not from the snapshot
        self._stores = engine.stores
        self._integrity_error: str | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        engine.watch_stores(self._wake.set)  # finished disk / remote writes wake an idle loop

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvreuse-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; in-flight requests get ``EngineDeadError``. Then the
        queued disk / remote writes are finished (``LLMEngine.close``)."""
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ public API
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | None = None,
        prepared: PreparedPrompt | DocumentPrompt | None = None,
        blend: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative text/tokens plus the new delta) until one
        has ``finished``. With ``prepared`` (a PML prompt from ``call(lambda e:
        e.prepare_prompt(text))``) the prompt is that, and ``prompt_token_ids`` is ignored.

        Raises ``ValueError`` when the engine rejects the request (message names the field),
        ``EngineError`` if the engine fails while serving it. If the consumer stops early
        (client disconnect: ``GeneratorExit`` or ``CancelledError``) the request is aborted
        and its blocks freed.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._send(_Add(request_id, list(prompt_token_ids), params, cache_salt, retention, stream, prepared, blend))
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
                self._send(_Abort(request_id, stream))

    def stats(self) -> EngineStats:
        """The snapshot taken by the engine thread after its latest step (never blocks on it),
        with the disk / remote stores' counters read now."""
        with self._stats_lock:
            snapshot = self._stats
        if self._stores is None:
            return snapshot
        live = store_stats(self._stores)  # per level: the stores' counters now, over the step's ledger counts
        return replace(snapshot, tiers=snapshot.tiers | {lv: snapshot.tiers.get(lv, {}) | c for lv, c in live.items()})

    @property
    def integrity_error(self) -> str | None:
        """The message of the latest failed idle integrity check, or ``None`` if it passed."""
        return self._integrity_error

    async def check_integrity(self) -> None:
        """Run the engine's ``check_integrity()`` (pool and request references) in the engine
        thread; raises its ``RuntimeError``."""
        await self.call(lambda engine: engine.check_integrity())

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between steps and return its result
        (or raise its exception). For tests, admin endpoints and snapshots."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        future, settle = _loop_future()
        self._send(_Call(fn, settle))
        return await future

    async def register_schema(self, pml_text: str) -> SchemaInfo:
        """Register a PML schema without stopping the requests in flight: compiled and checked
        against the cost limits in a worker thread (``PMLError`` at once, nothing computed),
        then precomputed on the engine thread a slice per step, between the requests' steps
        (``LLMEngine.submit_schema``). Returns once the schema serves. Raises ``PMLError``,
        ``PoolBusy`` (a ``ValueError``) when the pool cannot hold it, ``EngineDeadError``.
        Cancelling the caller does not stop the registration (it completes on its own)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        compiled = await asyncio.to_thread(self.engine.modules.compile, pml_text)  # fixed settings only
        future, settle = _loop_future()

        def settle_failure(value: Any, failed: bool) -> None:
            if failed:  # queued: the registration settles when it ends
                settle(value, True)

        self._send(_Call(lambda e: e.submit_schema(pml_text, settle, compiled=compiled), settle_failure))
        return await future

    def call_blocking(self, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        """``call`` for plain threads (the ZMQ publisher's snapshot, the CLI). Raises
        ``fn``'s exception, ``TimeoutError`` after ``timeout`` seconds, ``EngineDeadError``."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def settle(value: Any, failed: bool) -> None:
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)

        self._send(_Call(fn, settle))
        return future.result(timeout)

    # ------------------------------------------------------------------ engine thread
    def _send(self, command: object) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        logger.debug("engine thread started")
        try:
            while self._running:
                self._drain_inbox()
                if not self._running:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    continue
                # Durations that ran out while idle fall back to priority 35 now (metrics,
                # dashboard and BlockUpdated events follow), not at the next allocation.
                self.engine.pool.expire()
                self.engine.sync_stores()  # store writes finished while idle: their events now
                self._publish_stats()
                self._idle_integrity_check()
                # Clear before re-checking the inbox so a command sent in between is not missed.
                self._wake.clear()
                if self._inbox.empty():
                    self._wake.wait(self._until_next_expiry())
        except BaseException:  # noqa: BLE001 - the loop must never die silently
            logger.critical("engine thread crashed; failing every in-flight request", exc_info=True)
            raise
        finally:
            self._running = False
            self._fail_all(EngineDeadError("the engine has stopped"))
            self.engine.registrations.fail_all(EngineDeadError("the engine has stopped"))
            self._drain_after_stop()

    def _until_next_expiry(self) -> float | None:
        """Seconds to sleep while idle: until the pool's next retention expiry, else forever."""
        pool = self.engine.pool
        due = pool.next_expiry()
        return None if due is None else min(max(due - pool.clock(), 0.01), 3600.0)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command)
            elif isinstance(command, _Call):
                self._call(command)
            elif isinstance(command, _Stop):
                self._running = False
                return

    def _add(self, cmd: _Add) -> None:
        if cmd.request_id in self._streams:
            self._deliver(cmd.stream, ValueError(f"request_id {cmd.request_id!r} is already in flight"))
            return
        try:
            if cmd.prepared is not None:
                self.engine.add_prepared_request(
                    cmd.request_id, cmd.prepared, cmd.params, cache_salt=cmd.cache_salt, retention=cmd.retention,
                    blend=cmd.blend,
                )
            else:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cache_salt=cmd.cache_salt, retention=cmd.retention
                )
        except ValueError as exc:
            self._deliver(cmd.stream, exc)
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
            logger.exception("add_request(%s) failed", cmd.request_id)
            self._safe_engine_abort(cmd.request_id)
            self._deliver(cmd.stream, EngineError(f"internal error adding request: {exc}"))
            return
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, cmd: _Abort) -> None:
        if self._streams.get(cmd.request_id) is not cmd.stream:
            return  # finished already, or never admitted (e.g. a duplicate id): nothing of this caller runs
        del self._streams[cmd.request_id]
        self._safe_engine_abort(cmd.request_id)

    def _call(self, cmd: _Call) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller
            cmd.settle(exc, True)
        else:
            cmd.settle(result, False)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the in-flight requests, keep serving
            logger.exception("engine step failed; failing %d in-flight requests", len(self._streams))
            for request_id in list(self._streams):
                self._safe_engine_abort(request_id)
            self._fail_all(EngineError(f"internal engine error: {exc}"))
            self._publish_stats()
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while this step ran; the engine has already been told
            if output.finished:
                del self._streams[output.request_id]
            if not self._deliver(stream, output) and not output.finished:
                self._abort(_Abort(output.request_id, stream))
        self.engine.precompute_slice()  # schemas registering: a slice between two steps
        self._publish_stats()

    def _deliver(self, stream: _Stream, item: Any) -> bool:
        try:
            stream.put(item)
            return True
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            return False

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._deliver(stream, exc)

    def _drain_after_stop(self) -> None:
        """Answer whatever arrived after the loop stopped, so no caller waits forever."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            dead = EngineDeadError("the engine has stopped")
            if isinstance(command, _Add):
                self._deliver(command.stream, dead)
            elif isinstance(command, _Call):
                command.settle(dead, True)

    def _safe_engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001
            logger.exception("abort_request(%s) failed", request_id)

    def _publish_stats(self) -> None:
        try:
            snapshot = self.engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine.stats() failed")
            return
        with self._stats_lock:
            self._stats = snapshot

    def _idle_integrity_check(self) -> None:
        try:
            self.engine.check_integrity()
        except Exception as exc:  # noqa: BLE001 - report, do not crash the server
            if self._integrity_error is None:
                logger.error("BLOCK POOL INTEGRITY CHECK FAILED while idle: %s", exc, exc_info=True)
            self._integrity_error = str(exc)
        else:
            self._integrity_error = None
