"""The one admission path into the block pool, and its per-request use by the engine.

Every caller that puts a request's KV into the pool (the engine, PML modules, the
simulator and the routed simulator) goes through two calls here:

    admit(keys, token_blocks, num_blocks=..., max_hits=..., retention=...)
        match the longest cached prefix (stored tokens checked), check capacity, acquire
        the hits and apply the request's retention to them, allocate the rest
        -> Admission(blocks, num_hits), or None with nothing changed
    register(blocks, keys, token_blocks, start, end, retention=...)
        enter full blocks in the prefix index; a block someone else registered first is
        adopted and ours freed, in this one place

The engine's ``admit`` / ``grow`` / ``commit_computed`` / ``free`` wrap them for a
``CachedSequence`` (``cached_sequence.py``: what the engine's ``Sequence`` offers) and keep
the prefix-cache counters (queries and hits, in tokens) that ``/metrics`` reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import overload

from kvreuse.cache.block_pool import BlockPool, KVBlock
from kvreuse.cache.cached_sequence import CachedSequence
from kvreuse.cache.hashing import BlockHash, extend_chain, root_extra_keys
from kvreuse.cache.host_tier import HostTier
from kvreuse.cache.kv_block import DEFAULT_PRIORITY, cdiv
from kvreuse.cache.retention import requested_block_retention
from kvreuse.events.records import HOST_LEVEL

Retention = tuple[int | None, float | None]
"""(priority, or None to keep a reused block's; duration in s, or None for "until evicted")."""

BlockRetention = Callable[[int], Retention | None]
"""Block index -> the retention a request asks for that block; ``None``: it asks nothing."""

# (sequence, block index, block size) -> the retention the request asks for that block
RetentionFn = Callable[[CachedSequence, int, int], Retention | None]


def request_retention(seq: CachedSequence, index: int, block_size: int) -> Retention | None:
    """The retention a request's ``KvCacheRetentionConfig`` gives block ``index``
    (SPEC 3: the range holding the block's first token, decode retention for generated
    blocks); ``None`` without a config."""
    if seq.retention is None:
        return None
    return requested_block_retention(seq.retention, index * block_size, num_prompt_tokens=seq.num_prompt_tokens)


def asks_nothing(index: int) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Admission:
    """What an admitted request holds: ``blocks`` in token order, one reference each owned by
    the caller (release them through the pool, tail first); the first ``num_hits`` came from
    the prefix cache with valid KV, the rest are fresh and must be computed."""

    blocks: tuple[KVBlock, ...]
    num_hits: int  # cached blocks, wherever they were found (device + onboarded)
    num_onboarded: int = 0  # of which copied up from the host tier
    num_loaded: int = 0  # of which read back from the disk / remote stores
    loaded_levels: tuple[str, ...] = ()  # the store level of each loaded block (DISK / REMOTE)


def tokens_by_level(
    admission: Admission, block_size: int, device_level: str, context: dict[str, int] | None = None
) -> dict[str, int]:
    """Cached tokens of one admission per tier (levels with none left out), plus ``context``:
    the reused tokens of a request's assembled context by the tier they were found in."""
    from_host = admission.num_onboarded * block_size
    out = dict(context or {})
    out[device_level] = (
        out.get(device_level, 0) + (admission.num_hits - admission.num_onboarded - admission.num_loaded) * block_size
    )
    if from_host:
        out[HOST_LEVEL] = out.get(HOST_LEVEL, 0) + from_host
    for level in admission.loaded_levels:
        out[level] = out.get(level, 0) + block_size
    return {level: n for level, n in out.items() if n}


class _TokenBlocks(Seq[list[int]]):
    """Block ``j``'s token ids of a token list, sliced when asked (a registration touches
    only its new blocks; iteration stops at the last full block)."""

    __slots__ = ("tokens", "block_size")

    def __init__(self, tokens: list[int], block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return len(self.tokens) // self.block_size

    @overload
    def __getitem__(self, j: int) -> list[int]: ...

    @overload
    def __getitem__(self, j: slice) -> list[list[int]]: ...

    def __getitem__(self, j: int | slice) -> list[int] | list[list[int]]:
        if isinstance(j, slice):  # the Sequence protocol; the cache only indexes
            return [self[i] for i in range(*j.indices(len(self)))]
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self.tokens[j * self.block_size : (j + 1) * self.block_size]


class KVCacheManager:
    """Allocation and prefix caching for sequences. Engine thread only (the simulators
    own their pools and call ``admit``/``register`` alone)."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        model_id: str = "",
        hash_algorithm: str = "sha256",
        enable_prefix_caching: bool = True,
        retention_fn: RetentionFn = request_retention,
        lower: HostTier | None = None,
    ) -> None:
        if lower is not None and pool._evicted is None:
            raise ValueError("a pool with a host tier below must be built with record_evictions=True")
        self.pool = pool
        self.lower = lower  # host tier: device evictions go there, admission continues there
        self.block_size = pool.block_size
        self.model_id = model_id
        self.hash_algorithm = hash_algorithm
        self.enable_prefix_caching = enable_prefix_caching
        self.retention_fn = retention_fn
        self.queries_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hits_tokens = 0  # of which served from it
        self.hits_tokens_by_level: dict[str, int] = {}  # of which per tier: GPU (device), CPU (host), DISK, REMOTE

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ the admission path
    def admit_blocks(
        self,
        keys: Seq[BlockHash],
        token_blocks: Seq[Seq[int]],
        *,
        num_blocks: int,
        max_hits: int | None = None,
        retention: BlockRetention = asks_nothing,
    ) -> Admission | None:
        """Hold ``num_blocks`` blocks for a request whose leading blocks have ``keys`` /
        ``token_blocks`` (indexable and iterable, one entry per key at least): the longest
        cached run of them (at most ``max_hits``, default all) is acquired, each hit taking the
        request's retention (its priority when it gives one, its duration always), and fresh
        blocks make up the rest. Returns ``None`` and changes
        nothing when the pool cannot hold them now."""
        limit = len(keys) if max_hits is None else min(max_hits, len(keys))
        hits = self.pool.match_prefix(keys[:limit], token_blocks) if limit > 0 else []
        n = len(hits)
        num_new = num_blocks - n  # blocks found below the device need fresh device blocks too
        unheld_hits = sum(1 for b in hits if b.ref_count == 0)  # they count as free until acquired
        if num_new > self.pool.num_free_blocks - unheld_hits:
            return None
        below: list[KVBlock] = []
        stored: list = []
        if self.lower is not None and n < limit:  # the chain goes on in the host tier? in the stores?
            below = self.lower.match(keys[n:limit], (token_blocks[j] for j in range(n, limit)))
            j = n + len(below)
            if j < limit:  # store IO only now that the admission goes through
                stored = self.lower.match_stores(
                    keys[j:limit], (token_blocks[i] for i in range(j, limit)), keys[j - 1] if j else None, j
                )
        # worked out before anything is held, so a failure here leaks no block
        wanted = [retention(i) or (None, None) for i in range(n + len(below) + len(stored))]
        self.pool.acquire(hits)
        for block, (priority, duration) in zip(hits, wanted):
            self.pool.set_retention(block, priority, duration)
        blocks = hits + self.allocate(num_new)
        if below or stored:
            j = n + len(below)
            ids = [b.block_id for b in blocks]
            moved = self.lower.onboard(below, ids[n:j]) + self.lower.load(stored, ids[j : j + len(stored)])  # type: ignore[union-attr]  # blocks from below imply a lower tier
            self._register_moved(blocks, keys, token_blocks, n, moved, wanted)
        return Admission(
            tuple(blocks), n + len(below) + len(stored), len(below), len(stored), tuple(s.level for s in stored)
        )

    def allocate(self, n: int) -> list[KVBlock]:
        """``n`` fresh blocks (``BlockPool.allocate``: check capacity first); what it evicted
        goes down to the host tier before anyone writes the evicted slots."""
        blocks = self.pool.allocate(n)
        if self.lower is not None:
            evicted = self.pool.take_evicted()
            if evicted:
                self.lower.offload(evicted)
        return blocks

    def _register_moved(self, blocks: list[KVBlock], keys, token_blocks, n: int, moved: list[tuple], wanted) -> None:
        """Register ``blocks[n:n+len(moved)]``, just filled from a lower tier, on the device
        with the retention they had there, then apply the request's (as for any hit)."""
        kept = {j: (priority, duration) for j, (_, _, _, priority, duration) in enumerate(moved, n)}
        self.register_blocks(blocks, keys, token_blocks, n, n + len(moved), retention=kept.get)
        for j in range(n, n + len(moved)):
            priority, duration = wanted[j]
            self.pool.set_retention(blocks[j], priority, duration)

    def register_blocks(
        self,
        blocks: list[KVBlock],
        keys: Seq[BlockHash],
        token_blocks: Seq[Seq[int]],
        start: int,
        end: int,
        *,
        retention: BlockRetention = asks_nothing,
        default_priority: int = DEFAULT_PRIORITY,
    ) -> None:
        """Enter ``blocks[start:end]`` (computed, held by the caller) in the prefix index under
        ``keys``, each with the retention asked for it (``default_priority`` where it gives no
        priority). A key another request registered first (e.g. the last block of a
        block-aligned prompt, never served as a hit) is shared instead: the caller's
        ``blocks[j]`` is replaced by the registered copy (same tokens at the same positions,
        so the same KV), which it now holds, and its own block is freed, so a chain stays one
        chain and every held block is referenced. Mutates ``blocks``."""
        for j in range(start, end):
            wanted = retention(j)
            priority, duration = wanted if wanted is not None else (None, None)
            kept = self.pool.register(
                blocks[j],
                keys[j],
                keys[j - 1] if j else None,
                token_blocks[j],
                depth=j,
                priority=default_priority if priority is None else priority,
                duration_s=duration,
            )
            if kept is not blocks[j]:
                self.pool.acquire([kept])
                self.pool.release([blocks[j]])
                blocks[j] = kept
                if wanted is not None:
                    self.pool.set_retention(kept, priority, duration)
        if self.lower is not None:  # the tiers are exclusive: a key now on the device leaves the host
            self.lower.drop(keys[start:end])

    # ------------------------------------------------------------------ sequences
    def _extend_hashes(self, seq: CachedSequence, upto_tokens: int) -> None:
        """Make ``seq.block_hashes`` cover every full block within the first ``upto_tokens``."""
        extend_chain(
            seq.block_hashes,
            seq.token_ids,
            self.block_size,
            root_extra=root_extra_keys(self.model_id, seq.cache_salt),
            algorithm=self.hash_algorithm,
            upto_tokens=upto_tokens,
        )

    def _token_blocks(self, seq: CachedSequence) -> _TokenBlocks:
        return _TokenBlocks(seq.token_ids, self.block_size)

    def admit(self, seq: CachedSequence, *, first_time: bool) -> bool:
        """Give a waiting sequence its blocks: hits from the prefix cache for its leading full
        blocks (never the block holding the last token, whose logits must be computed),
        fresh blocks for the rest. Returns ``False`` and changes nothing when the pool
        cannot hold it now."""
        bs = self.block_size
        num_tokens = seq.num_tokens
        keys: list[BlockHash] = []
        max_hits = 0
        if self.enable_prefix_caching and seq.prompt_positions is None:
            self._extend_hashes(seq, num_tokens)
            max_hits = (num_tokens - 1) // bs
            keys = seq.block_hashes[:max_hits]
        admission = self.admit_blocks(
            keys,
            self._token_blocks(seq),
            num_blocks=self.blocks_needed(num_tokens),
            max_hits=max_hits,
            retention=lambda i: self.retention_fn(seq, i, bs),
        )
        if admission is None:
            return False
        seq.clear_blocks()
        seq.append_blocks(admission.blocks)
        seq.num_registered_blocks = admission.num_hits
        seq.num_computed_tokens = admission.num_hits * bs
        if first_time:
            reused_context = 0 if seq.context is None else seq.context.num_reused
            by_level = tokens_by_level(
                admission,
                bs,
                self.pool.cache_level,
                None if seq.context is None else seq.context.reused_by_level(self.pool.cache_level),
            )
            seq.cached_tokens_by_tier = by_level
            for level, n in by_level.items():
                self.hits_tokens_by_level[level] = self.hits_tokens_by_level.get(level, 0) + n
            # PML module KV assembled in front of the prompt counts as reused prompt tokens.
            seq.num_cached_tokens = admission.num_hits * bs + reused_context
            self.queries_tokens += seq.num_prompt_tokens + seq.num_context_tokens
            self.hits_tokens += seq.num_cached_tokens
        return True

    def grow(self, seq: CachedSequence, extra: int = 0) -> bool:
        """Make sure every token of ``seq``, and ``extra`` slots after them (a draft to
        verify), has a slot. ``False`` (nothing changed) when the pool is out of blocks; the
        scheduler then preempts someone (or drops the draft)."""
        missing = self.blocks_needed(seq.num_tokens + extra) - len(seq.blocks)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        seq.append_blocks(self.allocate(missing))
        return True

    def commit_computed(self, seq: CachedSequence) -> None:
        """Register every block whose tokens are now all computed."""
        if not self.enable_prefix_caching or seq.prompt_positions is not None:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, full * bs)
        blocks = list(seq.blocks)  # register_blocks may put a shared copy in place of one of ours
        self.register_blocks(
            blocks,
            seq.block_hashes,
            self._token_blocks(seq),
            seq.num_registered_blocks,
            full,
            retention=lambda i: self.retention_fn(seq, i, bs),
        )
        for i in range(seq.num_registered_blocks, full):
            if blocks[i] is not seq.blocks[i]:
                seq.replace_block(i, blocks[i])
        if self.lower is not None:
            self.lower.write_through(blocks[seq.num_registered_blocks : full])
        seq.num_registered_blocks = full

    def trim(self, seq: CachedSequence) -> None:
        """Release the blocks past the ones ``seq``'s tokens need (they held only rejected
        draft tokens: never computed as accepted, never registered)."""
        keep = self.blocks_needed(seq.num_tokens)
        if len(seq.blocks) > keep:
            assert seq.num_registered_blocks <= keep, "a registered block held a rejected draft"
            self.pool.release(reversed(seq.drop_tail_blocks(keep)))

    def free(self, seq: CachedSequence) -> None:
        """Release every block of ``seq`` (tail first, so its chain evicts from the end)."""
        self.pool.release(reversed(seq.blocks))
        seq.clear_blocks()
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def release_context(self, seq: CachedSequence) -> None:
        """Drop the sequence's references on its context blocks (PML modules) at its end;
        not on preemption: the context stays valid while the sequence waits."""
        if seq.context is not None:
            seq.context.release()
