"""The ``kvreuse`` command: ``serve``, plus subcommands other modules own.

Subcommands are a table (name -> help, argument builder, runner); a delegated subcommand
imports its module only when it runs, so ``kvreuse serve`` never imports the simulator
and ``kvreuse simulate`` never imports torch through us.
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
def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from kvreuse.engine.config import EngineConfig as C  # every engine flag's default (imports no torch)

    p.add_argument(
        "--model",
        default=C.model,
        help="alias (default, smollm2, gemma3-270m), HF folder, .gguf path, or tiny:llama|tiny:gemma3",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=C.kv_cache_memory_gib,
        metavar="GIB",
        help="KV pool size in GiB (fractions allowed)",
    )
    p.add_argument(
        "--host-cache-memory",
        type=float,
        default=C.host_cache_memory_gib,
        metavar="GIB",
        help="host tier below the KV pool, in GiB (0: off): evicted blocks are kept there, not dropped",
    )
    p.add_argument(
        "--host-offload-min-priority",
        type=int,
        default=C.host_offload_min_priority,
        metavar="P",
        help="evicted blocks of retention priority >= P go to the host tier (TensorRT-LLM's default 35)",
    )
    p.add_argument(
        "--disk-cache-dir",
        default=C.disk_cache_dir,
        metavar="DIR",
        help="disk tier below the host tier: blocks the host evicts (and new ones, see "
        "--tier-write-through-min-priority) are kept in DIR and found again after a restart",
    )
    p.add_argument(
        "--disk-cache-size",
        type=float,
        default=C.disk_cache_size_gib,
        metavar="GIB",
        help="disk tier cap (LRU beyond it)",
    )
    p.add_argument(
        "--disk-cache-ttl",
        type=float,
        default=C.disk_cache_ttl_s,
        metavar="S",
        help="purge disk blocks idle for S seconds",
    )
    p.add_argument(
        "--remote-cache",
        default=C.remote_cache,
        metavar="redis://HOST:PORT/DB",
        help="shared tier (Redis/Valkey) for executors of the same model; a down store costs a recompute",
    )
    p.add_argument(
        "--tier-write-through-min-priority",
        type=int,
        default=C.tier_write_through_min_priority,
        metavar="P",
        help="newly computed blocks of priority >= P are written to the disk/remote tiers at once "
        "(101: only what the host tier evicts)",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=C.speculative_tokens,
        metavar="K",
        help="prompt lookup (n-gram) speculative decoding: draft up to K tokens per greedy decode step "
        "from the prompt and output so far, verified in one forward; same output (0: off). "
        "Sampled (temperature > 0) requests never speculate; a request opts out with "
        "\"speculative\": false",
    )
    p.add_argument(
        "--speculative-ngram",
        type=int,
        default=C.speculative_ngram_max,
        metavar="N",
        help="prompt lookup: longest n-gram matched (tried first, down to --speculative-ngram-min)",
    )
    p.add_argument(
        "--speculative-ngram-min",
        type=int,
        default=C.speculative_ngram_min,
        metavar="N",
        help="prompt lookup: shortest n-gram matched",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=C.deterministic,
        help="batch-invariant kernels: a temperature-0 answer is the same on a prefix-cache miss or hit "
        "(any tier), alone or batched, with or without speculation; costs speed "
        "(docs/deterministic.md); a plain Llama model only",
    )
    p.add_argument(
        "--block-size", type=int, default=C.block_size, help="tokens per KV block (the unit of prefix reuse)"
    )
    p.add_argument(
        "--dtype",
        default=C.dtype,
        choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "auto"],
        help="weights, activations and KV (auto: bfloat16 on CPUs with native bf16 and on any CPU "
        "with --quantization int8|int4, else float32)",
    )
    p.add_argument(
        "--quantization",
        default=C.quantization,
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantization of the linear layers (auto: as compact as the GGUF file on CPU, "
        "Q4 -> int4, Q8_0 -> int8; none for float weights, with --dtype float32 and off the CPU. "
        "--dtype float32 --quantization none is the exact reference)",
    )
    p.add_argument("--device", default=C.device, choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    p.add_argument("--max-model-len", type=int, default=C.max_model_len, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=C.max_num_seqs, help="requests running at once (more wait)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens per engine step; longer prompts are prefilled in chunks (default: {C.max_num_batched_tokens})",
    )
    p.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=C.max_prefill_tokens_while_decoding,
        metavar="N",
        help="prefill tokens an engine step may carry while any stream decodes in it: decode first, "
        "prompts chunked around it (0: no cap; default: 64 on CPU, 2048 on CUDA)",
    )
    p.add_argument(
        "--eviction-policy",
        default=C.eviction_policy,
        help="lru | priority (TensorRT-LLM; LRU when requests carry no retention) | 2q | logfreq (hint-free)",
    )
    p.add_argument(
        "--prefix-hash-algorithm",
        default=C.hash_algorithm,
        choices=["sha256", "xxh3_64"],
        help="block key hash (xxh3_64 is faster, not collision-resistant)",
    )
    p.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=C.enable_prefix_caching,
        help="compute every prompt afresh (a baseline)",
    )
    p.add_argument("--seed", type=int, default=C.seed, help="sampling seed for requests that give none")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY[:TENANT]",
        help="require 'Authorization: Bearer KEY' on /v1/*, /openapi.json and /tokenize, /detokenize, "
        "/reset_prefix_cache (repeat for more keys; KEY:TENANT keys get the tenant's cache salt "
        "and no admin routes)",
    )
    p.add_argument(
        "--metrics-tenant-labels",
        action="store_true",
        help="show tenant names and usage on /metrics to every scraper (default: only with an admin "
        "key; others see sums over tenants, tenant=\"(all)\")",
    )
    from kvreuse.api.tenant_limits import add_arguments as add_tenant_limit_arguments

    add_tenant_limit_arguments(p)  # --tenant-limits, --tenant-max-in-flight, --tenant-tokens-per-minute
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use (default: the model's)")
    p.add_argument(
        "--cache-control-priorities",
        default=None,
        metavar="KIND=P,...",
        help="retention priority of what a cache_control breakpoint covers on /v1/messages (kinds tools, "
        "system, document, history; default tools=95,system=85,document=50,history=40)",
    )
    p.add_argument(
        "--cache-control-ttls",
        default=None,
        metavar="TTL=SECONDS,...",
        help="how long a breakpoint's priority holds, per ttl (default 5m=300,1h=3600)",
    )
    # 8 MiB: kvreuse.api.middleware.DEFAULT_MAX_BODY_BYTES (not imported: the CLI imports lazily)
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies get a 413")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the context length")
    p.add_argument(
        "--event-buffer-max-size",
        type=int,
        default=C.event_buffer_max_size,
        help="KV events kept for consumers (0: events off unless an endpoint is set)",
    )
    from kvreuse.events.zmq_options import add_arguments as add_kv_event_arguments

    add_kv_event_arguments(p)  # --kv-events-endpoint, -replay-endpoint, -bind-host, -curve-*, -no-token-ids
    p.add_argument(
        "--schema-dir",
        default=C.schema_dir,
        help="PML: persist module KV here and load it at start instead of recomputing",
    )
    p.add_argument(
        "--schema-src-dir",
        default=C.schema_src_dir,
        help="PML: folder that <module src=...> paths in POSTed or stored schemas are read from "
        "(relative paths inside it only; without it src= is refused)",
    )
    p.add_argument(
        "--schema-slice-tokens",
        type=int,
        default=C.schema_slice_tokens,
        help="PML: module precompute tokens a schema registration runs per engine step, between "
        f"the steps of the requests in flight (default: {C.schema_slice_tokens})",
    )
    p.add_argument(
        "--schema-max-tokens",
        type=int,
        default=C.schema_max_tokens,
        help="PML: refuse (400) a schema whose modules' precompute passes run more tokens "
        f"(default: {C.schema_max_tokens})",
    )
    p.add_argument(
        "--schema-max-bytes",
        type=int,
        default=C.schema_max_bytes,
        help=f"PML: refuse (400) a schema whose modules' KV takes more bytes in the pool (default: "
        f"{C.schema_max_bytes})",
    )
    # a request's "blend" overrides these; one set for PML modules, one for schema-free documents
    for field, what, unit in (
        ("blend", "PML blend", "assembled module"),
        ("document_blend", "schema-free documents' blend", "document"),
    ):
        flag = "--" + field.replace("_", "-")
        p.add_argument(
            f"{flag}-first-tokens",
            type=int,
            default=getattr(C, f"{field}_first_tokens"),
            help=f"{what}: leading tokens of each {unit} recomputed against the assembled context "
            f"(default: {getattr(C, f'{field}_first_tokens')})",
        )
        p.add_argument(
            f"{flag}-ratio",
            type=float,
            default=getattr(C, f"{field}_ratio"),
            help=f"{what}: share of the {unit}s' tokens, those whose KV deviates most, recomputed "
            f"against the assembled context, in [0, 1] (default: {getattr(C, f'{field}_ratio')})",
        )
        p.add_argument(
            f"{flag}-last-tokens",
            type=int,
            default=getattr(C, f"{field}_last_tokens"),
            help=f"{what}: trailing tokens of each {unit} (right before a seam) recomputed "
            f"(default: {getattr(C, f'{field}_last_tokens')}; all three 0: off)",
        )
    p.add_argument(
        "--debug-step-fault",
        dest="debug_step_faults",
        action="append",
        default=[],
        metavar="STAGE:PREFIX[@N]",
        help="TEST ONLY, never on a server that serves clients: fail the engine step of every request "
        "whose id starts with PREFIX (the body's request_id) once it has N tokens, at STAGE "
        "forward|sample (engine/step_faults.py); only that request errors",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DEFAULT_EVENT_BUFFER = 100_000  # when an endpoint is given without --event-buffer-max-size


def _load_model(spec: str, dtype: str, device: str, quantization: str = "none") -> LoadedModel:
    """A ``LoadedModel``; ``tiny:<arch>`` builds the random-weight test model.
    Raises ``ValueError`` for an unknown spec, dtype or device."""
    if spec.startswith(TINY_PREFIX):
        from kvreuse.models.tiny import tiny_model

        return tiny_model(spec[len(TINY_PREFIX) :], dtype=dtype, device=device, quantization=quantization)
    from kvreuse.models.loader import load_model

    return load_model(spec, dtype=dtype, device=device, quantization=quantization)


def _engine_config(args: argparse.Namespace):
    from kvreuse.engine.llm_engine import EngineConfig

    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    return EngineConfig(
        model=args.model,
        dtype=_DTYPE_ALIASES.get(args.dtype, args.dtype),
        device=args.device,
        quantization=args.quantization,
        kv_cache_memory_gib=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        hash_algorithm=args.prefix_hash_algorithm,
        eviction_policy=args.eviction_policy,
        event_buffer_max_size=args.event_buffer_max_size,
        seed=args.seed,
        schema_dir=args.schema_dir,
        schema_src_dir=args.schema_src_dir,
        host_cache_memory_gib=args.host_cache_memory,
        schema_slice_tokens=args.schema_slice_tokens,
        schema_max_tokens=args.schema_max_tokens,
        schema_max_bytes=args.schema_max_bytes,
        **{
            f"{field}_{knob}": getattr(args, f"{field}_{knob}")
            for field in ("blend", "document_blend")
            for knob in ("first_tokens", "ratio", "last_tokens")
        },
        host_offload_min_priority=args.host_offload_min_priority,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_size_gib=args.disk_cache_size,
        disk_cache_ttl_s=args.disk_cache_ttl,
        remote_cache=args.remote_cache,
        tier_write_through_min_priority=args.tier_write_through_min_priority,
        speculative_tokens=args.speculative_tokens,
        speculative_ngram_max=args.speculative_ngram,
        speculative_ngram_min=args.speculative_ngram_min,
        deterministic=args.deterministic,
        debug_step_faults=tuple(args.debug_step_faults),
        **extra,
    )


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
    from kvreuse.models.loader import dtype_name

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
    "serve": Command("serve the OpenAI-compatible API", _add_serve_arguments, run_serve),
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
