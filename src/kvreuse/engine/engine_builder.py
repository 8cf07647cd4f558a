"""Building an engine's parts from its settings: ``build_engine`` -> ``EngineParts``.

Once, at start, in this order: the model (unless given), the KV layout and pool size, the
event buffer, the tiers below the device pool (``build_host_tier``: host, disk, remote), the
device pool and the prefix-cache manager over them (one ``CacheStack``), the scheduler, the
model runner (which allocates the KV tensor), the PML module cache (with the schemas a
schema store restores) and the document cache. ``LLMEngine`` wires what it owns on top.
Raises ``ValueError`` naming the setting when one cannot work (a pool that holds no block,
a malformed ``--remote-cache`` URL).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.eviction import make_policy
from kvreuse.cache.host_tier import HostTier, OffloadPolicy
from kvreuse.cache.kv_cache_manager import KVCacheManager, RetentionFn, request_retention
from kvreuse.engine import llama_forward as llama
from kvreuse.engine.allocator import keep_freed_memory
from kvreuse.engine.blend_pass import BlendPass
from kvreuse.engine.cache_stack import CacheStack
from kvreuse.engine.config import EngineConfig
from kvreuse.engine.document_cache import DocumentCache
from kvreuse.engine.kv_quant import KVFormat
from kvreuse.engine.kv_transfer import HostKVTransfer
from kvreuse.engine.model_runner import KVLayout, ModelRunner
from kvreuse.engine.prefill_pacer import PrefillPacer
from kvreuse.engine.scheduler import Scheduler, default_prefill_cap, default_prefill_per_decode
from kvreuse.events.buffer import EventBuffer
from kvreuse.pml.module_cache import ModuleCache, SchemaInfo
from kvreuse.pml.registration import RegistrationQueue
from kvreuse.pml.schema_cost import SchemaLimits
from kvreuse.pml.schema_store import SchemaStore

if TYPE_CHECKING:
    from kvreuse.models.loader import LoadedModel
    from kvreuse.tiers.persistent import PersistentTiers


@dataclass(frozen=True)
class EngineParts:
    """What ``build_engine`` made; every part is the engine's (engine thread only)."""

    loaded: LoadedModel
    max_model_len: int  # --max-model-len, else the model's
    layout: KVLayout
    kv_bytes_per_token: int
    cache: CacheStack
    scheduler: Scheduler
    runner: ModelRunner
    blend_pass: BlendPass
    modules: ModuleCache  # PML schemas: module KV precomputed into the pool
    documents: DocumentCache  # schema-free documents: KV computed once, moved to each request's positions
    registrations: RegistrationQueue  # schemas registered while serving, a slice between steps
    restored_schemas: list[SchemaInfo]  # schemas a schema store restored at start
    pacer: PrefillPacer  # lets decodes step between the chunks of a context pass (the engine loop attaches it)


