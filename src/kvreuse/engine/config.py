"""``EngineConfig``: every engine setting, one per ``kvreuse serve`` flag, validated where built."""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.engine.blend import Blend
from kvreuse.engine.step_faults import StepFaults
from kvreuse.pml.schema_cost import DEFAULT_MAX_BYTES, DEFAULT_MAX_TOKENS

# --kv-cache-dtype (vLLM's flag name and format names; fp8 = fp8_e4m3): engine/kv_quant.py
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; each maps to a ``kvreuse serve`` flag of the same name."""

    model: str = "default"
    # auto/auto: the fastest setting that passes the quality guard (tests/models/test_quant.py):
    # a GGUF's linear layers stay as compact as in the file (Q4 -> int4), bf16 activations on CPU.
    # float32 / none is the exact reference (prefix reuse within 1e-4).
    dtype: str = "auto"
    quantization: str = "auto"  # weight-only: auto | none | int8 | int4 (kvreuse.models.quant)
    device: str = "auto"
    kv_cache_memory_gib: float = 1.0
    # the pool's format (engine/kv_quant.py): auto = the model's dtype; int8 holds ~1.9x the
    # tokens of bf16 in the same --kv-cache-memory (one bf16 scale per token and KV head)
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    # prefill tokens a step may carry while any stream decodes in it (decode first; 0: no cap;
    # None: per device, engine/scheduler.default_prefill_cap)
    max_prefill_tokens_while_decoding: int | None = None
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256"
    eviction_policy: str = "priority"  # TensorRT-LLM; without retention hints it is LRU
    event_buffer_max_size: int = 0
    seed: int = 0
    schema_dir: str | None = None  # PML: persist module KV here (safetensors), reload on restart
    schema_src_dir: str | None = None  # PML: folder that <module src=...> paths are read from
    schema_slice_tokens: int = 64  # PML: module precompute tokens run per engine step while registering
    schema_max_tokens: int | None = DEFAULT_MAX_TOKENS  # PML: largest schema, in precompute tokens (None: no limit)
    schema_max_bytes: int | None = DEFAULT_MAX_BYTES  # PML: largest schema, in KV bytes in the pool (None: no limit)
    host_cache_memory_gib: float = 0.0  # host tier below the device pool (0 = off)
    host_offload_min_priority: int = 35  # evicted device blocks of this priority or more go to the host
    disk_cache_dir: str | None = None  # disk tier below the host tier (None = off)
    disk_cache_size_gib: float = 10.0
    disk_cache_ttl_s: float | None = None  # idle seconds before a disk block is purged (None = never)
    remote_cache: str | None = None  # redis://HOST:PORT/DB shared by executors of the same model (None = off)
    object_cache: str | None = None  # s3://BUCKET/PREFIX below disk and remote, shared too (None = off)
    object_cache_ttl_s: float | None = None  # seconds since an object's write before it is purged (None = never)
    tier_write_through_min_priority: int = 35  # newly computed blocks this priority or more go to disk/remote at once
    blend_first_tokens: int = 0  # blend: leading tokens of each assembled module recomputed (0: none)
    blend_ratio: float = 0.0  # blend: share of assembled tokens recomputed by KV deviation, in [0, 1]
    blend_last_tokens: int = 0  # blend: trailing tokens of each assembled module recomputed (0: none)
    # the same for schema-free documents (a DocumentPrompt, chat messages marked as documents):
    # on by default, the setting bench/blend_quality.py chose (docs/benchmarks.md, issue 14): the first
    # and last token of each document; over 800 questions a deviation ratio of 0.1 on top bought no
    # measurable quality (pair-set accuracy 46.9% vs 46.8%) for ~5x the TTFT
    document_blend_first_tokens: int = 1
    document_blend_ratio: float = 0.0
    document_blend_last_tokens: int = 1
    speculative_tokens: int = 0  # prompt lookup: tokens drafted per greedy decode step (0 = off)
    speculative_ngram_max: int = 4  # prompt lookup: longest n-gram matched (tried first)
    speculative_ngram_min: int = 2  # prompt lookup: shortest n-gram matched
    # batch-invariant forward: a temperature-0 answer is the same on a prefix-cache miss or hit,
    # alone or batched, with or without speculation (docs/deterministic.md). None (auto): on where
    # it costs about nothing (a plain Llama on kvreuse's int4 kernels, bf16 on CPU), else off
    deterministic: bool | None = None
    # test-only: "STAGE:REQUEST_ID_PREFIX" step failures to inject (engine/step_faults.py); never in serving
    debug_step_faults: tuple[str, ...] = ()

    @property
    def blend(self) -> Blend:
        """The blend a PML request gets when it asks for none (``--blend-*``)."""
        return Blend(self.blend_first_tokens, self.blend_ratio, last_tokens=self.blend_last_tokens)

    @property
    def document_blend(self) -> Blend:
        """The blend a documents request gets when it asks for none (``--document-blend-*``)."""
        return Blend(
            self.document_blend_first_tokens, self.document_blend_ratio, last_tokens=self.document_blend_last_tokens
        )

    def __post_init__(self) -> None:
        for prefix, attr in (("--blend-", "blend"), ("--document-blend-", "document_blend")):
            try:
                getattr(self, attr)
            except ValueError as exc:  # name the flags, not the request field
                raise ValueError(
                    str(exc)
                    .replace("blend.first_tokens", prefix + "first-tokens")
                    .replace("blend.ratio", prefix + "ratio")
                    .replace("blend.last_tokens", prefix + "last-tokens")
                ) from None
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(f"--kv-cache-memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"--block-size must be in [1, 1024], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 0:
            raise ValueError(
                "--max-prefill-tokens-while-decoding must be >= 0 (0: no cap), got "
                f"{self.max_prefill_tokens_while_decoding}"
            )
        if self.schema_slice_tokens < 1:
            raise ValueError(f"--schema-slice-tokens must be >= 1, got {self.schema_slice_tokens}")
        for flag, value in (
            ("--schema-max-tokens", self.schema_max_tokens),
            ("--schema-max-bytes", self.schema_max_bytes),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.host_cache_memory_gib >= 0:
            raise ValueError(f"--host-cache-memory must be >= 0 GiB (0 = off), got {self.host_cache_memory_gib}")
        stores = (self.disk_cache_dir, self.remote_cache, self.object_cache)
        if any(store is not None for store in stores) and not self.host_cache_memory_gib > 0:
            raise ValueError(
                "--disk-cache-dir, --remote-cache and --object-cache sit below the host tier: "
                "set --host-cache-memory GIB > 0 as well"
            )
        if self.object_cache_ttl_s is not None and not self.object_cache_ttl_s > 0:
            raise ValueError(f"--object-cache-ttl must be > 0 seconds, got {self.object_cache_ttl_s}")
        if not self.disk_cache_size_gib > 0:
            raise ValueError(f"--disk-cache-size must be > 0 GiB, got {self.disk_cache_size_gib}")
        if not 0 <= self.tier_write_through_min_priority <= 101:
            raise ValueError(
                "--tier-write-through-min-priority must be in [0, 101] (101: only blocks the host "
                f"tier evicts), got {self.tier_write_through_min_priority}"
            )
        if not 0 <= self.speculative_tokens <= 32:
            raise ValueError(f"--speculative-tokens must be in [0, 32] (0 = off), got {self.speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "--speculative-ngram-min must be >= 1 and <= --speculative-ngram-max, got "
                f"{self.speculative_ngram_min} and {self.speculative_ngram_max}"
            )
        StepFaults.parse(self.debug_step_faults)  # raises naming --debug-step-fault
        if not 0 <= self.host_offload_min_priority <= 101:
            raise ValueError(
                f"--host-offload-min-priority must be in [0, 101] (101: never), got {self.host_offload_min_priority}"
            )
