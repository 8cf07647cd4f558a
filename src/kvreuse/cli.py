"""The ``kvreuse`` command: ``serve``, plus subcommands other modules own.

Subcommands are a table (name -> help, argument builder, runner); a delegated subcommand
imports its module only when it runs, so ``kvreuse serve`` never imports the simulator
and ``kvreuse simulate`` never imports torch through us. The ``serve`` flags and the engine
config they build are :mod:`kvreuse.serve_args`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvreuse.serve_args import (
    add_serve_arguments,
    engine_config as _engine_config,  # the tests' name for it
)
from kvreuse.serve_build import TINY_PREFIX, build_executor, load_model_spec, off_main_thread, pool_summary

logger = logging.getLogger("kvreuse")

__all__ = ["TINY_PREFIX", "_engine_config", "main"]


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False  # the target parses its own arguments (``--help`` included)


# ---------------------------------------------------------------------------- serve
# the tests' and schema_cli's names for the builder's parts (kvreuse.serve_build)
_load_model = load_model_spec
_off_main_thread = off_main_thread
_pool_summary = pool_summary


def run_serve(args: argparse.Namespace) -> int:
    """Build the executor (``kvreuse.serve_build``: model, engine, publisher with
    ``--kv-events-endpoint``, app), start the engine and the publisher, serve until
    interrupted, then close both. Returns the exit status (2 for a bad flag or model)."""
    from rich.console import Console

    from kvreuse.api.access_log import uvicorn_server
    from kvreuse.events import zmq_options

    console = Console(stderr=True, soft_wrap=True)  # no wrapping: log lines stay greppable
    try:
        built = build_executor(args, status=console.status)
    except ValueError as exc:
        console.print(f"[bold red]kvreuse serve:[/] {exc}")
        return 2
    app, engine, publisher, loaded = built.app, built.engine, built.publisher, built.loaded
    names = ", ".join(app.state.ctx.served_model_names)
    from kvreuse.models.placement import dtype_name
    from kvreuse.models.quant import kept_from_file

    quant = loaded.quantization.value
    kept = kept_from_file(loaded.model)
    console.print(
        # the engine's model_id: the KV format and the deterministic mode are folded into it
        f"kvreuse: model [bold]{loaded.name}[/] ({engine.facts.model_id}) on {loaded.device}, "
        f"{dtype_name(loaded.dtype)}"
        + ("" if quant == "none" else f", {quant} weights on {loaded.kernels} kernels")
        + (f" (the file's {' and '.join(kept)} kept)" if kept else "")
        + (", deterministic (a cache hit gives the miss's answer)" if engine.facts.deterministic else "")
        + f", context {engine.max_model_len} tokens, served as {names}"
    )
    console.print(f"kvreuse: {_pool_summary(engine.engine)}")
    if publisher is not None:
        console.print(
            # a tcp://HOST:PORT with a concrete host connects (vLLM's rule): say which, subscribers need a bind
            f"kvreuse: KV events {'bound on' if publisher.bound else 'connecting to'} {publisher.endpoint}"
            + (f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
            + (", CURVE" if publisher.curve else "")
            + ("" if publisher.include_token_ids else ", no token ids")
        )
        if warning := zmq_options.seal_warning(publisher, api_keys=bool(args.api_key)):
            console.print(f"[bold yellow]kvreuse: warning:[/] {warning}")
    console.print(f"kvreuse: listening on http://{args.host}:{args.port} (OpenAI API under /v1)")
    built.start()
    try:
        uvicorn_server(app, host=args.host, port=args.port, log_level=args.log_level).run()
    finally:
        built.close()
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
    "ray": _delegate("kvreuse.ray_serve.cli:ray_main"),  # replicas on Ray Serve (pip install kvreuse[ray])
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