def build_engine(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    *,
    events: EventBuffer | None = None,
    retention_fn: RetentionFn | None = None,
) -> EngineParts:
    """Every part of an engine for ``config`` (``loaded``: a model already loaded; ``events``:
    an event buffer to report to, else one of ``--event-buffer-max-size`` unless that is 0;
    ``retention_fn``: how a request's retention maps to block priorities). Seeds torch's RNG
    with ``config.seed`` last."""
    from kvreuse.models.loader import load_model  # heavy import kept off the router's path

    if loaded is None:
        loaded = load_model(config.model, dtype=config.dtype, device=config.device, quantization=config.quantization)
    shape = loaded.shape
    layout = KVLayout(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        sliding_windows=tuple(sorted({w for w in shape.sliding_window if w is not None})),
    )
    kv_format = KVFormat.resolve(config.kv_cache_dtype, loaded.dtype)
    deterministic = deterministic_with(
        kv_format, llama.resolve_deterministic(config.deterministic, loaded.model), config.deterministic
    )
    # blocks of another KV format, or of the other arithmetic, never share a key
    loaded = kv_identity(loaded, kv_format, deterministic)
    kv_bytes_per_token = kv_format.bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim)
    bytes_per_block = kv_bytes_per_token * config.block_size
    num_blocks = int(config.kv_cache_memory_gib * 2**30) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"--kv-cache-memory {config.kv_cache_memory_gib} GiB holds no block of {bytes_per_block} bytes"
        )
    if events is None and config.event_buffer_max_size > 0:
        events = EventBuffer(config.event_buffer_max_size)  # None = events off (TensorRT-LLM's default)
    host = build_host_tier(config, layout, loaded, events, bytes_per_block, kv_format)
    pool = BlockPool(
        num_blocks,
        config.block_size,
        policy=make_policy(config.eviction_policy, num_blocks=num_blocks),
        events=events,
        record_evictions=host is not None,
        kv_cache_dtype=kv_format.name,
    )
    kv = KVCacheManager(
        pool,
        lower=host,
        model_id=loaded.model_id,
        hash_algorithm=config.hash_algorithm,
        enable_prefix_caching=config.enable_prefix_caching,
        retention_fn=retention_fn or request_retention,
    )
    runner = ModelRunner(
        loaded.model,
        layout,
        num_blocks,
        config.block_size,
        deterministic=deterministic,
        kv_cache_dtype=kv_format.name,
    )
    scheduler = Scheduler(
        kv,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=default_prefill_cap(
            config.max_prefill_tokens_while_decoding, runner.device.type
        ),
        prefill_tokens_per_decode=default_prefill_per_decode(
            config.max_prefill_tokens_while_decoding, runner.device.type
        ),
    )
    if host is not None:  # its bytes move through the runner's KV tensor
        host.mover = HostKVTransfer(runner.kv_cache, host.pool.num_blocks, config.block_size)
    if runner.device.type == "cpu":
        keep_freed_memory()  # no page faults on activations after a long prefill
    gc.freeze()  # the model's objects never die: keep them out of every later GC pass (as vLLM does)
    max_model_len = config.max_model_len or shape.max_model_len
    modules = ModuleCache(
        kv,
        runner,
        loaded.tokenizer,
        model_id=loaded.model_id,
        hash_algorithm=config.hash_algorithm,
        chunk_tokens=min(config.schema_slice_tokens, config.max_num_batched_tokens),
        store=None if config.schema_dir is None else SchemaStore(config.schema_dir, loaded.model_id),
        src_dir=config.schema_src_dir,
        max_model_len=max_model_len,
        limits=SchemaLimits(config.schema_max_tokens, config.schema_max_bytes),
        kv_bytes_per_token=kv_bytes_per_token,
    )
    # context passes (documents, evicted modules) yield to decodes; the engine loop attaches it
    pacer = PrefillPacer(scheduler.max_prefill_tokens_while_decoding, scheduler.prefill_tokens_per_decode)
    modules.between_chunks = pacer.between
    documents = DocumentCache(
        kv,
        runner,
        model_id=loaded.model_id,
        hash_algorithm=config.hash_algorithm,
        chunk_tokens=config.max_num_batched_tokens,
        pacer=pacer,
    )
    registrations = RegistrationQueue(config.schema_slice_tokens)
    restored = modules.load_store()  # schemas persisted by an earlier run
    parts = EngineParts(
        loaded,
        max_model_len,
        layout,
        kv_bytes_per_token,
        CacheStack(kv, host, events),
        scheduler,
        runner,
        BlendPass(runner),
        modules,
        documents,
        registrations,
        restored,
        pacer,
    )
    torch.manual_seed(config.seed)
    return parts


def deterministic_with(kv_format: KVFormat, deterministic: bool, requested: bool | None) -> bool:
    """Whether the batch-invariant forward keeps its promise with this pool: it reads keys as the
    pool holds them on every path only when the pool is in the model's dtype or 8-bit rows (a
    float16 / float32 pool under a bf16 model took one path on a miss and another on a hit, and
    the answers differed). The default (None) turns the mode off for such a pool; asking for it
    raises ValueError naming the settings."""
    if not deterministic or kv_format.quantized or kv_format.storage_dtype == kv_format.compute_dtype:
        return deterministic
    if requested:
        model_dtype = str(kv_format.compute_dtype).removeprefix("torch.")
        raise ValueError(
            f"--deterministic needs --kv-cache-dtype auto, int8 or fp8 for a {model_dtype} model "
            f"(got {kv_format.name}: its keys are read through another path on a cache hit)"
        )
    return False


