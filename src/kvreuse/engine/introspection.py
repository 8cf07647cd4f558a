"""What an engine reports about itself: its counters (``engine_stats``) and the consistency
check tests and the server call between steps (``check_engine_integrity``).

Both read the parts an ``EngineView`` names (``LLMEngine`` has them) and change nothing; call
them on the engine's thread, between steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from kvreuse.engine.outputs import EngineStats

if TYPE_CHECKING:
    from kvreuse.engine.cache_stack import CacheStack
    from kvreuse.engine.document_cache import DocumentCache
    from kvreuse.engine.output_processor import OutputProcessor
    from kvreuse.engine.prompt_intake import PromptIntake
    from kvreuse.engine.scheduler import Scheduler
    from kvreuse.engine.schema_service import SchemaService
    from kvreuse.engine.sequence import Sequence
    from kvreuse.pml.module_cache import ModuleCache


class EngineView(Protocol):
    """The parts of an engine its stats and integrity check read."""

    cache: CacheStack
    scheduler: Scheduler
    modules: ModuleCache
    schemas: SchemaService
    documents: DocumentCache
    intake: PromptIntake
    outputs: OutputProcessor
    kv_bytes_per_token: int
    block_size: int

    def requests(self) -> Iterable[Sequence]: ...


def engine_stats(engine: EngineView) -> EngineStats:
    """A snapshot of the engine's counters and gauges (the server's /metrics reads these)."""
    cache, modules, registrations = engine.cache, engine.modules, engine.schemas.registrations
    pool, kv, outputs = cache.pool, cache.kv, engine.outputs
    return EngineStats(
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks - pool.num_cached_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        num_used_blocks=pool.num_used_blocks,
        prefix_cache_queries_tokens=kv.queries_tokens,
        prefix_cache_hits_tokens=kv.hits_tokens,
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        evictions_by_priority=dict(pool.evictions_by_priority),
        blocks_by_priority=dict(pool.blocks_by_priority()),
        num_preemptions=engine.scheduler.num_preemptions,
        tokens_computed=(
            outputs.tokens_computed
            + engine.intake.blend_tokens
            + modules.tokens_computed
            + engine.documents.tokens_computed
        ),
        events_dropped=None if cache.events is None else cache.events.num_dropped,
        prefix_cache_hits_tokens_by_tier=dict(kv.hits_tokens_by_level),
        tiers=cache.tier_stats(engine.kv_bytes_per_token * engine.block_size),
        schema_store_refused={} if modules.store is None else dict(modules.store.refused),
        schema_modules_filled={k: v for k, v in modules.modules_filled.items() if k != "present"},
        schema_slices=registrations.slices,
        schemas_registering=len(registrations),
        tokens_computed_modules=modules.tokens_computed,
        seam_repair_tokens=engine.intake.blend_tokens,  # the published name of blend's recomputed tokens
        spec_decode_num_draft_tokens=outputs.spec_draft_tokens,
        spec_decode_num_accepted_tokens=outputs.spec_accepted_tokens,
        document_tokens_computed=engine.documents.tokens_computed,
        document_tokens_reused=engine.documents.tokens_reused,
    )


def check_engine_integrity(engine: EngineView) -> None:
    """The pool's and host tier's own checks, plus: every block's ref count equals the
    references the live requests (own blocks and PML module blocks) and the registrations
    hold, so a leaked reference (a block in use that nobody owns) is caught; no host block is
    held between steps. Raises ``RuntimeError``."""
    engine.cache.check_integrity()
    held: dict[int, int] = {}
    for seq in engine.requests():
        for block in (*seq.blocks, *(() if seq.context is None else seq.context.blocks)):
            held[block.block_id] = held.get(block.block_id, 0) + 1
    for block in engine.schemas.held():  # the module a registration is filling
        held[block.block_id] = held.get(block.block_id, 0) + 1
    for block in engine.cache.pool.blocks:
        if block.ref_count != held.get(block.block_id, 0):
            raise RuntimeError(
                f"block {block.block_id} has ref_count {block.ref_count} but live requests hold "
                f"{held.get(block.block_id, 0)} references to it (a leaked or lost reference)"
            )
