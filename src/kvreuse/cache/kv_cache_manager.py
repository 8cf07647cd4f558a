"""Per-request use of the block pool: prefix hits at admission, blocks as tokens grow,
registration of every block that becomes full, release at the end.

The manager is the only caller of the pool in the engine; it keeps the prefix-cache
counters (queries and hits, in tokens) that ``/metrics`` reports.
"""

from __future__ import annotations

from collections.abc import Callable

from kvreuse.cache.block_pool import BlockPool, KVBlock
from kvreuse.cache.hashing import BlockHash, hash_block, root_extra_keys
from kvreuse.cache.retention import DEFAULT_PRIORITY, requested_block_retention
from kvreuse.engine.sequence import Sequence

# (sequence, block index, block size) -> None when the request asks nothing of this block,
# else (priority or None to keep the block's, duration in s or None for "until evicted")
RetentionFn = Callable[[Sequence, int, int], tuple[int | None, float | None] | None]


def request_retention(seq: Sequence, index: int, block_size: int) -> tuple[int | None, float | None] | None:
    """The retention a request's ``KvCacheRetentionConfig`` gives block ``index``
    (SPEC 3: the range holding the block's first token, decode retention for generated
    blocks); ``None`` without a config."""
    if seq.retention is None:
        return None
    return requested_block_retention(seq.retention, index * block_size, num_prompt_tokens=seq.num_prompt_tokens)


class KVCacheManager:
    """Allocation and prefix caching for sequences. Engine thread only."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        model_id: str,
        hash_algorithm: str = "sha256",
        enable_prefix_caching: bool = True,
        retention_fn: RetentionFn = request_retention,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self.hash_algorithm = hash_algorithm
        self.enable_prefix_caching = enable_prefix_caching
        self.retention_fn = retention_fn
        self.queries_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hits_tokens = 0  # of which served from it

    # ------------------------------------------------------------------ hashing
    def _extend_hashes(self, seq: Sequence, upto_tokens: int) -> None:
        """Make ``seq.block_hashes`` cover every full block within the first ``upto_tokens``."""
        tokens = seq.token_ids
        bs = self.block_size
        for i in range(len(seq.block_hashes), upto_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            extra = root_extra_keys(self.model_id, seq.cache_salt) if i == 0 else ()
            seq.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], extra, self.hash_algorithm))

    # ------------------------------------------------------------------ admission
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, seq: Sequence, *, first_time: bool) -> bool:
        """Give a waiting sequence its blocks: hits from the prefix cache for its leading full
        blocks (never the block holding the last token, whose logits must be computed),
        fresh blocks for the rest. Returns ``False`` and changes nothing when the pool
        cannot hold it now."""
        bs = self.block_size
        num_tokens = seq.num_tokens
        hits: list[KVBlock] = []
        if self.enable_prefix_caching and seq.prompt_positions is None:
            self._extend_hashes(seq, num_tokens)
            max_hit_blocks = (num_tokens - 1) // bs
            tokens = seq.token_ids
            hits = self.pool.match_prefix(
                seq.block_hashes[:max_hit_blocks], [tokens[i * bs : (i + 1) * bs] for i in range(max_hit_blocks)]
            )
        num_new = self.blocks_needed(num_tokens) - len(hits)
        unheld_hits = sum(1 for b in hits if b.ref_count == 0)  # they count as free until acquired
        if num_new > self.pool.num_free_blocks - unheld_hits:
            return False
        # a reuse takes the request's priority when it gives one, and always its duration;
        # worked out before anything is held, so a failure here leaks no block
        wanted = [self.retention_fn(seq, i, bs) or (None, None) for i in range(len(hits))]
        self.pool.acquire(hits)
        for block, (priority, duration) in zip(hits, wanted):
            self.pool.set_retention(block, priority, duration)
        seq.clear_blocks()
        seq.append_blocks(hits + self.pool.allocate(num_new))
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * bs
        if first_time:
            # PML module KV assembled in front of the prompt counts as reused prompt tokens.
            seq.num_cached_tokens = len(hits) * bs + len(seq.context_slots)
            self.queries_tokens += seq.num_prompt_tokens + len(seq.context_slots)
            self.hits_tokens += seq.num_cached_tokens
        return True

    def grow(self, seq: Sequence) -> bool:
        """Make sure every token of ``seq`` has a slot. ``False`` (nothing changed) when
        the pool is out of blocks; the scheduler then preempts someone."""
        missing = self.blocks_needed(seq.num_tokens) - len(seq.blocks)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        seq.append_blocks(self.pool.allocate(missing))
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Register every block whose tokens are now all computed."""
        if not self.enable_prefix_caching or seq.prompt_positions is not None:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, full * bs)
        tokens = seq.token_ids
        for i in range(seq.num_registered_blocks, full):
            wanted = self.retention_fn(seq, i, bs)
            priority, duration = wanted if wanted is not None else (None, None)
            kept = self.pool.register(
                seq.blocks[i],
                seq.block_hashes[i],
                seq.block_hashes[i - 1] if i else None,
                tokens[i * bs : (i + 1) * bs],
                depth=i,
                priority=DEFAULT_PRIORITY if priority is None else priority,
                duration_s=duration,
            )
            if kept is not seq.blocks[i]:
                # Another request registered this block first (e.g. the last block of a
                # block-aligned prompt, never served as a hit): share its copy (same tokens
                # at the same positions, so the same KV) and free ours, so the chain stays
                # one chain and every held block is referenced.
                self.pool.acquire([kept])
                self.pool.release([seq.blocks[i]])
                seq.replace_block(i, kept)
                if wanted is not None:
                    self.pool.set_retention(kept, priority, duration)
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so its chain evicts from the end)."""
        self.pool.release(reversed(seq.blocks))
        seq.clear_blocks()
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def release_context(self, seq: Sequence) -> None:
        """Drop the sequence's references on its PML module blocks (at its end, not on
        preemption: the context stays valid while the sequence waits)."""
        self.pool.release(reversed(seq.context_blocks))
        seq.context_blocks = []
