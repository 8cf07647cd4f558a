"""One executor built from ``kvreuse serve``'s flags: model, engine, event publisher and app.

``kvreuse serve`` (``kvreuse.cli.run_serve``) and each replica of the Ray Serve application
(``kvreuse.ray_serve.replica``) build through ``build_executor``, so a replica runs exactly
what ``kvreuse serve`` runs with the same flags. Building starts nothing: the caller starts
the engine and the publisher (``BuiltExecutor.start``) and closes them (``close``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvreuse.serve_args import engine_config

if TYPE_CHECKING:  # torch and the model code load only when an executor is built
    from fastapi import FastAPI

    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.events.publisher import ZmqEventPublisher
    from kvreuse.models.loader import LoadedModel

TINY_PREFIX = "tiny:"  # --model tiny:llama / tiny:gemma3: random weights, for tests and smoke runs
DEFAULT_EVENT_BUFFER = 100_000  # when an endpoint is given without --event-buffer-max-size

Status = Callable[[str], contextlib.AbstractContextManager[Any]]  # a spinner while a step runs


def load_model_spec(spec: str, dtype: str, device: str, quantization: str = "none") -> LoadedModel:
    """A ``LoadedModel``; ``tiny:<arch>`` builds the random-weight test model.
    Raises ``ValueError`` for an unknown spec, dtype or device."""
    if spec.startswith(TINY_PREFIX):
        from kvreuse.models.tiny import tiny_model

        return tiny_model(spec[len(TINY_PREFIX) :], dtype=dtype, device=device, quantization=quantization)
    from kvreuse.models.loader import load_model

    return load_model(spec, dtype=dtype, device=device, quantization=quantization)


def off_main_thread(build):
    """``build()`` run in a thread that has ended when this returns (its result, or its
    exception raised here). Why: libgomp gives each thread that runs a parallel op a team of
    workers living as long as the thread. Loading in the main thread would leave its team
    beside the engine thread's, and with more managed threads than cores libgomp stops
    spin-waiting, so every small op of a step pays a futex wake-up (2 cores, fp32, 8 documents
    of 500 tokens + a question: 0.247 s a request from a second thread against 0.175 s when one
    thread does all the torch work)."""
    box: dict = {}
    done = threading.Event()  # set once build() has returned or raised, its cleanup run

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=run, name="kvreuse-load", daemon=True)
    thread.start()
    try:
        # Timed waits: the kernel may hand a process-directed SIGINT to another thread, and then an
        # untimed join() never wakes to run Python's handler (CI hung 60 s in the Ctrl-C test);
        # a timed wait reaches it within 0.1 s.
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        # Ctrl-C lands in this thread: raise it in the loader too and wait until its cleanup ran
        # (a GGUF conversion removes its temporary folder). Waiting on `done`, not join(): an
        # interrupted join has already marked the thread stopped (Python 3.11). A second Ctrl-C
        # leaves at once.
        assert thread.ident is not None  # started above
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
        while not done.wait(0.1):
            pass
        raise
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _prefill_cap(scheduler) -> str:
    """The start-up line's words for the prefill cap while decoding."""
    cap = scheduler.max_prefill_tokens_while_decoding
    if cap is None:
        return "no cap"
    per = scheduler.prefill_tokens_per_decode
    return f"{cap} tokens/step" + (f" (or {per} per decoding stream, if more)" if per else "")


def pool_summary(engine) -> str:
    num_blocks, block_size = engine.pool.num_blocks, engine.block_size
    per_token = engine.kv_bytes_per_token
    gib = num_blocks * block_size * per_token / 2**30
    host = ""
    if engine.host is not None:
        n = engine.host.pool.num_blocks
        host = (
            f"; host tier: {n} blocks = {n * block_size} tokens, {n * block_size * per_token / 2**30:.3f} GiB, "
            f"priority >= {engine.host.offload_policy.min_priority}"
        )
    return (
        f"KV pool: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
        f"{gib:.3f} GiB, {per_token} bytes/token, KV {engine.runner.kv_format.description}{host}; "
        f"forward: {engine.runner.forward_impl}; "
        f"prefill while decoding: {_prefill_cap(engine.scheduler)}"
    )


@dataclass
class BuiltExecutor:
    """What ``build_executor`` made; nothing runs until ``start``."""

    app: FastAPI
    engine: AsyncEngine
    publisher: ZmqEventPublisher | None
    loaded: LoadedModel

    def start(self) -> None:
        self.engine.start()
        if self.publisher is not None:
            self.publisher.start()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.engine.shutdown()


def build_executor(args: argparse.Namespace, status: Status = lambda _: contextlib.nullcontext()) -> BuiltExecutor:
    """Load the model, build the engine, the publisher (with ``--kv-events-endpoint``) and the
    app from ``kvreuse serve``'s parsed flags (``kvreuse.serve_args.add_serve_arguments``).
    ``status(text)`` wraps the two slow steps (a spinner on the console). Raises ``ValueError``
    for a bad flag or model, with the publisher (if it was opened) closed again."""
    from kvreuse.api.cache_breakpoints import BreakpointPolicy
    from kvreuse.api.tenant_limits import limits_from_args
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import LLMEngine
    from kvreuse.events import zmq_options
    from kvreuse.server.api_server import build_app
    from kvreuse.server.context import ServerLimits

    publisher = None
    try:
        zmq_options.check_arguments(args)
        config = engine_config(args)
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens)
        cache_policy = BreakpointPolicy.parse(args.cache_control_priorities, args.cache_control_ttls)
        limiter = None
        if (tenant_limits := limits_from_args(args)) is not None:  # before the model loads: fail at once
            from kvreuse.api.limiter import TenantLimiter
            from kvreuse.api.tenants import APIKeys

            tenant_limits.check_keys(APIKeys.parse(args.api_key) if args.api_key else None)
            limiter = TenantLimiter(tenant_limits)
        with status(f"loading model {args.model} ({config.dtype}, device {config.device}) ..."):
            loaded = off_main_thread(
                lambda: load_model_spec(args.model, config.dtype, config.device, config.quantization)
            )
        buffer = None
        buffer_size = args.event_buffer_max_size or (DEFAULT_EVENT_BUFFER if args.kv_events_endpoint else 0)
        if buffer_size:
            from kvreuse.events.buffer import EventBuffer

            buffer = EventBuffer(buffer_size)
        with status("allocating the KV pool ..."):
            engine = AsyncEngine(off_main_thread(lambda: LLMEngine(config, loaded, events=buffer)))
        if args.kv_events_endpoint and buffer is not None:  # an endpoint always has a buffer (size above)
            # The snapshot runs in the engine thread, so it sees the pool between steps.
            publisher = zmq_options.publisher_from_args(args, buffer, lambda: engine.kv_snapshot_blocking(timeout=30))
        app = build_app(
            engine,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            limits=limits,
            publisher=publisher,  # /v1/kvreuse/info advertises the publisher
            limiter=limiter,
            metrics_tenant_labels=args.metrics_tenant_labels,
            cache_policy=cache_policy,
        )
    except ValueError:
        if publisher is not None:
            publisher.close()
        raise
    return BuiltExecutor(app, engine, publisher, loaded)