def kv_identity(loaded: LoadedModel, kv_format: KVFormat, deterministic: bool = False) -> LoadedModel:
    """``loaded`` with the KV format (and the batch-invariant arithmetic, ``deterministic``) folded
    into its fingerprint and ``model_id`` (what every block key, tier namespace, schema store and
    router index derive from), so a block of one format never matches in a pool, tier, index or
    shared store of another, and a deterministic engine never reads KV another arithmetic wrote
    (a hit would not give the miss's answer). ``loaded`` itself when the pool holds the model's
    own dtype and the forward is the fast one (ids unchanged from before either existed)."""
    parts = [p for p in (kv_format.identity, "batch-invariant" if deterministic else None) if p is not None]
    if not parts:
        return loaded
    full = hashlib.sha256("\0".join([loaded.fingerprint, *parts]).encode()).hexdigest()
    return dataclasses.replace(loaded, model_id=f"{loaded.name}@sha256:{full[:16]}", fingerprint=full)


def build_host_tier(
    config: EngineConfig,
    layout: KVLayout,
    loaded: Any,
    events: EventBuffer | None,
    bytes_per_block: int,
    kv_format: KVFormat,
) -> HostTier | None:
    """The host tier (with the disk / remote stores below it), or ``None`` when
    ``--host-cache-memory`` holds no block. Its ``mover`` is set once the runner exists.
    Raises ``ValueError`` for a malformed ``--remote-cache`` URL."""
    num_host_blocks = int(config.host_cache_memory_gib * 2**30) // bytes_per_block
    if num_host_blocks <= 0:
        return None
    return HostTier(
        num_host_blocks,
        config.block_size,
        events=events,
        below=build_stores(config, layout, loaded, kv_format),
        policy=make_policy(config.eviction_policy, num_blocks=num_host_blocks),
        offload_policy=OffloadPolicy(config.host_offload_min_priority),
    )


def build_stores(config: EngineConfig, layout: KVLayout, loaded: Any, kv_format: KVFormat) -> PersistentTiers | None:
    """The disk / remote / object stores below the host tier, or ``None`` when none is set."""
    if config.disk_cache_dir is None and config.remote_cache is None and config.object_cache is None:
        return None
    from kvreuse.tiers.disk_store import DiskStore
    from kvreuse.tiers.namespace import TierNamespace
    from kvreuse.tiers.persistent import PersistentTiers
    from kvreuse.tiers.remote_store import RemoteStore

    namespace = TierNamespace(loaded.fingerprint, config.hash_algorithm, config.block_size)
    disk = (
        None
        if config.disk_cache_dir is None
        else DiskStore(
            config.disk_cache_dir,
            int(config.disk_cache_size_gib * 2**30),
            namespace=namespace,
            ttl_s=config.disk_cache_ttl_s,
        )
    )
    remote = None if config.remote_cache is None else RemoteStore(config.remote_cache, namespace=namespace)
    objects = None if config.object_cache is None else build_object_store(config, namespace)
    row = kv_format.row_width(layout.head_dim)  # the pool's bytes per (token, head): int8 rows carry their scale
    shape = (layout.num_layers, 2, layout.num_kv_heads, config.block_size, row)
    return PersistentTiers(
        namespace,
        shape,
        kv_format.storage_dtype,
        disk=disk,
        remote=remote,
        objects=objects,
        write_through_min_priority=config.tier_write_through_min_priority,
    )


def build_object_store(config: EngineConfig, namespace: Any) -> Any:
    """The ``--object-cache`` store (``tiers.object_store.ObjectStore``), purging objects past
    ``--object-cache-ttl`` in the background. Raises ``ValueError`` naming the flag for a
    malformed URL or without the AWS SDK; a bucket it cannot reach now is only warned about."""
    try:
        from kvreuse.tiers.object_store import ObjectStore
    except ImportError as exc:  # boto3 is the optional extra `s3`
        raise ValueError(f"--object-cache needs the AWS SDK: pip install 'kvreuse[s3]' ({exc})") from None
    store = ObjectStore(config.object_cache or "", namespace=namespace, ttl_s=config.object_cache_ttl_s)
    store.check_bucket()
    if config.object_cache_ttl_s is not None:
        store.start_purging()
    return store
