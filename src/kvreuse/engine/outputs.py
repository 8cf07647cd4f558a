"""What the engine hands back: one ``RequestOutput`` per request per step, ``EngineStats``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreuse.engine.logprobs import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # cumulative
    new_token_ids: list[int]  # sampled this step
    text: str  # cumulative, stop strings cut
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (then ``error`` says why)
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    # With SamplingParams(logprobs=k), one entry per output token (cumulative / this step's);
    # None otherwise. The raw model distribution, before temperature (kvreuse.engine.logprobs).
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    # num_cached_tokens per tier it came from (GPU = device pool, CPU = host, DISK, REMOTE);
    # None when the engine has no tier below the device pool
    cached_tokens_by_tier: dict[str, int] | None = None
    # assembled (PML module, document) tokens blend recomputed for this request (0: no blend)
    num_recomputed_tokens: int = 0
    # Prompt lookup: draft tokens verified for this request so far, and how many were accepted
    # (0 and 0 when it does not speculate); accepted tokens cost no forward of their own.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Set (with finished=True, finish_reason="error") when this request alone failed in a step
    # (its forward or post-processing raised; engine/forward_isolation.py): "<ExceptionType>: message".
    # AsyncEngine hands it to this request's caller as EngineError; the other requests go on.
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.output_token_ids


@dataclass
class EngineStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_running: int
    num_waiting: int
    evictions_by_priority: dict[int, int] = field(default_factory=dict)
    blocks_by_priority: dict[int, int] = field(default_factory=dict)
    num_preemptions: int = 0
    tokens_computed: int = 0
    events_dropped: int | None = None  # None when events are off
    prefix_cache_hits_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # GPU / CPU / DISK / REMOTE
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)  # per lower tier: its counters and gauges
    schema_store_refused: dict[str, int] = field(default_factory=dict)  # --schema-dir files refused, by reason
    schema_modules_filled: dict[str, int] = field(default_factory=dict)  # modules put in the pool: computed / loaded
    schema_slices: int = 0  # engine steps that ran a slice of a schema registration
    schemas_registering: int = 0  # registrations queued or in progress
    tokens_computed_modules: int = 0  # of tokens_computed, those of module precompute
    seam_repair_tokens: int = 0  # assembled tokens recomputed by blend (every acquisition; the published name)
    spec_decode_num_draft_tokens: int = 0  # prompt lookup: drafted tokens verified
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted
    document_tokens_computed: int = 0  # of tokens_computed, documents' (with the text they are encoded after)
    document_tokens_reused: int = 0  # document tokens found cached when a request acquired its documents
