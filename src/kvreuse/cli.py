"""The ``kvreuse`` command: ``serve``, plus subcommands other modules own.

Subcommands are a table (name -> help, argument builder, runner); a delegated subcommand
imports its module only when it runs, so ``kvreuse serve`` never imports the simulator
and ``kvreuse simulate`` never imports torch through us. The ``serve`` flags and the engine
config they build are :mod:`kvreuse.serve_args`.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.serve_args import (
    add_serve_arguments,
    engine_config as _engine_config,  # the tests' name for it
)

if TYPE_CHECKING:  # the CLI imports torch and the model code only when a command runs
    from kvreuse.models.loader import LoadedModel

logger = logging.getLogger("kvreuse")

TINY_PREFIX = "tiny:"  # --model tiny:llama / tiny:gemma3: random weights, for tests and smoke runs


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False  # the target parses its own arguments (``--help`` included)


# ---------------------------------------------------------------------------- serve
_DEFAULT_EVENT_BUFFER = 100_000  # when an endpoint is given without --event-buffer-max-size


def _load_model(spec: str, dtype: str, device: str, quantization: str = "none") -> LoadedModel:
    """A ``LoadedModel``; ``tiny:<arch>`` builds the random-weight test model.
    Raises ``ValueError`` for an unknown spec, dtype or device."""
    if spec.startswith(TINY_PREFIX):
        from kvreuse.models.tiny import tiny_model

        return tiny_model(spec[len(TINY_PREFIX) :], dtype=dtype, device=device, quantization=quantization)
    from kvreuse.models.loader import load_model

    return load_model(spec, dtype=dtype, device=device, quantization=quantization)


def _pool_summary(engine) -> str:
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
        f"{gib:.3f} GiB, {per_token} bytes/token{host}; forward: {engine.runner.forward_impl}; "
        f"prefill while decoding: {engine.scheduler.max_prefill_tokens_while_decoding or 'no cap'} tokens/step"
    )


def _off_main_thread(build):
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
        thread.join()
    except KeyboardInterrupt:
        # Ctrl-C lands in this thread: raise it in the loader too and wait until its cleanup ran
        # (a GGUF conversion removes its temporary folder). Not a second join(): an interrupted
        # join has already marked the thread stopped (Python 3.11), so it would return at once.
        # A second Ctrl-C leaves at once.
        assert thread.ident is not None  # started above
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
        done.wait()
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, build the engine, the publisher (with ``--kv-events-endpoint``) and
    the app, start the engine and the publisher, serve until interrupted, then close both.
    Returns the exit status (2 for a bad flag or model)."""
    from rich.console import Console

    from kvreuse.api.access_log import uvicorn_server
    from kvreuse.api.tenant_limits import limits_from_args
    from kvreuse.engine.async_engine import AsyncEngine
    from kvreuse.engine.llm_engine import LLMEngine
    from kvreuse.events import zmq_options
    from kvreuse.server.api_server import build_app
    from kvreuse.server.context import ServerLimits

    console = Console(stderr=True, soft_wrap=True)  # no wrapping: log lines stay greppable
    buffer = publisher = None
    try:
        zmq_options.check_arguments(args)
        config = _engine_config(args)
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens)
        from kvreuse.api.cache_breakpoints import BreakpointPolicy

        cache_policy = BreakpointPolicy.parse(args.cache_control_priorities, args.cache_control_ttls)
        limiter = None
        if (tenant_limits := limits_from_args(args)) is not None:  # before the model loads: fail at once
            from kvreuse.api.limiter import TenantLimiter
            from kvreuse.api.tenants import APIKeys

            tenant_limits.check_keys(APIKeys.parse(args.api_key) if args.api_key else None)
            limiter = TenantLimiter(tenant_limits)
        with console.status(f"loading model {args.model} ({config.dtype}, device {config.device}) ..."):
            loaded = _off_main_thread(lambda: _load_model(args.model, config.dtype, config.device, config.quantization))
        buffer_size = args.event_buffer_max_size or (_DEFAULT_EVENT_BUFFER if args.kv_events_endpoint else 0)
        if buffer_size:
            from kvreuse.events.buffer import EventBuffer

            buffer = EventBuffer(buffer_size)
        with console.status("allocating the KV pool ..."):
            engine = AsyncEngine(_off_main_thread(lambda: LLMEngine(config, loaded, events=buffer)))
        if args.kv_events_endpoint and buffer is not None:  # an endpoint always has a buffer (size above)
            # The snapshot runs in the engine thread, so it sees the pool between steps.
            publisher = zmq_options.publisher_from_args(args, buffer, lambda: engine.kv_snapshot_blocking(timeout=30))
        app = build_app(
            engine,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            limits=limits,
            publisher=publisher,
            limiter=limiter,  # /v1/kvreuse/info advertises the publisher
            metrics_tenant_labels=args.metrics_tenant_labels,
            cache_policy=cache_policy,
        )
    except ValueError as exc:
        if publisher is not None:
            publisher.close()
        console.print(f"[bold red]kvreuse serve:[/] {exc}")
        return 2
    names = ", ".join(app.state.ctx.served_model_names)
    from kvreuse.models.placement import dtype_name

    quant = loaded.quantization.value
    console.print(
        f"kvreuse: model [bold]{loaded.name}[/] ({loaded.model_id}) on {loaded.device}, "
        f"{dtype_name(loaded.dtype)}"
        + ("" if quant == "none" else f", {quant} weights")
        + f", context {engine.max_model_len} tokens, served as {names}"
    )
    console.print(f"kvreuse: {_pool_summary(engine.engine)}")
    if publisher is not None:
        console.print(
            f"kvreuse: KV events on {publisher.endpoint}"
            + (f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
            + (", CURVE" if publisher.curve else "")
            + ("" if publisher.include_token_ids else ", no token ids")
        )
        if warning := zmq_options.seal_warning(publisher, api_keys=bool(args.api_key)):
            console.print(f"[bold yellow]kvreuse: warning:[/] {warning}")
    console.print(f"kvreuse: listening on http://{args.host}:{args.port} (OpenAI API under /v1)")
    engine.start()
    if publisher is not None:
        publisher.start()
    try:
        uvicorn_server(app, host=args.host, port=args.port, log_level=args.log_level).run()
    finally:
        if publisher is not None:
            publisher.close()
        engine.shutdown()
    return 0


# ---------------------------------------------------------------------------- delegated
def _delegate(target: str) -> Command:
    """A subcommand whose parsing and work live in ``module:function(argv) -> int``."""
    module_name, func_name = target.split(":")

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(args: argparse.Namespace) -> int:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # a dependency of the module is missing: show the real error
            print(f"kvreuse: this subcommand needs {module_name}, which is not part of this build", file=sys.stderr)
            return 2
        return int(getattr(module, func_name)(args.argv) or 0)

    return Command(f"see 'kvreuse {{cmd}} --help' ({module_name})", add_arguments, run, passthrough=True)


COMMANDS: dict[str, Command] = {
    "serve": Command("serve the OpenAI-compatible API", add_serve_arguments, run_serve),
    "simulate": _delegate("kvreuse.router.sim_cli:simulate_main"),  # --executors N: routed; else kvreuse.simulator.cli
    "schema": _delegate("kvreuse.schema_cli:schema_main"),  # PML: precompute / list / delete
    "route": _delegate("kvreuse.router.cli:route_main"),
}


def build_parser(commands: dict[str, Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvreuse", description="LLM inference that never computes the same attention state twice"
    )
    from kvreuse import __version__

    parser.add_argument("--version", action="version", version=f"kvreuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in commands.items():
        p = sub.add_parser(name, help=command.help.replace("{cmd}", name), add_help=not command.passthrough)
        command.add_arguments(p)
        p.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS and COMMANDS[argv[0]].passthrough:
        # argparse cannot hand "--help" and friends to a REMAINDER positional: bypass it.
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return COMMANDS[argv[0]].run(argparse.Namespace(argv=argv[1:]))
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
