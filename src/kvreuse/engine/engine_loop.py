"""The engine thread: the one thread that touches an ``LLMEngine``, its block pool and the model.

::

    AsyncEngine ──send(_Add / _Abort / _Call / _Stop)──▶ inbox (thread-safe) ──▶ EngineLoop.run
          ▲                                                                        │ add / abort / step
          └──── per-request asyncio.Queue ◀── loop.call_soon_threadsafe ◀──────────┘

``run`` drains the inbox, steps while there is work and otherwise does the idle work (expired
retention, store changes, stats, an integrity check that logs loudly on failure) and sleeps
on an event until a command arrives or the next retention expiry.

Failure containment: a ``ValueError`` from ``add_request`` reaches only that caller (as
``ValueError``); any other exception while adding or delivering fails only that request; a
request the step failed alone (an output with ``error``: ``LLMEngine.step``) gets
``RequestFailedError`` with that message, and only it; an exception from ``step()`` itself (no one
request's doing) fails every in-flight request with ``EngineError`` and aborts them so their
blocks return to the pool. The loop itself keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvreuse.cache.retention import KvCacheRetentionConfig
    from kvreuse.engine.blend import BlendOverride
    from kvreuse.engine.document_cache import DocumentPrompt
    from kvreuse.engine.llm_engine import EngineStats, LLMEngine
    from kvreuse.pml.prepared import PreparedPrompt
    from kvreuse.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request (an internal error, HTTP 500)."""

    code: str | None = None  # the OpenAI error's ``code`` the HTTP layer sends with it


class RequestFailedError(EngineError):
    """The engine failed this request alone (its forward or post-processing raised; the
    others went on): HTTP 500 with ``code`` ``request_failed``, which tells a router the
    failure is the request's own (``kvreuse.router.upstream.REQUEST_FAULT_CODE``), so it
    is passed on, not retried or migrated to another executor."""

    code = "request_failed"


class EngineDeadError(EngineError):
    """The engine thread is not running (never started, or shut down)."""


@dataclass(frozen=True, slots=True)
class Stream:
    """Where one request's outputs go: an asyncio queue living on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: RequestOutput, or an exception to raise in the caller

    def put(self, item: Any) -> None:
        """Called from the engine thread. Raises ``RuntimeError`` if the loop is closed."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True, slots=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    retention: KvCacheRetentionConfig | None
    stream: Stream
    prepared: PreparedPrompt | DocumentPrompt | None = None  # PML or documents (built at the edge); KV assembled here
    blend: BlendOverride | None = None  # parsed at the edge; None: the engine's default for the prompt's kind


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    stream: Stream  # whose request: a rejected duplicate id must not abort the one in flight


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(engine)`` in the engine thread and hand ``settle(value, failed)`` the result."""

    fn: Callable[[Any], Any]
    settle: Callable[[Any, bool], None]  # must be safe to call from the engine thread


class Stop:
    pass


class EngineLoop:
    """Owns ``engine`` on its thread; ``send`` is the only way in (any thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.running = False
        self.integrity_error: str | None = None  # the latest failed idle check's message
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._stats_lock = threading.Lock()
        self._stats: EngineStats = engine.stats()  # latest snapshot, replaced under the lock
        # a documents or PML prompt's context pass (in _add) lets running decodes step between its chunks
        engine.pacer.attach(self._step, engine.scheduler.num_decoding)

    @property
    def latest_stats(self) -> EngineStats:
        """The snapshot published after the latest step (any thread, never blocks)."""
        with self._stats_lock:
            return self._stats

    def send(self, command: object) -> None:
        self.inbox.put(command)
        self.wake.set()

    def run(self) -> None:
        logger.debug("engine thread started")
        try:
            while self.running:
                self._drain_inbox()
                if not self.running:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    continue
                sleep = self.engine.cache.idle()  # expired retention and store changes: their events now
                self._publish_stats()
                self._idle_integrity_check()
                # Clear before re-checking the inbox so a command sent in between is not missed.
                self.wake.clear()
                if self.inbox.empty():
                    self.wake.wait(sleep)
        except BaseException:
            logger.critical("engine thread crashed; failing every in-flight request", exc_info=True)
            raise
        finally:
            self.running = False
            self._fail_all(EngineDeadError("the engine has stopped"))
            self.engine.schemas.fail_all(EngineDeadError("the engine has stopped"))
            self._drain_after_stop()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Abort):
                self._abort(command)
            elif isinstance(command, Call):
                self._call(command)
            elif isinstance(command, Stop):
                self.running = False
                return

    def _add(self, cmd: Add) -> None:
        if cmd.request_id in self._streams:
            self._deliver(cmd.stream, ValueError(f"request_id {cmd.request_id!r} is already in flight"))
            return
        try:
            if cmd.prepared is not None:
                self.engine.add_prepared_request(
                    cmd.request_id,
                    cmd.prepared,
                    cmd.params,
                    cache_salt=cmd.cache_salt,
                    retention=cmd.retention,
                    blend=cmd.blend,
                )
            else:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cache_salt=cmd.cache_salt, retention=cmd.retention
                )
        except ValueError as exc:
            self._deliver(cmd.stream, exc)
            return
        except Exception as exc:
            logger.exception("add_request(%s) failed", cmd.request_id)
            self._safe_engine_abort(cmd.request_id)
            self._deliver(cmd.stream, EngineError(f"internal error adding request: {exc}"))
            return
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, cmd: Abort) -> None:
        if self._streams.get(cmd.request_id) is not cmd.stream:
            return  # finished already, or never admitted (e.g. a duplicate id): nothing of this caller runs
        del self._streams[cmd.request_id]
        self._safe_engine_abort(cmd.request_id)

    def _call(self, cmd: Call) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller
            cmd.settle(exc, True)
        else:
            cmd.settle(result, False)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
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
            if output.error is not None:  # this request alone failed; the engine has freed it
                logger.error("request %s failed in an engine step: %s", output.request_id, output.error)
                self._deliver(stream, RequestFailedError(f"internal engine error: {output.error}"))
                continue
            if not self._deliver(stream, output) and not output.finished:
                self._abort(Abort(output.request_id, stream))
        self.engine.precompute_slice()  # schemas registering: a slice between two steps
        self._publish_stats()

    def _deliver(self, stream: Stream, item: Any) -> bool:
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
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            dead = EngineDeadError("the engine has stopped")
            if isinstance(command, Add):
                self._deliver(command.stream, dead)
            elif isinstance(command, Call):
                command.settle(dead, True)

    def _safe_engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%s) failed", request_id)

    def _publish_stats(self) -> None:
        try:
            snapshot = self.engine.stats()
        except Exception:
            logger.exception("engine.stats() failed")
            return
        with self._stats_lock:
            self._stats = snapshot

    def _idle_integrity_check(self) -> None:
        try:
            self.engine.check_integrity()
        except Exception as exc:
            if self.integrity_error is None:
                logger.error("BLOCK POOL INTEGRITY CHECK FAILED while idle: %s", exc, exc_info=True)
            self.integrity_error = str(exc)
        else:
            self.integrity_error = None
