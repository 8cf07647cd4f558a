"""What an ``LLMEngine`` reports about itself: its counters (``engine_stats``) and the
consistency check tests and the server call between steps (``check_engine_integrity``).

Both read the engine's cache stack, scheduler and schema registrations and change nothing;
call them on the engine's thread, between steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvreuse.engine.outputs import EngineStats
from kvreuse.tiers.setup import tier_stats

if TYPE_CHECKING:
    from kvreuse.engine.llm_engine import LLMEngine


def engine_stats(engine: LLMEngine) -> EngineStats:
    """A snapshot of the engine's counters and gauges (the server's /metrics reads these)."""
    pool, modules, registrations = engine.pool, engine.modules, engine.registrations
    return EngineStats(
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks - pool.num_cached_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        num_used_blocks=pool.num_used_blocks,
        prefix_cache_queries_tokens=engine.kv.queries_tokens,
        prefix_cache_hits_tokens=engine.kv.hits_tokens,
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        evictions_by_priority=dict(pool.evictions_by_priority),
        blocks_by_priority=dict(pool.blocks_by_priority()),
        num_preemptions=engine.scheduler.num_preemptions,
        tokens_computed=engine.tokens_computed + modules.tokens_computed + engine.documents.tokens_computed,
        events_dropped=None if engine.events is None else engine.events.num_dropped,
        prefix_cache_hits_tokens_by_tier=dict(engine.kv.hits_tokens_by_level),
        tiers={} if engine.host is None else tier_stats(engine.host, engine.kv_bytes_per_token * engine.block_size),
        schema_store_refused={} if modules.store is None else dict(modules.store.refused),
        schema_modules_filled={k: v for k, v in modules.modules_filled.items() if k != "present"},
        schema_slices=registrations.slices,
        schemas_registering=len(registrations),
        tokens_computed_modules=modules.tokens_computed,
        seam_repair_tokens=engine.seam_repair_tokens,
        spec_decode_num_draft_tokens=engine.spec_draft_tokens,
        spec_decode_num_accepted_tokens=engine.spec_accepted_tokens,
        document_tokens_computed=engine.documents.tokens_computed,
        document_tokens_reused=engine.documents.tokens_reused,
    )


def check_engine_integrity(engine: LLMEngine) -> None:
    """The pool's own checks, plus: every block's ref count equals the references the live
    requests (own blocks and PML module blocks) and the registrations hold, so a leaked
    reference (a block in use that nobody owns) is caught; no host block is held between
    steps. Raises ``RuntimeError``."""
    engine.pool.check_integrity()
    if engine.host is not None:
        engine.host.check_integrity()
        if engine.host.pool.num_used_blocks:
            raise RuntimeError(f"{engine.host.pool.num_used_blocks} host blocks are held between steps")
    held: dict[int, int] = {}
    for seq in engine.requests():
        for block in (*seq.blocks, *(() if seq.context is None else seq.context.blocks)):
            held[block.block_id] = held.get(block.block_id, 0) + 1
    for block in engine.registrations.held():  # the module a registration is filling
        held[block.block_id] = held.get(block.block_id, 0) + 1
    for block in engine.pool.blocks:
        if block.ref_count != held.get(block.block_id, 0):
            raise RuntimeError(
                f"block {block.block_id} has ref_count {block.ref_count} but live requests hold "
                f"{held.get(block.block_id, 0)} references to it (a leaked or lost reference)"
            )
