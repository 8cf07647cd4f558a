"""The ``kvreuse serve`` flags: their definitions and the engine config they build.

Every engine flag's default is the :class:`kvreuse.engine.config.EngineConfig` field it sets,
read when the parser is built; ``kvreuse.engine`` is imported only inside the functions, so
``kvreuse --help`` and the delegated subcommands never import torch through this module.
"""

from __future__ import annotations

import argparse

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from kvreuse.engine.config import KV_CACHE_DTYPES, EngineConfig as C  # defaults (imports no torch)

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
        "--kv-cache-dtype",
        default=C.kv_cache_dtype,
        choices=list(KV_CACHE_DTYPES),
        help="KV pool format: auto (the model's dtype), bfloat16, float16, float32, int8, or fp8 "
        "(= fp8_e4m3) / fp8_e5m2 (8-bit rows with one bf16 scale per token and KV head: ~1.9x the "
        "tokens of bf16 in the same memory; int8 is the recommended 8-bit format, docs/kv_cache_dtype.md)",
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
        help="shared tier (Redis/Valkey) for executors of the same model; redis+cluster://ANY_NODE:PORT "
        "(rediss+cluster:// with TLS) for a Redis Cluster / Valkey cluster; a down store costs a recompute",
    )
    p.add_argument(
        "--object-cache",
        default=C.object_cache,
        metavar="s3://BUCKET/PREFIX",
        help="object tier (any S3 API server) below disk and remote, shared by executors of the same "
        "model, kept across restarts; endpoint, credentials and region from the AWS_* environment "
        "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...); needs pip install 'kvreuse[s3]'",
    )
    p.add_argument(
        "--object-cache-ttl",
        type=float,
        default=C.object_cache_ttl_s,
        metavar="S",
        help="purge objects written more than S seconds ago",
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
        action=argparse.BooleanOptionalAction,
        default=C.deterministic,
        help="batch-invariant forward: a temperature-0 answer is the same on a prefix-cache miss or hit "
        "(any tier), alone or batched, with or without speculation (docs/deterministic.md); a plain "
        "Llama model only. Default: on where it costs about nothing (kvreuse's int4 kernels, bf16 "
        "on CPU), else off",
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
        "prompts chunked around it (0: no cap; default on CPU: 16, or 4 per decoding stream if more; "
        "2048 on CUDA)",
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


def engine_config(args: argparse.Namespace):
    """The ``EngineConfig`` the parsed ``kvreuse serve`` flags ask for; raises ``ValueError`` for a
    value the config refuses (it names the setting)."""
    from kvreuse.engine.llm_engine import EngineConfig

    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    return EngineConfig(
        model=args.model,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        device=args.device,
        quantization=args.quantization,
        kv_cache_memory_gib=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
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
        object_cache=args.object_cache,
        object_cache_ttl_s=args.object_cache_ttl,
        tier_write_through_min_priority=args.tier_write_through_min_priority,
        speculative_tokens=args.speculative_tokens,
        speculative_ngram_max=args.speculative_ngram,
        speculative_ngram_min=args.speculative_ngram_min,
        deterministic=args.deterministic,
        debug_step_faults=tuple(args.debug_step_faults),
        **extra,
    )
